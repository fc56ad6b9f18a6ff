"""Generated code under every C compiler and target present: the forms GCC 11 and 12 miscompiled.

GCC 11 and 12 at -O3 with AVX2 targets turn a load read only in the taken branch of a select into a
masked vector load and, when a byte mask widens to doubles over an outer loop, use the first mask for
every vector (a ``where`` gradient with a broadcast mask: 48 to 224 of 512 elements wrong). The emitter
and the runtime now read both sides of every select first (``Emitter.loads``). These tests compile the
reduced kernel in the form we emit, and whole programs of every selecting op, with each compiler found
on PATH (gcc, gcc-11.., clang, clang-14..) at each target, and check them against the tape with ``==``.
"""
import os
import shutil
import subprocess

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import build

pytestmark = pytest.mark.compilers   # make test-compilers (CI's compiler stage)

NAMES = ["cc", "gcc"] + [f"gcc-{v}" for v in range(10, 16)] + ["clang"] + [f"clang-{v}" for v in range(13, 22)]
TARGETS = ("native", "x86-64-v3", "x86-64-v2")


def compilers():
    found, seen = [], set()
    for name in NAMES:
        path = shutil.which(name)
        if path and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            found.append(path)
    return found


def targets(cc):
    """The targets this compiler builds for and this CPU runs (a probe program compiled and run)."""
    return [t for t in TARGETS if _runs(cc, t)]


def _runs(cc, march, cache={}):
    key = (cc, march)
    if key not in cache:
        cache[key] = _compile_and_run(cc, ["-O3", f"-march={march}"], "int main(void) { return 0; }") is not None
    return cache[key]


