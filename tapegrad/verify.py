"""Verification on first run: a compiled program's values, gradients and first optimizer step checked
node by node against the NumPy reference rules, each within its op's exactness tier.

``capture(..., backend="native" or "cupy")`` runs the program once and compares (``verify=False`` skips
it). Each compute node's value is recomputed by the registry's NumPy forward from the *program's own*
values of its inputs, and each gradient rebuilt by the NumPy rules from the program's own values and
consumer gradients, so an op is held to its own tier and a last-bit difference upstream never makes a
downstream exact op look wrong. Bounds per tier (``docs/design.md``, "Verification on first run"):

- "exact", "order": ``==`` (NaN where NumPy has NaN; ``-0.0 == 0.0``);
- "libm": 8 ulp, or the op's ``ulps = (k, floor)``: k·spacing + k·eps·max(floor, max|NumPy|);
- "blas" products (matmul, bmm, conv): ``2·K·eps·(|A|·|B|)`` per element, K the number of products
  summed, true for any summation order and blocking; the same rule evaluated on ``|A|`` and ``|B|``
  gives ``|A|·|B|``;
- "blas" linear algebra: ``==`` natively (LAPACK at the same addresses as NumPy's side); on the device
  (serial algorithms) 16 ulp of max|NumPy|, the bound ``tests/test_gpu_ops_more.py`` states;
- a gradient summed from several contributions: ``==`` when every contribution is exact, else the sum of
  their bounds plus the rounding of the additions.

>>> import numpy as np, tapegrad as tg
>>> tape = tg.Tape()
>>> w = tape.param(np.array([[0.5, -1.0], [2.0, 0.25]]))
>>> loss = tg.softmax_cross_entropy(tape.const(np.eye(2)) @ w, tape.const(np.eye(2)))
>>> prog = tg.capture(tape, loss)             # the NumPy replay: the reference itself
>>> check_run(prog)                           # any program can be checked; a native one is at capture
>>> bound(tg.ops.OPS["exp"], np.array([1.0]), np.array([1.0 + 2e-16]))
array([3.55271368e-15])
"""
from __future__ import annotations

import copy
import math
import types

import numpy as np

from .errors import VerificationError, at
from .ops import Bad
from .tape import unbroadcast

LIBM_ULPS = 8      # the libm tier (tests/test_native.py's ``within``)
DEVICE_LAPACK_ULPS = 16   # device linear algebra vs LAPACK (tests/test_gpu_ops_more.py's ``within_blas``)


class _Fresh:
    """Scratch for the reference rules: a new buffer per request (verification runs once)."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def take(self, shape):
        return np.empty(shape, self.dtype)

    def take_mask(self, shape):
        return np.empty(shape, np.bool_)


# ── what the backend computed ────────────────────────────────────────────────

class _Host:
    """A native program's buffers: the program's own host arrays (None: held only in a fused loop's
    local, ``tapegrad.native.fuse.registers``)."""

    def __init__(self, prog):
        self.p = prog
        self.registers = getattr(prog.runner, "registers", frozenset())

    def sync(self):
        pass

    def value(self, k):
        return None if ("v", k) in self.registers else self.p.val[k]

    def grad(self, k):
        return None if ("g", k) in self.registers else self.p.grads[k]

    def moment(self, kind, j):
        return (self.p.opt.mu if kind == "M" else self.p.opt.nu)[j]

    def clip_norm(self):
        return float(self.p.runner.sc[4])

    def flush(self):
        pass


class _Device:
    """A CuPy program's device buffers, copied to the host (None: the device holds no such buffer)."""

    def __init__(self, prog):
        self.p, self.r = prog, prog.runner

    def sync(self):
        self.r.stream.synchronize()

    def _get(self, key, shape):
        d = self.r.dev.get(key)
        return None if d is None else self.r.cupy.asnumpy(d).reshape(shape)

    def value(self, k):
        got = self._get(("v", k), self.p.shapes[k])
        return self.p.val[k] if got is None and not self.p.nodes[k][0].arity else got

    def grad(self, k):
        return self._get(("g", k), self.p.shapes[k])

    def moment(self, kind, j):
        return self._get((kind, j), self.p.shapes[self.p.opt.ids[j]])

    def flush(self):
        """Inputs written on the host (``Program._put``) up to the device now."""
        with self.r.stream:
            self.r.upload_inputs()
        self.r.stream.synchronize()

    def clip_norm(self):
        """The device's norm: its per-parameter Σ g² (scratch S1000), added in double in order."""
        from .gpu.source import CLIP
        o = self.p.opt
        sums = self.r.cupy.asnumpy(self.r.dev[("S", CLIP)])[:sum(o.touched)]
        total = 0.0
        for q in sums:
            total += float(q)
        return math.sqrt(total)


