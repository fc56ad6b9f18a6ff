"""A data-parallel training run, as tests/test_data_parallel.py starts it in fresh processes.

``python data_parallel_worker.py shard``: one process, two host devices. ``python data_parallel_worker.py
dist PORT ID``: process ID of two, joined by jax.distributed on 127.0.0.1:PORT, one device each. Either way
``interop.train_step(..., axis_name="data")`` under ``jax.shard_map`` runs five steps beside the same step
written with ``jax.value_and_grad`` and ``lax.pmean``, with check_vma on and off, and prints
``ok <check_vma> <max relative difference>`` for each.
"""
import os
import sys


def loss(p, x, y):
    import jax
    import optax
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()


def main(mode, port=None, pid=None):
    if mode == "shard":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    if mode == "dist":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import interop

    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((6, 8))), "b1": jnp.zeros(8),
              "w2": jnp.asarray(rng.standard_normal((8, 4)))}
    X, Y = rng.standard_normal((16, 6)), rng.integers(0, 4, 16)
    X[:3] = 0.0                          # blank rows: relu's kink with a zero bias
    mesh = jax.make_mesh((2,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    if mode == "dist":                   # each process holds its half of the batch
        half = slice(8 * jax.process_index(), 8 * jax.process_index() + 8)
        xs = jax.make_array_from_process_local_data(sharding, X[half])
        ys = jax.make_array_from_process_local_data(sharding, Y[half])
    else:
        xs, ys = jax.device_put(jnp.asarray(X), sharding), jax.device_put(jnp.asarray(Y), sharding)
    opt = optax.adam(1e-2)
    step, state0 = interop.train_step(loss, params, jnp.asarray(X[:8]), jnp.asarray(Y[:8]), optimizer=opt,
                                      axis_name="data")
    assert not step.native_update and "data parallel" in step.why

    def reference(state, x, y):
        p, s = state
        value, g = jax.value_and_grad(loss)(p, x, y)
        value, g = jax.lax.pmean((value, g), "data")
        u, s = opt.update(g, s, p)
        return value, (optax.apply_updates(p, u), s)

    for check in (True, False):
        run = [jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()),
                                     check_vma=check)) for f in (lambda s, x, y: step(s, x, y), reference)]
        ours = jax.tree.map(jnp.array, state0)
        theirs = (params, opt.init(params))
        worst = 0.0
        for _ in range(5):
            a, ours = run[0](ours, xs, ys)
            b, theirs = run[1](theirs, xs, ys)
            worst = max(worst, abs(float(a) - float(b)) / abs(float(b)))
        for u, v in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            u, v = np.asarray(jax.device_get(u)), np.asarray(jax.device_get(v))
            worst = max(worst, float(np.max(np.abs(u - v))) / max(1.0, float(np.max(np.abs(v)))))
        print("ok", check, worst, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
