"""A griffe extension for the API pages: doctest lines in a docstring's prose render as code.

The docstrings keep their examples as bare ``>>>`` lines (pytest runs them as doctests); Markdown would
read ``>>>`` as nested quotes, so each run of prompt and output lines is fenced as ``pycon``. A docstring
with a numpy-style ``Examples`` section is left as it is: the parser fences that section itself.
"""
import re

import griffe

_SECTION = re.compile(r"^[ \t]*Examples\n[ \t]*-{3,}$", re.M)
# a run of lines starting with a ">>> " prompt, with the continuation and output lines after it
_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)>>> .*(?:\n(?!(?P=indent)[ \t]*$)(?P=indent)\S.*)*", re.M)


def fence(text: str) -> str:
    """``text`` with each doctest example fenced, at its own indentation."""
    def one(m: "re.Match[str]") -> str:
        pad = m.group("indent")
        return f"{pad}```pycon\n{m.group(0)}\n{pad}```"
    return _EXAMPLE.sub(one, text)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None and ">>> " in obj.docstring.value and not _SECTION.search(obj.docstring.value):
            obj.docstring.value = fence(obj.docstring.value)