def _buffers(prog):
    return _Device(prog) if prog.backend == "cupy" else _Host(prog)


# ── bounds ───────────────────────────────────────────────────────────────────

def _kind(op, backend):
    """How ``op``'s results are compared: "exact", "libm", "product" or "lapack"."""
    if op.tier in ("exact", "order"):
        return "exact"
    if op.tier == "libm":
        return "libm"
    if op.kind in ("matmul", "conv"):
        return "product"
    return "exact" if backend == "native" else "lapack"


def _finite_max(a):
    a = np.abs(a[np.isfinite(a)]) if np.size(a) else a
    return float(a.max()) if np.size(a) else 0.0


def bound(op, got, want, ulps=None):
    """The libm tier's elementwise bound on |got − want| for ``op`` (``ulps``: another ``(k, floor)``):
    k·spacing(max(|got|, |want|)) + k·eps·max(floor, max|want|), k = 8 unless the op states its own."""
    k, floor = ulps or op.ulps or (LIBM_ULPS, 0.0)
    eps = float(np.finfo(want.dtype).eps)
    mag = np.maximum(np.abs(got), np.abs(want))
    return k * np.spacing(mag).astype(np.float64) + k * eps * max(_finite_max(want), floor)


def _ulps_part(k, floor, c, eps):
    """A libm-style bound for a contribution whose compiled counterpart is not seen on its own: the
    spacing taken twice over covers a counterpart one binade above."""
    return 2 * k * np.spacing(np.abs(c)).astype(np.float64) + k * eps * max(_finite_max(c), floor)


def _run(op, which, g, out, a, b, s, ws, extra=()):
    """An op's NumPy rule: ``which`` = "fwd" (returns a fresh output of shape ``out``), "da" or "db" (the
    contribution to input a or b, ``out`` the node's value)."""
    if which == "fwd":
        y = ws.take(out)
        op.fwd(a, b, s, y, ws, *extra)
        return y
    return getattr(op, which)(g, out, a, b, s, ws, *extra)


def _terms(op, which, g, out, a, b, s, ws):
    """K: how many products each element of a product rule's result sums (matmul/bmm from the shapes;
    otherwise the rule evaluated on ones counts them, padding excluded)."""
    if op.kind == "matmul":
        return {"fwd": a.shape[-1], "da": b.shape[-1], "db": a.shape[-2]}[which]
    one = lambda x: None if x is None else np.ones(np.shape(x), ws.dtype)   # noqa: E731
    return _run(op, which, one(g), out if which == "fwd" else one(out), one(a), one(b), s, ws)


def _product_bound(op, which, g, out, a, b, s, ws):
    """2·K·eps·(|A|·|B|) + 2·K·tiny (underflow): two any-order sums of K products each lie within
    γ_K·|A|·|B| of the exact one (Higham, Accuracy and Stability of Numerical Algorithms, §3.5)."""
    fi = np.finfo(ws.dtype)
    if op.name == "matmul":
        mag = _abs_product(*{"fwd": (a, b), "da": (g, b.T), "db": (a.T, g)}[which])
    else:
        ab = lambda x: None if x is None else np.abs(x)   # noqa: E731
        mag = _run(op, which, ab(g), out if which == "fwd" else ab(out), ab(a), ab(b), s, ws)
    k = _terms(op, which, g, out, a, b, s, ws)
    return 2.0 * k * (float(fi.eps) * mag.astype(np.float64) + float(fi.smallest_normal))


BLOCK = 1 << 14   # elements of |x| or |y| held at a time (128 KiB of doubles)


