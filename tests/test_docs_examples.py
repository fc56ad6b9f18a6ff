"""The docs pages' examples compute what their pages say (tests/test_docs.py runs every other block as it is;
the oracle's, ordered mode's, the CNN's and the Gaussian process's are checked beside their topics)."""
import numpy as np
import pytest

from docs_pages import block, text


def run(name, heading=None, index=0):
    scope = {}
    exec(compile(block(name, heading, index), f"docs/{name}", "exec"), scope)
    return scope


def test_the_first_model_trains():
    assert "## An MLP trained on the tape" in text("getting-started.md")
    code = block("getting-started.md", "## An MLP trained on the tape")
    assert len(code.strip().splitlines()) <= 20
    scope = run("getting-started.md", "## An MLP trained on the tape")
    tape, tg = scope["tape"], scope["tg"]
    X, y, W1, b1, W2, b2 = (scope[k] for k in ("X", "y", "W1", "b1", "W2", "b2"))
    logits = (tape.const(X) @ W1 + b1).relu() @ W2 + b2
    assert (np.argmax(tape.value(logits), axis=1) == y).mean() > 0.8
    assert float(tape.value(tg.softmax_cross_entropy(logits, np.eye(3)[y]))) < 0.5


def test_the_capture_example_replays_natively():
    scope = run("capture.md")
    tape, program, W = scope["tape"], scope["program"], scope["W"]
    assert program.backend == "native"
    assert np.array_equal(tape.value(W), program.value(W))
    assert float(program.loss()) < 0.6


def test_the_embedding_bag_example_captures_its_data_slots():
    scope = run("tape.md", "## Models on the tape")
    tape, program, loss = scope["tape"], scope["program"], scope["loss"]
    assert abs(float(tape.value(loss)) - np.log(4)) < 1e-12      # W = 0: uniform predictions
    assert program.forward() == tape.value(loss)                  # W = 0: log 4 whatever the new ids


def test_the_jit_example_differentiates_steps_and_checks():
    pytest.importorskip("jax")
    scope = run("jit.md")
    assert scope["report"].ok and scope["g"].shape == (8, 3)
    assert float(scope["loss_value"]) > 0
    params, opt_state = scope["params"], scope["opt_state"]
    assert list(params) == ["W", "b"] and int(opt_state.count) == 1 and set(opt_state.mu) == {"W", "b"}


def test_the_jax_model_trains_natively_then_continues_with_optax():
    jax = pytest.importorskip("jax")
    pytest.importorskip("flax")
    with jax.enable_x64(False):       # as a script runs it (another test may have turned 64-bit mode on)
        scope = run("jax-model.md", "## A training step", 0)
    assert scope["step"].native_update
    first = float(scope["loss"](scope["model"].init(scope["jax"].random.key(0), scope["x"])["params"],
                                scope["x"], scope["labels"]))
    assert float(scope["loss"](scope["params"], scope["x"], scope["labels"])) < first
    assert int(scope["opt_state"][0].count) == 11    # ten native steps and one of optax's


def test_the_apply_model_example_matches_jax():
    pytest.importorskip("flax")
    scope = run("jax-model.md", "## Where `jax.value_and_grad` was")
    jax, model, params = scope["jax"], scope["model"], scope["params"]
    images, labels = scope["images"][:20], scope["labels"][:20]

    def loss_fn(p):
        logits = model.apply({"params": p}, images)
        return scope["optax"].softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    assert abs(float(scope["loss"] - loss)) <= 1e-5 * abs(float(loss))
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(scope["grads"]), jax.tree.leaves(grads)))
    assert worst <= 1e-5 * max(float(np.max(np.abs(b))) for b in jax.tree.leaves(grads))


def test_the_batchnorm_step_trains_its_statistics():
    jax = pytest.importorskip("jax")
    pytest.importorskip("flax")
    with jax.enable_x64(False):
        scope = run("jax-model.md", "## A training step", 1)
    assert scope["step"].native_update
    first = scope["variables"]["batch_stats"]["BatchNorm_0"]["mean"]
    assert float(np.max(np.abs(scope["stats"]["BatchNorm_0"]["mean"] - first))) > 0
    assert int(scope["state"][1][0].count) == 5 and np.isfinite(float(scope["value"]))


def test_the_equinox_example_matches_jax():
    pytest.importorskip("equinox")
    scope = run("jax-model.md", "## A training step", 2)
    jax = scope["jax"]
    value, grads = jax.value_and_grad(scope["loss"])(scope["arrays"], scope["x"], scope["y"])
    assert abs(float(scope["value"] - value)) <= 1e-5 * abs(float(value))
    for a, b in zip(jax.tree.leaves(scope["grads"]), jax.tree.leaves(grads)):
        assert float(np.max(np.abs(a - b))) <= 1e-5 * max(1.0, float(np.max(np.abs(b))))


