"""The README's example runs and its op table is the registry's."""
import pathlib
import re

import numpy as np

import tapegrad.ops as O

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_op_table_is_generated_from_the_registry():
    table = re.search(r"<!-- ops:begin -->\n(.*?)\n<!-- ops:end -->", README, re.S).group(1)
    assert table == O.markdown_table(), "run: python experiments/readme_ops.py"


def blocks():
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_capture_and_jax_examples_run():
    scope = {}
    exec(compile(blocks()[1], "README.md", "exec"), scope)
    tape, program, W = scope["tape"], scope["program"], scope["W"]
    assert np.array_equal(tape.value(W), program.value(W))
    assert float(program.loss()) < 0.6
    exec(compile(blocks()[2], "README.md", "exec"), scope)
    assert scope["report"].ok and scope["g"].shape == (8, 3)
    assert float(scope["loss_value"]) > 0
    params, opt_state = scope["params"], scope["opt_state"]
    assert list(params) == ["W", "b"] and int(opt_state.count) == 101 and set(opt_state.mu) == {"W", "b"}


def test_the_mlp_example_trains():
    code = re.search(r"## An MLP trained on the tape\n\n```python\n(.*?)```", README, re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    tape, tg = scope["tape"], scope["tg"]
    X, y, W1, b1, W2, b2 = (scope[k] for k in ("X", "y", "W1", "b1", "W2", "b2"))
    logits = (tape.const(X) @ W1 + b1).relu() @ W2 + b2
    accuracy = (np.argmax(tape.value(logits), axis=1) == y).mean()
    assert accuracy > 0.8
    assert float(tape.value(tg.softmax_cross_entropy(logits, np.eye(3)[y]))) < 0.5


def test_the_models_example_runs():
    code = re.search(r"## Models on the tape\n.*?```python\n(.*?)```", README, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    tape, program, loss = scope["tape"], scope["program"], scope["loss"]
    assert abs(float(tape.value(loss)) - np.log(4)) < 1e-12      # W = 0: uniform predictions
    assert program.forward() == tape.value(loss)                  # W = 0: log 4 whatever the new ids


def test_the_jax_model_example_trains_natively_then_continues_with_optax():
    pytest = __import__("pytest")
    pytest.importorskip("flax")
    code = re.search(r"## Your JAX model, not rewritten\n.*?```python\n(.*?)```", README, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["step"].native_update
    first = float(scope["loss"](scope["model"].init(scope["jax"].random.key(0), scope["x"])["params"],
                                scope["x"], scope["labels"]))
    assert float(scope["loss"](scope["params"], scope["x"], scope["labels"])) < first
    assert int(scope["opt_state"][0].count) == 11    # ten native steps and one of optax's
