"""The generated elementwise loops are vector code under the compiler and -march the matrix runs them with.

A captured float32 block of the kinds the models train (a dense layer, GELU both ways, LayerNorm, an
attention softmax whose row maxima broadcast over four axes, sigmoid, where, log, erf) is printed, each
fused loop kept out of line (``noinline``; GCC's identical-code folding off, so every loop reports),
and compiled with the compiler's vectorisation report. Every loop of more than a few elements that
computes something must be reported vectorised, as a loop or, fully unrolled, as straight-line vector
code (clang does that with rows of 32). A loop that only copies becomes memcpy; one that calls a
function the C library computes (a float64 log or erf) stays scalar by design (fuse.py).
"""
import os
import re
import subprocess

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.native import build, fuse
from tapegrad.native.expr import VECTOR_MATH32

pytestmark = pytest.mark.matrix


def block(dtype):
    rng = np.random.default_rng(2)
    tape = tg.Tape(dtype)
    B, T, D, H = 4, 32, 64, 4
    x = tape.const(rng.standard_normal((B, T, D)).astype(dtype))
    w1, b1 = tape.param(rng.standard_normal((D, 4 * D)) * 0.1), tape.param(np.zeros(4 * D))
    w2 = tape.param(rng.standard_normal((4 * D, D)) * 0.1)
    g, beta = tape.param(np.ones(D)), tape.param(np.zeros(D))
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    h = xc / ((xc * xc).mean(axis=-1, keepdims=True) + 1e-5).sqrt() * g + beta          # LayerNorm
    u = h.reshape(B * T, D) @ w1 + b1
    gelu_tanh = 0.5 * u * (1.0 + (0.7978845608 * (u + 0.044715 * u * u * u)).tanh())
    gelu_erf = 0.5 * u * (1.0 + tg.erf(u * 0.7071067811865476))
    y = (gelu_tanh + gelu_erf) @ w2
    q = h.reshape(B, T, H, D // H).transpose((0, 2, 1, 3)).reshape(B * H, T, D // H)
    k = h.reshape(B, T, H, D // H).transpose((0, 2, 3, 1)).reshape(B * H, D // H, T)
    s = tg.bmm(q, k).reshape(B, H, T, T)
    att = (s - s.max(axis=-1, keepdims=True)).exp()
    att = att / att.sum(axis=-1, keepdims=True)
    gate = tg.sigmoid(y) * tg.where(tg.greater(y, 0.0), y, 0.01 * y) + tg.maximum(y, 0.0)
    loss = (gate * gate).mean() + att.mean() + (att + 1.0).log().mean()
    return tape, loss


def _helpers(src):
    """{name: (its lines, its body)} of every fused loop's function."""
    out, cur = {}, None
    for i, line in enumerate(src.splitlines(), 1):
        m = re.match(r"static (?:__attribute__\(\(noinline\)\) )?void (tg_[fb]\d+)\(", line)
        if m:
            cur = m.group(1)
            out[cur] = (set(), [])
        elif cur and line.startswith("}"):
            cur = None
        elif cur:
            out[cur][0].add(i)
            out[cur][1].append(line.strip())
    return out


def _exempt(body, dtype):
    """A loop of a few elements, a copy, or one calling the C library (not vector code by design)."""
    text = " ".join(body)
    trips = re.findall(r"< (\d+)L; i\d* ?\+\+", text)
    copy = all(re.fullmatch(r"(\{|for \(.*\{|\}|const long i = .*;|[vgS]\d+\[i\] = [vgS]\d+\[i\];)", ln) for ln in body)
    vector = (fuse._VECTOR32 if dtype == "float32" else fuse._VECTOR) | set(VECTOR_MATH32.values()) | {"tg_sel"}
    calls = {f for f in re.findall(r"\b([a-z_][a-z_0-9]*)\(", text) if f not in ("for",)}
    libm = {f[:-1] if dtype == "float32" and f.endswith("f") else f for f in calls} - vector
    return (trips and int(trips[-1]) < 16) or copy or bool(libm)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_fused_loop_is_vector_code(dtype, tmp_path):
    tape, loss = block(dtype)
    prog = tg.capture(tape, loss, backend="native", dtype=dtype)
    src = prog.runner.source.replace("static void tg_", "static __attribute__((noinline)) void tg_")
    helpers = _helpers(src)
    path = tmp_path / "prog.c"
    path.write_text(src)
    cc = build.find_compiler()
    clang = "clang" in build.compiler_identity(cc, *build.cc_args())
    report = ["-Rpass=loop-vectorize|slp-vectorizer"] if clang else ["-fopt-info-vec-optimized", "-fno-ipa-icf"]
    flags = [f for f in build.flags() if f not in ("-shared", "-Werror")] + list(build.quirks(cc, *build.cc_args()))
    r = subprocess.run([cc, *build.cc_args(), *flags, *report, "-c", str(path), "-o", os.devnull],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    done = {int(m) for m in re.findall(r"prog\.c:(\d+):\d+: (?:optimized: (?:loop|basic block part) vectorized|"
                                         r"remark: (?:vectorized loop|Stores SLP vectorized))", r.stderr)}
    wanted = {name: lines for name, (lines, body) in helpers.items() if not _exempt(body, dtype)}
    assert len(wanted) >= 12, sorted(helpers)
    scalar = sorted(name for name, lines in wanted.items() if not lines & done)
    assert not scalar, (build.march(), [(n, helpers[n][1]) for n in scalar[:3]])
