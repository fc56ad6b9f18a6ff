"""The op registry: the ``Op`` record and the ``OPS`` table every op family registers into.

An entry holds
  shape   (a_shape, b_shape, s) -> out_shape; raises ``Bad`` with the reason when inputs do not fit,
  fwd     (a, b, s, out, ws) -> None, the NumPy forward written into ``out``,
  da, db  (g, out, a, b, s, ws) -> the contribution to d loss/d a (or b), read like the derivative;
          a contribution may be out-shaped for a broadcasting input (the tape sums it down),
  ref     (jnp, a, b, s) -> out, an independently written JAX reference (only tests and interop call
          it, passing jax.numpy with ``jnp.lax`` and ``jnp.scipy`` reaching jax.lax and jax.scipy),
  inputs  one letter per input: "f" float (differentiable), "n" float that passes no gradient
          (``stop_gradient``: its result is a constant of the loss), "i" integer data, "b" boolean data;
          data inputs (indices, masks) are tape leaves made by ``tape.const`` of an integer or bool
          array, never differentiated, settable per episode in a captured program,
  check   (a, b, s[, c]) -> None, optional: validates data inputs' values (indices in range),
          raising ``Bad``; the tape calls it on every apply, a program on every ``set_input``,
  c_fwd, c_da, c_db
          the same arithmetic as one C expression per element (elementwise ops only), over the names
          ``a b c s out g``; every one mirrors its NumPy form operation by operation, so compiled with
          ``-ffp-contract=off`` it rounds the same way,
  tier    how exactly a compiled replay reproduces the tape (see ``TIERS``),
  ulps    optional ``(k, floor)``: a libm-tier op's own bound where its C and NumPy/SciPy forms differ by
          more than the tier's 8 ulp: within k ulp, or k·eps·max(floor, max|result|) absolutely (floor 1
          for functions whose forms agree only absolutely near a zero, like lgamma at 1 and 2),
  aliases True when ``da``/``db`` may return ``g`` itself or a view of it (otherwise a contribution
          is a fresh scratch buffer that the tape may adopt as the input's gradient, saving a copy),
  keep    optional ``(a_shape, s) -> shapes``: buffers the forward fills for the backward to read
          (residuals, as ``exp(a − max)`` of a softmax), so the backward need not recompute them;
          such an op's ``fwd`` and rules take the tuple of those buffers last, where a third input
          would go (an op has one or the other); the tape keeps them beside the value until
          ``reset_to``, a replay beside its value buffer (memory for time: softmax_xent holds a
          second logits-sized buffer for the episode),
  derivative
          False for an op whose backward is deliberately not the derivative of its forward
          (``with_grad``: one input's value, the other's gradient); finite differences skip it,
  domain  one sampler per input for tests (e.g. positive inputs for ``log``),
  cases   ``(a_shape, b_shape, s)`` examples the tests sweep, broadcasting included.

An op may have a third input ``c``; it is always data (a ``where`` mask, scatter indices), so only
``a`` and ``b`` ever receive gradients. Such an op's rules take it last: ``shape(a, b, s, c)``,
``fwd(a, b, s, out, ws, c)``, ``da(g, out, a, b, s, ws, c)``, ``ref(jnp, a, b, s, c)``, and its
``cases`` are ``(a, b, s, c)``. In ``cases`` a data input is given as the array itself (the values
matter: indices must be in range), a float input as its shape.

``ws`` is the scratch provider (``ws.take(shape)``, ``ws.take_mask(shape)``): the tape hands out
arena memory, a captured program hands out buffers it preallocated, so the same rules run with no
allocation in a replay. Static operands ``s`` are plain hashable values: a float for ``adds``, a
normalised ``(axes, keepdims)`` pair for reductions, a shape for ``reshape``.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional


TIERS = {
    "exact": "IEEE-exact arithmetic (+ - * / sqrt, comparisons, data movement): compiled == tape",
    "libm": "a transcendental function: NumPy's SIMD libm and the C library may differ by a few ulp",
    "order": "a reduction: compiled code may sum in another order than NumPy (bounded by n·eps·Σ|x|)",
    "blas": "a product computed by BLAS: the kernel's blocking decides the summation order",
}


class Bad(Exception):
    """Raised by a shape rule: the text says what was expected and what came."""


@dataclass(frozen=True, eq=False)
class Op:
    name: str
    arity: int
    shape: Callable
    fwd: Optional[Callable] = None
    da: Optional[Callable] = None
    db: Optional[Callable] = None
    ref: Optional[Callable] = None
    c_fwd: Optional[str] = None
    c_da: Optional[str] = None
    c_db: Optional[str] = None
    tier: str = "exact"
    kind: str = "elementwise"
    aliases: bool = False
    domain: tuple = ()
    cases: tuple = ()
    doc: str = ""
    inputs: str = ""
    check: Optional[Callable] = None
    ulps: Optional[tuple] = None
    keep: Optional[Callable] = None
    derivative: bool = True

    def __post_init__(self):
        kinds = self.inputs or "f" * self.arity
        assert len(kinds) == self.arity and set(kinds) <= set("fnib"), (self.name, kinds)
        assert self.arity < 3 or kinds[2] != "f", f"{self.name}: a third input is data (see the module docstring)"
        assert self.keep is None or kinds == "f" * self.arity, f"{self.name}: kept buffers take a data input's place"
        object.__setattr__(self, "inputs", kinds)
        object.__setattr__(self, "data", kinds != "f" * self.arity)

    def __repr__(self):
        return f"<op {self.name}>"


OPS: dict = {}

DATA_KINDS = {"i": "integer", "b": "bool"}


def op(name, arity, shape, **kw):
    entry = Op(name, arity, shape, **kw)
    assert name not in OPS, name
    OPS[name] = entry
    return entry


# ── test domains ─────────────────────────────────────────────────────────────

def real(rng, shape):
    return rng.standard_normal(shape)


def positive(rng, shape):
    return rng.uniform(0.5, 2.0, shape)


def away0(rng, shape):
    """Nonzero, at least 0.2 from the kink at 0 (relu, abs; atan2's branch cut at a = 0)."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.2, 2.0, shape)


GRID = 0.37


def spread(rng, shape):
    """Distinct values (max, min, sort, cummax, max_pool): a permutation of a grid of step ``GRID``
    centred on 0 (multiples of GRID for an odd count, odd multiples of GRID/2 for an even one)."""
    n = math.prod(shape)
    return (rng.permutation(n) - n / 2.0 + 0.5).reshape(shape) * GRID


def between(rng, shape):
    """``spread`` shifted by a quarter step (maximum's b): no value equals one ``spread`` draws for a, of
    any size, and each is at least GRID/4 from all of them, so a and b never tie."""
    return spread(rng, shape) + GRID / 4


# The samplers that keep an op's inputs off its kinks (ties, 0, a branch cut), and the distance they
# keep: |x| >= 0.2 (away0); any two values at least GRID apart (spread); at least GRID/4 from every value
# spread draws (between). A finite difference stepping at most a quarter of it along a unit direction
# moves any difference of two entries by at most √2/4 of it: it never reaches a kink (tests/test_ops*.py
# choose their steps so). The fuzzer (tests/test_fuzz.py) reads an op with such a domain as one whose
# derivative jumps.
MARGIN = {away0: 0.2, spread: GRID, between: GRID / 4}


def markdown_table():
    """The op table of docs/ops.md, generated from the registry (tests/test_docs.py keeps the page in sync)."""
    rows = ["| op | inputs | kind | exactness tier | scalar C form (forward) | what it is |",
            "|---|---|---|---|---|---|"]
    cell = lambda text: text.replace("|", "\\|")   # noqa: E731  (a bar inside a cell would split it)
    for o in OPS.values():
        c = f"`{cell(o.c_fwd)}`" if o.c_fwd else "—"
        rows.append(f"| `{o.name}` | {o.arity} | {o.kind} | {o.tier} | {c} | {cell(o.doc or '')} |")
    return "\n".join(rows)
