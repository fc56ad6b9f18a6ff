"""Builds the tape's optional C core (tapegrad/_ctape.c); everything else about the package is in pyproject.toml.

Without a C compiler or Python's headers the core cannot be built: the install still succeeds (the same
code paths run in Python, about 1.6x slower), this build says so with a warning (pip 26.3 and later show a
build's warnings; 24.0 to 26.2 were tried and hide all of its output unless run with -v), and ``import
tapegrad`` warns once per process (``tapegrad.CCoreWarning``), the warning to rely on. Warnings of the compiler do not stop a user's build;
tests/test_ctape.py compiles the core with warnings as errors.
"""
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CORE = Extension("tapegrad._ctape", sources=["tapegrad/_ctape.c"])

NOT_BUILT = ("tapegrad: the tape's C core (tapegrad/_ctape.c) could not be built ({why}). tapegrad is installed "
             "and works, but its eager tape runs the Python paths, about 1.6x slower. To build it, install "
             "Python's headers and a C compiler (e.g. `apt-get install python3-dev gcc`) and reinstall "
             "tapegrad; or set TAPEGRAD_PURE=1 to choose the Python paths on purpose.")


class BuildCore(build_ext):
    """build_ext that turns a failed build of the C core into a warning naming the cost and the fix."""

    def run(self):
        try:
            super().run()
        except Exception as e:   # no compiler at all: distutils fails before any extension
            self._not_built(e)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:   # the compiler failed (no Python.h, a broken $CC)
            self._not_built(e)

    def _not_built(self, err):
        why = " ".join(str(err).split())[:300] or type(err).__name__
        warnings.warn(NOT_BUILT.format(why=why), stacklevel=2)


if __name__ == "__main__":
    setup(ext_modules=[CORE], cmdclass={"build_ext": BuildCore})