def _abs_product(x, y):
    """|x|·|y| of two matrices, taking |·| of the larger one a block at a time: a fine-tuned model's
    frozen weight (a lazy constant, held once) gets no full-size copy from its check."""
    out = np.empty((x.shape[0], y.shape[1]), np.result_type(x, y))
    if y.size >= x.size:
        ax, step = np.abs(x), max(1, BLOCK // max(1, y.shape[0]))
        for j in range(0, y.shape[1], step):
            np.matmul(ax, np.abs(y[:, j:j + step]), out=out[:, j:j + step])
    else:
        ay, step = np.abs(y), max(1, BLOCK // max(1, x.shape[1]))
        for i in range(0, x.shape[0], step):
            np.matmul(np.abs(x[i:i + step]), ay, out=out[i:i + step])
    return out


def _describe(op, kind):
    if kind == "exact":
        return f"== (tier {op.tier})"
    if kind == "libm":
        k, floor = op.ulps or (LIBM_ULPS, 0.0)
        return f"{k} ulp" + (f" or {k}·eps·max({floor:g}, max|result|)" if floor else "") + " (tier libm)"
    if kind == "product":
        return "2·K·eps·(|A|·|B|), true for any summation order (tier blas)"
    return f"{DEVICE_LAPACK_ULPS} ulp of max|result| (tier blas: the device's serial linear algebra)"


# ── reporting ────────────────────────────────────────────────────────────────

def _mismatch(got, want, tol):
    """None when ``got`` matches ``want`` (``==`` where ``tol`` is None, else |got − want| <= tol, NaNs
    in the same places), else (index, got, want, difference, bound) at the largest difference."""
    got, want = np.asarray(got), np.asarray(want)
    with np.errstate(all="ignore"):
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bad = ~same if tol is None else ~(same | (diff <= tol))
    if not bad.any():
        return None
    worst = np.where(bad, np.nan_to_num(diff, nan=np.inf), -1.0)
    idx = np.unravel_index(int(np.argmax(worst)), got.shape) if got.ndim else ()
    lim = 0.0 if tol is None else float(np.broadcast_to(tol, got.shape)[idx])
    return tuple(int(i) for i in idx), float(got[idx]), float(want[idx]), float(diff[idx]), lim


def _built_by(prog):
    if prog.backend == "native":
        from .native import build
        cc = build.find_compiler()
        version = (build.compiler_identity(cc, *build.cc_args()).splitlines()[1:2] or ["?"])[0]
        return f"compiled by {' '.join((cc,) + tuple(build.cc_args()))} ({version}) with {' '.join(build.flags())}"
    r = prog.runner
    return (f"compiled by NVRTC (CuPy {getattr(r.cupy, '__version__', '?')}) with "
            f"{' '.join(getattr(r.module, 'options', ()))}")


def _advice(prog):
    if prog.backend == "native":
        return ("the compiler may have miscompiled the generated C: try another compiler (CC=clang, or another "
                "GCC), portable vector code (TAPEGRAD_MARCH=x86-64-v2), capture(..., backend=\"numpy\") (the "
                "reference), or capture(..., verify=False) to run this program anyway")
    return ("the device code may be miscompiled: try capture(..., backend=\"native\") or backend=\"numpy\" (the "
            "reference), or capture(..., verify=False) to run this program anyway")


def _fail(prog, who, what, expected, m, note=""):
    idx, got, want, diff, lim = m
    raise VerificationError(
        f"{who}: {prog.backend} {what} differs from NumPy's: expected |{prog.backend} − NumPy| <= {lim:.3g} "
        f"({expected}), got {diff:.3g} at index {idx} ({prog.backend} {got!r}, NumPy {want!r}){note}; "
        f"{_built_by(prog)}; {_advice(prog)}")


def _who(prog, k):
    op = prog.nodes[k][0].name
    return at(f"param {prog.param_names[prog.params.index(k)]!r}", k) if op == "param" else at(op, k)


# ── values ───────────────────────────────────────────────────────────────────

def check_values(prog, buf, ws):
    """Every compute node's value against its NumPy forward from the backend's values of its inputs.

    Returns (the values the gradient check reads, the reference's kept buffers, the nodes NumPy's rule
    rejects, e.g. a matrix that is not positive definite: skipped, their consumers still checked)."""
    vals = {}
    kept, skipped = {}, set()
    for k in range(len(prog.nodes)):
        if not prog.nodes[k][0].arity:
            vals[k] = buf.value(k)
    for k in prog.compute:
        op, a, b, s = prog.nodes[k]
        va, vb = vals[a], None if b < 0 else vals[b]
        extra = (vals[prog.third[k]],) if op.arity == 3 else ()
        if op.keep is not None:
            kept[k] = tuple(ws.take(sh) for sh in op.keep(prog.shapes[a], s))
            extra = (kept[k],)
        got = buf.value(k)
        try:
            want = _run(op, "fwd", None, prog.shapes[k], va, vb, s, ws, extra)
        except Bad:
            skipped.add(k)
            vals[k] = got
            continue
        vals[k] = want if got is None else got
        if got is not None:
            _check_value(prog, k, got, want, _value_tol(prog, op, got, want, va, vb, s, ws))
    return vals, kept, skipped


def _value_tol(prog, op, got, want, a, b, s, ws):
    kind = _kind(op, prog.backend)
    if kind == "exact":
        return None
    if kind == "libm":
        return bound(op, got, want)
    if kind == "product":
        return _product_bound(op, "fwd", None, want.shape, a, b, s, ws)
    return bound(op, got, want, (DEVICE_LAPACK_ULPS, 0.0))


def _check_value(prog, k, got, want, tol):
    m = _mismatch(got, want, tol)
    if m is not None:
        op = prog.nodes[k][0]
        _fail(prog, _who(prog, k), "value", _describe(op, _kind(op, prog.backend)), m,
              f", computed by NumPy's {op.name} from the program's own inputs")


# ── gradients ────────────────────────────────────────────────────────────────

class _Sum:
    """One node's reference gradient, accumulated as NumPy does (first copy, then add), with the bound
    its contributions allow: None while every contribution is exact."""

    def __init__(self, ref=None):
        self.ref, self.err, self.mag, self.adds, self.parts = ref, None, None, 0, []
        self.unchecked = False

    def add(self, c, err, first, who):
        self.parts.append(who)
        if first or self.ref is None:
            self.ref = np.array(c, copy=True)
            self.mag = np.abs(c).astype(np.float64)
            self.err = err
            return
        np.add(self.ref, c, out=self.ref)
        self.mag += np.abs(c)
        self.adds += 1
        if err is not None:
            self.err = err if self.err is None else self.err + err

    def tol(self, eps):
        """Σ bounds + the additions' rounding: each of n − 1 additions on either side rounds by at most
        eps/2 of its partial sum, itself at most Σ|c| + Σ bounds."""
        if self.err is None:
            return None
        return self.err + self.adds * eps * (self.mag + self.err)


def check_grads(prog, buf, vals, kept, skipped, ws):
    """Every reached node's gradient against NumPy's rules fed with the backend's values and the
    backend's final gradients of its consumers, in backward order."""
    eps = float(np.finfo(prog.dtype).eps)
    sums = {prog.loss_id: _Sum(np.ones(prog.shapes[prog.loss_id], prog.dtype))}
    for k, to_a, first_a, to_b, first_b in prog.sched:
        g = _check_grad(prog, buf, k, sums.pop(k, None), eps)
        op, a, b, s = prog.nodes[k]
        extra = (vals[prog.third[k]],) if op.arity == 3 else (kept[k],) if op.keep is not None else ()
        args = (g, vals[k], vals[a], None if b < 0 else vals[b], s, ws)
        for to, first, j, which in ((to_a, first_a, a, "da"), (to_b, first_b, b, "db")):
            if not to:
                continue
            acc = sums.setdefault(j, _Sum())
            c = _run(op, which, *args, extra)
            c, err = _fit(c, prog.shapes[j], _part_bound(prog, op, which, c, args, eps), ws, eps)
            acc.add(c, err, first, f"{op.name} (node {k})")
            acc.unchecked |= k in skipped
    for j in sorted(sums, reverse=True):   # leaves: parameters
        _check_grad(prog, buf, j, sums[j], eps)


def _part_bound(prog, op, which, c, args, eps):
    kind = _kind(op, prog.backend)
    if kind == "exact":
        return None
    if kind == "libm":
        k, floor = op.ulps or (LIBM_ULPS, 0.0)
        return _ulps_part(k, floor, c, eps)
    if kind == "product":
        return _product_bound(op, which, *args)
    return _ulps_part(DEVICE_LAPACK_ULPS, 0.0, c, eps)


def _fit(c, shape, err, ws, eps):
    """A broadcast input's contribution summed down to its shape (``unbroadcast``), with its bound:
    the summed bounds plus r − 1 roundings of the partial sums over r stretched elements."""
    if c.shape == shape:
        return c, err
    down = unbroadcast(c, shape, ws)
    if err is None:
        return down, None
    r = c.size // max(1, math.prod(shape))
    e = unbroadcast(err, shape, ws, out=np.empty(shape))
    mag = unbroadcast(np.abs(c) + err, shape, ws, out=np.empty(shape))
    return down, e + (r - 1) * eps * mag


def _check_grad(prog, buf, j, acc, eps):
    """Compare node j's backend gradient with ``acc``; returns the gradient its consumers' rules read."""
    got = buf.grad(j)
    if acc is None or acc.ref is None:
        return got
    if got is None:
        return acc.ref
    if not acc.unchecked:
        m = _mismatch(got, acc.ref, acc.tol(eps))
        if m is not None:
            exact = acc.err is None
            expected = ("==: every contribution is exact-tier" if exact else
                        f"the sum of its contributions' tier bounds and {acc.adds} addition(s)' rounding")
            parts = ", ".join(acc.parts) if acc.parts else "the seed"
            _fail(prog, _who(prog, j), "gradient", expected, m,
                  f", rebuilt by NumPy's rules from the program's own values and the gradients of {parts}")
    return got


# ── what a fused loop kept in a local ────────────────────────────────────────

def rebuilt(prog, kind, k):
    """Node ``k``'s value (``kind`` "v") or gradient ("g") that the native program held only in a fused
    loop's local (``tapegrad.native.fuse.registers``), rebuilt by NumPy's rules from what it stored. Those
    locals are exact-tier, whose NumPy rules give the native loop's bits (checked at ``==`` on every
    stored value), so this is the value the loop computed."""
    regs, ws, memo = prog.runner.registers, _Fresh(prog.dtype), {}

    def value(j):
        if ("v", j) not in regs:
            return prog.val[j]
        if ("v", j) not in memo:
            op, a, b, s = prog.nodes[j]
            extra = (value(prog.third[j]),) if op.arity == 3 else ()
            memo["v", j] = _run(op, "fwd", None, prog.shapes[j], value(a), None if b < 0 else value(b), s, ws,
                                extra)
        return memo["v", j]

    def grad(j):
        if ("g", j) not in regs:
            return prog.grad_buf(j)
        if ("g", j) not in memo:
            acc = _Sum()
            for m, to_a, first_a, to_b, first_b in prog.sched:   # the contributions, in backward order
                op, a, b, s = prog.nodes[m]
                for to, first, t, which in ((to_a, first_a, a, "da"), (to_b, first_b, b, "db")):
                    if to and t == j:
                        extra = (value(prog.third[m]),) if op.arity == 3 else ()
                        c = _run(op, which, grad(m), value(m), value(a), None if b < 0 else value(b), s, ws, extra)
                        acc.add(c, None, first, op.name)
            memo["g", j] = acc.ref
        return memo["g", j]
    return value(k) if kind == "v" else grad(k)


# ── the first run ────────────────────────────────────────────────────────────

def check_run(prog):
    """Run the program's backend forward and backward once and check every value and gradient against
    the NumPy reference (raises ``VerificationError`` naming the first node that differs)."""
    prog.runner.forward()
    prog.runner.backward()
    buf = _buffers(prog)
    buf.sync()
    ws = _Fresh(prog.dtype)
    with np.errstate(all="ignore"):
        vals, kept, skipped = check_values(prog, buf, ws)
        check_grads(prog, buf, vals, kept, skipped, ws)


# ── the optimizer's first step ───────────────────────────────────────────────

class _State:
    """The attached optimizer's parameters, moments and count before a step (host copies).

    Read from the host buffers: a native program's are its own; a CuPy program's device copies were
    made from them by ``attach`` (which rebuilds the runner) and are only changed by a step, so before
    the first step after an attach the host holds what the device will update."""

    def __init__(self, prog):
        o = prog.opt
        if prog.backend == "native":
            prog.runner.pull_count()   # a C caller may have written the count
        self.count = o.count
        self.params = {i: np.array(prog.val[i]) for i in o.ids}
        self.mu = [np.array(m) for m in o.mu]
        self.nu = [np.array(v) for v in o.nu]

    def restore(self, prog):
        o = prog.opt
        for i, w in self.params.items():
            prog._put(i, w)
        for have, m in zip(o.mu + o.nu, self.mu + self.nu):
            np.copyto(have, m)
        o.count = self.count
        prog.runner.push_count()
        _buffers(prog).flush()


def checked_step(prog, run):
    """``run()`` (the backend's step, or its episode) checked against NumPy's update of the state before
    it, fed with the backend's gradients (and clip norm, checked first); on a difference the state is
    restored and ``VerificationError`` raised."""
    before = _State(prog)
    run()
    try:
        with np.errstate(all="ignore"):
            _check_step(prog, before)
    except VerificationError:
        before.restore(prog)
        raise


def _check_step(prog, before):
    o = prog.opt
    buf = _buffers(prog)
    buf.sync()
    grads = {i: np.array(buf.grad(i)) for i, t in zip(o.ids, o.touched) if t}
    norm = _checked_norm(prog, buf, before, grads) if o.clip is not None and grads else None
    want = _reference_step(prog, before, grads, norm)
    note = "; the parameters, moments and count were restored to their values before the step"
    if o.count != want.opt.count:
        raise VerificationError(f"{o.kind} step: the {prog.backend} program's step count is {o.count} after the "
                                f"step, expected {want.opt.count}{note}; {_built_by(prog)}; {_advice(prog)}")
    for j, i in enumerate(o.ids):
        name = prog.param_names[prog.params.index(i)]
        for what, got, ref in (("value", buf.value(i), want.val[i]),) + tuple(
                (f"{kind.lower()}u", buf.moment(kind, j), getattr(want.opt, kind.lower() + "u")[j])
                for kind in ("M", "N")[:o.moments]):
            m = _mismatch(got, ref, None)
            if m is not None:
                _fail(prog, at(f"{o.kind} step of param {name!r}", i), f"{what} after the first update",
                      "==: the update is IEEE-exact", m, f", NumPy's update from the same state and gradients"
                      f"{note}")


def _checked_norm(prog, buf, before, grads):
    """The backend's global clip norm, checked against NumPy's (tapegrad.optim's l2_grad and sq_norm in
    registration order) within the bound of a sum of N squares in any order, N·eps relative."""
    from .optim import l2_grad, sq_norm
    o = prog.opt
    total, n = 0.0, 0
    for j, i in enumerate(o.ids):
        if i in grads:
            g = grads[i]
            if o.l2[j]:
                g = l2_grad(g, before.params[i], o.l2[j], np.empty_like(g))
            total += sq_norm(g)
            n += g.size
    want, got = math.sqrt(total), buf.clip_norm()
    fi = np.finfo(prog.dtype)
    lim = 2.0 * n * float(fi.eps) * want + float(fi.smallest_normal)
    if not (abs(got - want) <= lim or got == want or (math.isnan(got) and math.isnan(want))):   # inf, NaN
        raise VerificationError(
            f"{o.kind} step: the {prog.backend} program's global gradient norm for clipping differs from "
            f"NumPy's: expected |{prog.backend} − NumPy| <= {lim:.3g} (a sum of {n} squares in any order), got "
            f"{abs(got - want):.3g} ({prog.backend} {got!r}, NumPy {want!r}); the parameters, moments and count "
            f"were restored to their values before the step; {_built_by(prog)}; {_advice(prog)}")
    return got


def _reference_step(prog, before, grads, norm):
    """NumPy's step (``NumpyRunner.step``) on copies laid out like the program's slabs."""
    from .replay import NumpyRunner
    o = copy.copy(prog.opt)
    o.count = before.count
    pslab, gslab = np.zeros_like(prog.pslab), np.zeros_like(prog.gslab)
    val, grd = {}, {}
    for k, (off, n) in zip(prog.params, prog.pspans):
        val[k] = pslab[off:off + n].reshape(prog.shapes[k])
        grd[k] = gslab[off:off + n].reshape(prog.shapes[k])
        if k in before.params:
            np.copyto(val[k], before.params[k])
        if k in grads:
            np.copyto(grd[k], grads[k])
    if o.moments:
        whole = o.mslab is not None
        o.mslab, o.mu = _moments(prog, whole, before.mu)
    if o.moments > 1:
        o.nslab, o.nu = _moments(prog, whole, before.nu)
    shadow = types.SimpleNamespace(opt=o, val=val, grads=grd, shapes=prog.shapes, dtype=prog.dtype, pslab=pslab,
                                   gslab=gslab, pspans=prog.pspans, loss_id=prog.loss_id, compute=[],
                                   nodes=prog.nodes)
    NumpyRunner(shadow).step(norm)
    return shadow


def _moments(prog, whole, arrays):
    """(slab, views) of moment copies: a slab like the parameters' when the optimizer holds one."""
    if not whole:
        return None, [a.copy() for a in arrays]
    slab = np.zeros_like(prog.pslab)
    views = [slab[off:off + n].reshape(a.shape) for (off, n), a in zip(prog.pspans, arrays)]
    for v, a in zip(views, arrays):
        np.copyto(v, a)
    return slab, views
