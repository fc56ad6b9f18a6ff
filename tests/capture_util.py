"""Shared builders for the capture/native/fuse tests: an MLP episode, its eager run, a graph with every op."""
import numpy as np

import tapegrad as tg
from tapegrad import ops as O


def mlp_init(sizes, seed=0):
    rng = np.random.default_rng(seed)
    init = []
    for i, o in zip(sizes[:-1], sizes[1:]):
        init += [rng.standard_normal((i, o)) * (1.0 / np.sqrt(i)), rng.standard_normal(o) * 0.1]
    return init


def batches(sizes, rows, n, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((rows, sizes[0])), np.eye(sizes[-1])[rng.integers(0, sizes[-1], rows)])
            for _ in range(n)]


def mlp(tape, params, xb, yb, act="relu", loss="xent"):
    """One episode; returns (x const, y const, loss)."""
    x, y = tape.const(xb), tape.const(yb)
    h = x
    for k in range(0, len(params), 2):
        h = h @ params[k] + params[k + 1]
        if k + 2 < len(params):
            h = getattr(h, act)()
    if loss == "xent":
        out = tg.softmax_cross_entropy(h, y)
    elif loss == "logsoftmax":
        out = -(y * h.log_softmax()).sum(axis=1).mean()
    else:
        out = tg.mse(h, y)
    return x, y, out


def make_opt(kind):
    return {
        "sgd": lambda: tg.SGD(0.05),
        "sgd_clip_seed": lambda: tg.SGD(0.1, clip=0.5, clip_mode="seed"),
        "adam": lambda: tg.Adam(1e-2),
        "adam_clip_optax": lambda: tg.Adam(1e-2, clip=0.8),
        "adam_hat_clip_torch": lambda: tg.Adam(1e-2, eps_mode="hat", clip=0.3, clip_mode="torch"),
    }[kind]()


def register(opt, tape, params, l2=0.01):
    for k, p in enumerate(params):
        opt.add(tape, p, l2=l2 if k % 2 == 0 else 0.0)


def eager(sizes, data, opt_kind, act="relu", loss="xent", init=None):
    """Losses and final parameters of the eager tape with mark/reset."""
    tape = tg.Tape()
    params = [tape.param(a) for a in (init or mlp_init(sizes))]
    opt = make_opt(opt_kind)
    register(opt, tape, params)
    m = tape.mark()
    losses = []
    for xb, yb in data:
        _, _, out = mlp(tape, params, xb, yb, act, loss)
        losses.append(float(tape.value(out)))
        tape.backward(out)
        opt.step()
        tape.reset_to(m)
    return losses, [tape.value(p).copy() for p in params], opt


def captured(sizes, data, opt_kind, backend="numpy", act="relu", loss="xent", fuse=True, dtype="float64",
             init=None):
    """(program, tape, params, x, y, optimizer) for the first batch's episode, optimizer attached."""
    tape = tg.Tape()
    params = [tape.param(a) for a in (init or mlp_init(sizes))]
    opt = make_opt(opt_kind)
    register(opt, tape, params)
    tape.mark()
    x, y, out = mlp(tape, params, *data[0], act, loss)
    prog = tg.capture(tape, out, backend=backend, fuse=fuse, dtype=dtype)
    prog.attach(opt)
    return prog, tape, params, x, y, opt


def every_op_graph(seed=0):
    """A tape whose loss reaches every registry op (with broadcasting, shared inputs and layout ops)."""
    rng = np.random.default_rng(seed)
    tape = tg.Tape()
    P = lambda *s: tape.param(rng.standard_normal(s))                                     # noqa: E731
    Q = lambda *s: tape.param(rng.uniform(0.5, 2.0, s))                                    # noqa: E731
    a, b, w, bias = P(4, 6), P(6,), P(6, 5), P(5,)
    pos = Q(4, 6)
    t = tape.apply(O.add, a, b)
    t = tape.apply(O.sub, t, tape.apply(O.mul, a, b))
    t = tape.apply(O.div, t, pos)
    t = tape.apply(O.maximum, t, tape.apply(O.neg, a))
    t = tape.apply(O.muls, tape.apply(O.adds, t, None, 0.25), None, -1.5)
    t = tape.apply(O.add, t, tape.apply(O.rdivs, pos, None, 2.0))
    t = tape.apply(O.add, tape.apply(O.square, t), tape.apply(O.pow, pos, None, 1.5))
    t = tape.apply(O.relu, tape.apply(O.sub, t, tape.apply(O.abs, a)))
    t = tape.apply(O.add, tape.apply(O.sigmoid, t), tape.apply(O.tanh, a))
    t = tape.apply(O.add, t, tape.apply(O.log, tape.apply(O.exp, tape.apply(O.sqrt, pos))))
    h = tape.apply(O.add, tape.apply(O.matmul, t, w), bias)                               # (4, 5)
    s1 = tape.apply(O.sum, h, None, ((1,), True))
    s2 = tape.apply(O.mean, h, None, ((0,), False))
    s3 = tape.apply(O.max, h, None, ((1,), False))
    ht = tape.apply(O.transpose, h, None, (1, 0))                                          # (5, 4)
    r = tape.apply(O.reshape, ht, None, (2, 2, 5))
    bm = tape.apply(O.bmm, r, P(2, 5, 3))
    sm = tape.apply(O.softmax, h, None, 1)
    ls = tape.apply(O.logsoftmax, h, None, 0)
    bt = tape.apply(O.broadcast_to, s2, None, (4, 5))
    sl = tape.apply(O.slice, h, None, ((1, 3), (0, 5)))
    cc = tape.apply(O.concat, sl, tape.apply(O.slice, sm, None, ((0, 1), (0, 5))), 0)      # (3, 5)
    tgt = tape.const(np.abs(rng.standard_normal((4, 5))))
    xe = tape.apply(O.softmax_xent, h, tgt, 1)
    loss = tape.apply(O.sum, tape.apply(O.mul, ls, sm), None, (None, False))
    for extra in (s1, s3, bm, bt, cc):
        loss = tape.apply(O.add, loss, tape.apply(O.mean, tape.apply(O.square, extra), None, (None, False)))
    loss = tape.apply(O.add, loss, xe)
    return tape, [a, b, w, bias, pos], loss
