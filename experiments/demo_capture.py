"""Demo section: capture the eager run's training episode and replay it with the NumPy and native programs.

Called by ``experiments/demo.py`` after the eager run, with the same initial parameters and batches.
"""
import time

import numpy as np

import tapegrad as tg

# Native vs the tape: the demo's model uses softmax cross-entropy (exp/log: the registry's "libm" tier),
# so the native losses are not bit-identical; over the whole run they stay within this relative bound.
NATIVE_RTOL = 1e-9


def train(ctx, backend, fuse=True):
    prog, params, x, y = ctx.capture(backend, fuse)
    losses = []
    t0 = time.perf_counter()
    for xb, yb in ctx.batches:
        losses.append(prog.episode({x: xb, y: yb}))
    us = (time.perf_counter() - t0) / len(ctx.batches) * 1e6
    return prog, losses, us, [np.array(prog.value(p)) for p in params]


def section(ctx):
    print("captured programs (same init, same batches):")
    prog, losses, us, params = train(ctx, "numpy")
    same = losses == list(ctx.eager_losses)
    print(f"  numpy replay : losses {'==' if same else '!='} eager, bit for bit ({len(losses)} steps)   "
          f"{us:8.0f} µs/episode ({ctx.eager_us / us:.1f}x eager)   test accuracy {ctx.accuracy(params):.1%}")
    try:
        prog, nlosses, nus, nparams = train(ctx, "native", fuse=True)
    except tg.BuildError as e:
        print(f"  native       : skipped ({e})")
        return
    want = np.asarray(ctx.eager_losses)
    rel = float(np.max(np.abs(np.asarray(nlosses) - want) / np.abs(want)))
    ok = rel <= NATIVE_RTOL
    plan = prog.plan()
    print(f"  native fused : losses within {NATIVE_RTOL:g} relative of eager: {'yes' if ok else 'NO'} "
          f"(max {rel:.1e})   {nus:8.0f} µs/episode ({ctx.eager_us / nus:.1f}x eager)   "
          f"test accuracy {ctx.accuracy(nparams):.1%}")
    print(f"                 plan: {plan['kernels_forward_unfused']}→{plan['kernels_forward']} forward and "
          f"{plan['kernels_backward_unfused']}→{plan['kernels_backward']} backward kernels, one C call per episode")