def _compile_and_run(cc, flags, source, tmp=None):
    import tempfile
    d = tmp or tempfile.mkdtemp()
    src, exe = os.path.join(d, "k.c"), os.path.join(d, "k")
    with open(src, "w") as f:
        f.write(source)
    r = subprocess.run([cc, *flags, "-ffp-contract=off", "-o", exe, src], capture_output=True, text=True)
    if r.returncode:
        return None
    r = subprocess.run([exe], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


# The reduced kernel (the transformer's attention mask gradient) as the emitter prints it now: the
# operand read in a branch is loaded before the select.
REDUCED = r"""
#include <stdio.h>
static void kernel(const unsigned char *restrict v45, double *restrict g44, double *restrict g47)
{
    for (long i0 = 0; i0 < 8L; i0++)
        for (long i1 = 0; i1 < 8L; i1++)
            for (long i2 = 0; i2 < 8L; i2++) {
                const long i = i0 * 64L + i1 * 8L + i2;
                const double g_0 = g47[i];
                g44[i] = (v45[i1 * 8 + i2] ? g_0 : 0.0);
            }
}
int main(void)
{
    unsigned char m[64];
    double g[512], o[512];
    int bad = 0;
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 8; c++)
            m[r * 8 + c] = c <= r;
    for (int i = 0; i < 512; i++) {
        g[i] = i + 1;
        o[i] = -7.0;
    }
    kernel(m, o, g);
    for (int i = 0; i < 512; i++)
        bad += o[i] != (m[i % 64] ? g[i] : 0.0);
    printf("%d\n", bad);
    return 0;
}
"""

EPS = np.finfo(np.float64).eps
CASES = [(cc, t) for cc in compilers() for t in targets(cc)]


@pytest.mark.parametrize("cc,march", CASES, ids=[f"{os.path.basename(c)}-{t}" for c, t in CASES])
def test_reduced_where_kernel_is_right(cc, march, tmp_path):
    out = _compile_and_run(cc, ["-O3", f"-march={march}"], REDUCED, str(tmp_path))
    assert out is not None and int(out) == 0, (cc, march, out)


def selecting_graph(seed=0):
    """Every op that selects: where with masks broadcast over leading axes (both branches and both
    gradients), a causal-masked softmax with -inf, maximum/minimum with ties, relu at 0, abs, max-pool."""
    rng = np.random.default_rng(seed)
    tape = tg.Tape()
    a, b = tape.param(rng.standard_normal((4, 8, 8))), tape.param(rng.standard_normal((4, 8, 8)))
    s = tape.param(rng.standard_normal((4, 8, 8)))   # the softmax's own: its exp is the runtime's (tier libm)
    causal = tape.const(np.tril(np.ones((8, 8), bool)))
    row = tape.const(rng.random((1, 8)) > 0.5)
    terms = [tg.where(causal, a, b), tg.where(row, b, a * 2.0),
             tg.where(causal, s, -np.inf).softmax(axis=-1)]
    tied = np.round(rng.standard_normal((4, 8, 8)))
    c = tape.param(tied)
    d = tape.param(np.where(rng.random((4, 8, 8)) > 0.5, tied, np.round(rng.standard_normal((4, 8, 8)))))
    terms += [tg.maximum(c, d), -tg.maximum(-c, -d), (c - d).relu(), (c - d).abs(), c.max(axis=1), d.min(axis=(0, 2))]
    img = tape.param(np.round(rng.standard_normal((2, 3, 8, 8))))
    terms.append(tg.max_pool(img, 2, layout="NCHW"))
    terms.append(tg.max_pool(img, 3, strides=2, padding="SAME", layout="NCHW"))
    loss = None
    for t in terms:
        term = (t * tape.const(rng.standard_normal(t.shape))).sum()
        loss = term if loss is None else loss + term
    tape.backward(loss)
    return tape, loss, [a, b, c, d, img], s


@pytest.mark.parametrize("cc,march", CASES, ids=[f"{os.path.basename(c)}-{t}" for c, t in CASES])
def test_selecting_ops_equal_the_tape_under_every_compiler(cc, march, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("TAPEGRAD_MARCH", march)
    tape, loss, params, s = selecting_graph()
    for fuse in (False, True):
        prog = tg.capture(tape, loss, backend="native", fuse=fuse)
        prog.forward()
        prog.backward()
        # the loss sums the softmax, whose exp is within the libm tier (a miscompiled select is off by far more)
        np.testing.assert_allclose(prog.loss(), tape.value(loss), rtol=1e-13)
        for p in params:
            assert np.array_equal(prog.grad(p), tape.grad(p)), (cc, march, fuse, p)
        want = tape.grad(s)
        assert np.all(np.abs(prog.grad(s) - want) <= 8 * np.spacing(np.abs(want)) + 8 * EPS * np.abs(want).max())


def _is_gcc(cc):
    out = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return "Free Software Foundation" in out and "clang" not in out


GCCS = [cc for cc in compilers() if _is_gcc(cc)]


def one_case_per_op():
    """A program holding every registry op once (its first case): every kernel the emitter prints and
    every runtime kernel a program calls, at a fraction of test_native's every-case build."""
    from op_cases import make, record
    rng = np.random.default_rng(11)
    tape = tg.Tape()
    loss = None
    for op in tg.ops.OPS.values():
        if op.arity and op.cases:
            arrays, s = make(op, op.cases[0], rng)
            _, y = record(tape, op, arrays, s)
            term = (y * tape.const(rng.standard_normal(y.shape))).sum()
            loss = term if loss is None else loss + term
    tape.backward(loss)
    return tg.capture(tape, loss, backend="native", fuse=False)


@pytest.mark.parametrize("cc", GCCS, ids=os.path.basename)
def test_no_masked_vector_moves_in_a_program_of_every_op(cc, tmp_path):
    """The property the fix rests on, read off the assembly: with AVX2 (x86-64-v3), where masked moves
    are the ``vmaskmov``/``vpmaskmov`` instructions, GCC emits none for a program holding every op, nor
    for the selecting graph (before the fix: 52 there, in where's loops and the max/min reductions)."""
    if "x86-64-v3" not in targets(cc):
        pytest.skip(f"{cc} cannot build and run x86-64-v3 code here")
    tape, loss, _, _ = selecting_graph()
    selecting = tg.capture(tape, loss, backend="native", fuse=False)
    flags = [f for f in build.FLAGS if f not in ("-shared", "-march=native")]
    for name, prog in (("every op", one_case_per_op()), ("selecting ops", selecting)):
        src, asm = tmp_path / "p.c", tmp_path / "p.s"
        src.write_text(prog.runner.source)
        subprocess.run([cc, *flags, "-march=x86-64-v3", "-S", "-o", str(asm), str(src)], check=True)
        masked = [ln.strip() for ln in asm.read_text().splitlines() if "maskmov" in ln]
        assert not masked, (cc, name, masked[:5])


def test_clang_alone_gets_the_avx10_warning_silenced(monkeypatch):
    """clang 19's host detection on AVX10 CPUs warns about its own feature list; -Werror must not fail on it.
    GCC gets no extra flag (it would reject an unknown -Wno- option next to another diagnostic)."""
    from tapegrad.native import build
    build.quirks.cache_clear()
    monkeypatch.setattr(build, "compiler_identity", lambda path: f"{path}\n" + ("Debian clang version 19.1.7"
                                                                              if "clang" in path else "gcc (Debian 12.2.0-14) 12.2.0"))
    try:
        assert build.quirks("/usr/bin/clang-19") == ("-Wno-invalid-feature-combination",)
        assert build.quirks("/usr/bin/gcc-12") == ()
    finally:
        build.quirks.cache_clear()
