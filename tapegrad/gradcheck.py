"""Gradient checking by central finite differences along random directions."""
from typing import Callable, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from .tape import Tape, Var


class GradcheckReport(NamedTuple):
    """What ``gradcheck`` found.

    Attributes:
        ok: Whether every input's error is within ``rtol``.
        errors: Per input, the largest relative error of <∇f, u> against the finite difference.
        worst: The index of the input with the largest error (-1 without inputs).
        grads: The tape's gradient of each input.
    """
    ok: bool
    errors: tuple
    worst: int
    grads: tuple

    def __str__(self):
        state = "ok" if self.ok else "FAILED"
        return f"gradcheck {state}: worst input {self.worst}, relative errors {[f'{e:.2e}' for e in self.errors]}"


def gradcheck(fn: Callable[..., Var], *arrays: ArrayLike, eps: float = 1e-6, rtol: float = 1e-6,
              atol: float = 1e-9, directions: int = 3, seed: int = 0) -> GradcheckReport:
    """Check the tape gradient of ``fn`` against central finite differences.

    For each input and ``directions`` random unit directions u the identity ⟨∇f, u⟩ ≈ (f(x+εu) −
    f(x−εu)) / 2ε is checked with ``|a − b| <= atol + rtol·max(|a|, |b|)``. In float64 with ε = 1e-6
    the finite difference is accurate to about 1e-8 relative for smooth fns with O(1) curvature, so
    the defaults sit well above the noise and far below any wrong rule. A NaN gradient fails.

    Args:
        fn: ``fn(tape, *vars)`` builds a one-element result on ``tape`` from the parameters made of
            ``arrays`` (it is called again on fresh float64 tapes for the finite differences).
        *arrays: The point to check at, one array per input.
        eps: The finite-difference step ε.
        rtol: The relative tolerance.
        atol: The absolute tolerance.
        directions: Random unit directions per input.
        seed: The seed of the directions.

    Returns:
        The report: ``ok``, the error per input, the worst input and the tape's gradients.

    Examples:
        >>> import numpy as np, tapegrad as tg
        >>> f = lambda t, x: (x.tanh() * x).sum()
        >>> report = tg.gradcheck(f, np.linspace(-1, 1, 5))
        >>> report.ok, report.worst
        (True, 0)
    """
    data = [np.asarray(a, dtype=np.float64) for a in arrays]
    tape = Tape()
    xs = [tape.param(a) for a in data]
    out = fn(tape, *xs)
    tape.backward(out)
    grads = tuple(np.array(tape.grad(x)) for x in xs)

    def f(vals):
        t = Tape()
        return float(np.asarray(t.value(fn(t, *[t.param(v) for v in vals]))).reshape(()))

    rng = np.random.default_rng(seed)
    errors = []
    for k, a in enumerate(data):
        worst = 0.0
        for _ in range(directions):
            u = rng.standard_normal(a.shape)
            u /= max(float(np.linalg.norm(u)), 1e-300)
            plus = [v if j != k else v + eps * u for j, v in enumerate(data)]
            minus = [v if j != k else v - eps * u for j, v in enumerate(data)]
            fd = (f(plus) - f(minus)) / (2 * eps)
            an = float(np.sum(grads[k] * u))
            err = abs(fd - an) / (atol / rtol + max(abs(fd), abs(an)))
            if not err <= worst:   # a NaN too: max(worst, nan) would keep worst and pass a NaN gradient
                worst = err
        errors.append(worst)
    worst_input = int(np.argmax(errors)) if errors else -1
    return GradcheckReport(all(e <= rtol for e in errors), tuple(errors), worst_input, grads)
