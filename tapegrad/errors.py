"""The exceptions tapegrad raises: one family, each message naming who failed and why."""


class TapeError(Exception):
    """Base of every error tapegrad raises on purpose.

    Messages follow one form: ``<op> (node <id>): <what was expected>, got <what came>; <what to do>``.
    Each subclass also derives from the built-in exception it refines (``ShapeError`` is a
    ``ValueError``), so ``except ValueError`` catches it too.

    Examples:
        A poisoning tape keeps the error instead of raising it:

        >>> import numpy as np, tapegrad as tg
        >>> tape = tg.Tape(on_error="poison")
        >>> _ = tape.param(np.ones(2)) @ tape.param(np.ones((3, 1)))
        >>> print(tape.error)
        matmul (node 2): expected two 2-D operands, got shapes (2,) and (3, 1)
        >>> isinstance(tape.error, tg.ShapeError), isinstance(tape.error, ValueError)
        (True, True)
    """


class ShapeError(TapeError, ValueError):
    """Shapes that do not fit the op (broadcasting, matmul inner dims, axes, reshape sizes)."""


class DTypeError(TapeError, TypeError):
    """A dtype the tape cannot hold (only float32 and float64 are allowed)."""


class ForeignVarError(TapeError, ValueError):
    """A Var from another tape, or one that ``reset_to`` dropped."""


class LazyValueError(TapeError, ValueError):
    """A value asked of a node that depends on a lazy or dropped constant."""


class NonFiniteError(TapeError, FloatingPointError):
    """A non-finite value or gradient where ``check_finite=True`` forbids one."""


class DomainError(TapeError, ValueError):
    """An input value outside the op's domain (a matrix that is not positive definite, a singular one)."""


class BuildError(TapeError, RuntimeError):
    """Native code could not be built or loaded: no compiler, a failing or hanging compiler, an unusable
    build cache (read-only, not a folder, corrupt artifacts that cannot be rebuilt)."""


class CheckpointError(TapeError, ValueError):
    """A checkpoint file that cannot be read or written (missing, truncated, corrupt, not a checkpoint)."""


class ConfigError(TapeError, ValueError):
    """A setting outside its valid range (e.g. Adam's ``b1 >= 1``, a negative learning rate)."""


class VerificationError(TapeError, RuntimeError):
    """A compiled program (native or cupy) whose first run differs from the NumPy reference beyond an op's
    exactness tier (``capture(..., verify=True)``, see ``tapegrad.verify``): the program refuses to run."""


def at(op: str, node: int) -> str:
    """The message prefix ``op (node i)`` every error starts with."""
    return f"{op} (node {node})"


class ArgumentError(TapeError, TypeError):
    """An argument of the wrong kind (e.g. an array where a Var is expected)."""
