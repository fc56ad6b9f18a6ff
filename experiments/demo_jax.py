"""Demo section: the same digits MLP trained inside ``jax.jit`` — as one tapegrad custom call per step
(``interop.program_episode``) and, side by side, written in plain JAX with optax — plus the gradient
oracle (``interop.check_grads``) on the plain-JAX loss.

Called by ``experiments/demo.py`` with its ``ctx`` (batches, initial parameters, model, optimizer
factory, eager losses and timing).
"""
import time

import numpy as np

from mlp import jax_loss


def _episode(ctx, interop):
    import jax
    import jax.numpy as jnp
    native = interop.xla.program.native_library() is not None
    prog = ctx.capture("native" if native else "numpy")[0]
    xb, yb = ctx.batches[0]
    shapes = [prog.shapes[k] for k in prog.consts]
    if shapes != [xb.shape, yb.shape]:
        raise RuntimeError(f"demo_jax: expected the model's constants to be (xb, yb), got shapes {shapes}")
    step = jax.jit(interop.program_episode(prog, flat=True), donate_argnums=0)
    state = interop.episode_state(prog, flat=True)
    losses, t = [], []
    for xb, yb in ctx.batches:
        x, y = jnp.asarray(xb), jnp.asarray(yb)
        t0 = time.perf_counter()
        loss, state = step(state, (x, y))
        loss.block_until_ready()
        t.append(time.perf_counter() - t0)
        losses.append(float(loss))
    named = interop.unflatten_state(prog, state)[0]
    params = [np.asarray(named[n]) for n in prog.param_names]
    return ("native FFI" if step.native else "callback"), losses, np.median(t[1:]) * 1e6, params


def _plain(ctx, interop):
    import jax
    import jax.numpy as jnp
    import optax
    o = ctx.make_opt()
    tx = optax.adam(o.lr, b1=o.b1, b2=o.b2, eps=o.eps)

    @jax.jit
    def step(params, opt_state, xb, yb):
        loss, g = jax.value_and_grad(lambda p: jax_loss(p, xb, yb))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    params = [jnp.asarray(p) for p in ctx.init]
    opt_state = tx.init(params)
    losses, t = [], []
    for xb, yb in ctx.batches:
        x, y = jnp.asarray(xb), jnp.asarray(yb)
        t0 = time.perf_counter()
        loss, params, opt_state = step(params, opt_state, x, y)
        loss.block_until_ready()
        t.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, np.median(t[1:]) * 1e6, [np.asarray(p) for p in params]


def section(ctx):
    try:
        import interop
    except ImportError as e:
        print(f"jax interop: skipped ({e})")
        return
    import jax
    import jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)   # the demo's programs compute in float64
    eager = np.array(ctx.eager_losses)
    print("inside jax.jit:")
    how, ep_losses, ep_us, ep_params = _episode(ctx, interop)
    d = np.abs(np.array(ep_losses) - eager) / np.abs(eager)
    print(f"  program_episode ({how}, one custom call per step): test accuracy {ctx.accuracy(ep_params):.1%}   "
          f"{ep_us:.0f} µs per step   losses vs eager: max rel diff {d.max():.2g}"
          f"{'  (bit-identical)' if d.max() == 0 else ''}")
    pj_losses, pj_us, pj_params = _plain(ctx, interop)
    d = np.abs(np.array(pj_losses) - eager) / np.abs(eager)
    print(f"  plain JAX + optax (jit value_and_grad + adam):      test accuracy {ctx.accuracy(pj_params):.1%}   "
          f"{pj_us:.0f} µs per step   losses vs eager: max rel diff {d.max():.2g} (XLA sums and fuses differently)")
    print(f"  program_episode is {pj_us / ep_us:.1f}× the speed of the plain-JAX step "
          f"(eager tape: {ctx.eager_us:.0f} µs per step)")
    xb, yb = ctx.batches[0]
    r = interop.check_grads(lambda p: jax_loss(p, jnp.asarray(xb), jnp.asarray(yb)),
                            [jnp.asarray(p) for p in ctx.init])
    print(f"  gradient oracle: check_grads(plain-JAX loss) replayed {r.n_eqns} jaxpr equations on a tape: "
          f"{'agrees' if r.ok else 'DISAGREES'} with jax.grad, max rel grad diff {max(r.max_rel):.2g} "
          f"(bound {r.rtol:g})")
