"""The oracle's primitive table, at the bottom of the package: the rules that record each JAX primitive
on a tape, the control-flow rules, the index maps, and the sets that say how a primitive's results are
taken. Families register into it (``rules``, ``loops``, ``trust``); the replay reads it. It imports
nothing of the package, as ``tapegrad/ops/registry.py`` imports no op family.
"""
import tapegrad as tg
from tapegrad.errors import TapeError


class UnsupportedPrimitiveError(TapeError, NotImplementedError):
    """The jaxpr uses primitives the tape cannot replay on differentiable values (named in the message)."""


class NotReplayable(Exception):
    """Raised by a rule for a form of its primitive the tape cannot replay (the message says which)."""


RULES = {}         # primitive -> rule (r, xs, eqn) -> Var(s) (rules.py)
DOCS = {}          # primitive -> how it is replayed (the table of docs/oracle.md)
NEEDS = {}         # primitive -> tapegrad functions the rule calls
CONTROL_RULES = {}  # scan, while, cond, custom_linear_solve -> rule (r, st, xs, jenv) (loops.py)
INDEX_MAPS = {}    # gather/scatter -> the flat index map JAX computes for them (rules.py)
CUSTOM = {}        # "trusted" -> the rule of a custom call check_grads was asked to trust (trust.py)


def rule(*names, doc, needs=()):
    def register(fn):
        for n in names:
            RULES[n] = fn
            DOCS[n] = doc
            NEEDS[n] = tuple(needs)
        return fn
    return register


def missing(name):
    """The tapegrad functions a primitive's rule needs that this tapegrad lacks."""
    return [n for n in NEEDS.get(name, ()) if not hasattr(tg, n)]


# Piecewise-constant results (zero derivative almost everywhere): JAX's values, recorded as constants.
CONSTANT = frozenset({"sign", "floor", "ceil", "round", "stop_gradient", "nextafter", "is_finite",
                      "argmax", "argmin", "iota", "random_bits", "random_seed", "random_wrap", "random_unwrap",
                      "random_fold_in", "random_split", "threefry2x32", "eq", "ne", "gt", "ge", "lt", "le",
                      "and", "or", "not", "xor", "population_count", "shift_left", "shift_right_logical",
                      "shift_right_arithmetic", "bitcast_convert_type"})


# Rules that read JAX's values of their own operands or results (the replay keeps those for them),
# and rules whose results follow their operands one by one (an untainted operand stays untainted).
VALUE_RULES = frozenset({"gather", "clamp", "top_k", "sort", "lu", "custom_linear_solve", "pow", "erf_inv",
                         "bessel_i0e", "bessel_i1e", "polygamma", "igamma", "igammac", "eigh", "qr", "svd",
                         "cholesky"})
PER_OPERAND = frozenset({"optimization_barrier", "sort"})




def primitive_table():
    """docs/oracle.md's table of covered primitives (a test keeps it in sync)."""
    rows = ["| primitive | replayed on the tape as |", "|---|---|"]
    waiting = [n for n in sorted(DOCS) if missing(n)]
    for name in sorted(DOCS):
        if name not in waiting:
            rows.append(f"| `{name}` | {DOCS[name]} |")
    rows.append("| any call carrying a jaxpr (`jit`, `remat2`/`checkpoint`, `closed_call`, `custom_jvp_call`, "
                "`custom_vjp_call`, …) | inlined by its primal body; a custom rule is checked against it |")
    rows.append(f"| {', '.join(f'`{n}`' for n in sorted(CONSTANT))} | piecewise constant: JAX's value, "
                "a constant on the tape |")
    rows.append("| anything whose results are integers, booleans or keys | JAX's value, a constant on the tape |")
    if waiting:
        names = ", ".join(f"`{n}`" for n in waiting)
        rows.append(f"| {names} | not yet: the tapegrad functions they need are missing |")
    return "\n".join(rows)
