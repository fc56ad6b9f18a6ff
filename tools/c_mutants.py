"""Hand-written mutations of the C the native backend and the XLA handler run (``make mutants``).

mutmut mutates Python only; the C runtime (``tapegrad/native/runtime.c``), the FFI handlers
(``interop/xla/tg_xla.c``, ``interop/xla/tg_gpu.c``) and the shared step scalars get this list of realistic single bugs instead: an off-by-one at a summation
threshold, a dropped NaN check, a swapped operand, a missed bias correction. Each is applied to a
scratch copy of the tree (``build/mutants/c/``, ``c1/``…: one per job), the listed tests run against it (stopping at the
first failure), and the mutant counts as killed when they fail. A mutant that no longer compiles is
reported as invalid (fix the mutation), never as killed.

    python tools/c_mutants.py            # all of them
    python tools/c_mutants.py 3 7        # some, by index
    python tools/c_mutants.py --jobs 1   # one at a time (default: two)
"""
import argparse
import concurrent.futures
import glob
import json
import os
import queue
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "build", "mutants")
RT, XLA = "tapegrad/native/runtime.c", "interop/xla/tg_xla.c"
SS = "tapegrad/native/step_scalars.c"   # Adam's step scalars: the native runtime's and the GPU handler's
GPU, HANDLER = "interop/xla/tg_gpu.c", ["tests/test_gpu_handler.py"]   # the GPU custom call (a stand-in driver)
NATIVE = ["tests/test_native_reductions.py", "tests/test_tape_sweep.py", "tests/test_optim_continuity.py",
          "tests/test_fuse.py", "tests/test_native.py", "tests/test_capture_inputs.py", "tests/test_replay_paths.py"]
INTEROP = ["tests/test_interop_edges.py", "tests/test_interop_program.py"]
DIVISION = ["tests/test_native_division.py"]   # Adam's exact division by its bias corrections
CT = "tapegrad/_ctape.c"   # the eager tape's C core, built into the scratch tree for each of its mutations
TAPE = ["tests/test_ctape.py", "tests/test_tape.py", "tests/test_schedule.py", "tests/test_tape_errors.py",
        "tests/test_tape_edges.py"]

# (file, original text, mutated text, tests, what the bug is). Equivalent mutations carry "equivalent: why".
MUTATIONS = [
    (RT, "    if (n < 8) {", "    if (n <= 8) {", NATIVE, "pairwise sum: sequential path at exactly 8"),
    (RT, "    if (n <= 128) {", "    if (n < 128) {", NATIVE, "pairwise sum: recursion at exactly 128"),
    (RT, "    n2 -= n2 % 8;", "", NATIVE, "pairwise sum: split not rounded to a multiple of 8"),
    (RT, "((r[4] + r[5]) + (r[6] + r[7]))", "((r[4] + r[6]) + (r[5] + r[7]))", NATIVE,
     "pairwise sum: accumulators combined in another order"),
    (RT, "        for (; i < n; i++)\n            res += a[i];\n        return res;",
     "        return res;", NATIVE, "pairwise sum: the tail after the last block of 8 dropped"),
    (RT, "out[i] = mode == 0 ? R(0.0) : mode == 1 ? -INFINITY :", "out[i] = mode == 0 ? R(0.0) : mode == 1 ? R(0.0) :", NATIVE,
     "max reduction starts at 0 instead of -inf"),
    (RT, "                    dst[j] = (d == d && (v > d || v != v)) ? v : d;",
     "                    dst[j] = (v > d) ? v : d;", NATIVE, "max over a kept trailing axis ignores NaN"),
    (RT, "        m = (m == m && ((hi ? v > m : v < m) || v != v)) ? v : m;",
     "        m = ((hi ? v > m : v < m)) ? v : m;", NATIVE, "max over a reduced trailing block ignores NaN"),
    (RT, "        m = (m == m && ((hi ? v > m : v < m) || v != v)) ? v : m;",
     "        m = (((hi ? v > m : v < m) || v != v)) ? v : m;", NATIVE,
     "equivalent: once m is NaN, v > m is false, and v != v only sets m to another NaN"),
    (RT, "    if (odd)\n        return tg_extreme_in_order(hi, m, a, n);", "", NATIVE,
     "max of a row of 16 or more, eight lanes at a time, ignores NaN"),
    (RT, "    for (; i < n; i++)\n        e = (hi ? a[i] > e : a[i] < e) ? a[i] : e;", "", NATIVE,
     "max of a row of 16 or more drops the tail after the last block of 8"),
    (RT, "        if (shape0[k] != 1) {", "        if (1) {", NATIVE,
     "reduction keeps axes of length 1 (row-by-row sums where NumPy sums pairwise)"),
    (RT, "                out[o] += tg_pairwise(p, inner);", "                out[o] = tg_pairwise(p, inner);", NATIVE,
     "sum over a reduced block overwrites instead of accumulating over outer reduced axes"),
    (RT, "                    dst[j] = dst[j] + src[j];", "                    dst[j] = src[j];", NATIVE,
     "sum over a kept trailing axis overwrites instead of adding rows"),
    (RT, "        *o -= st[k] * shape[k];", "        *o -= st[k] * (shape[k] - 1);", NATIVE,
     "gather and scatter: wrong carry when an index wraps"),
    (RT, "            dst[j] = src[o + j * s];", "            dst[j] = src[o + j * (s != 0)];", NATIVE,
     "gather: the last axis read as contiguous (a transpose copies rows)"),
    (RT, "            dst[o + j * s] = first ? v : d + v;", "            dst[o + j * s] = (first || 1) ? v : d + v;", NATIVE,
     "equivalent: every caller (concat, slice and index kernels) passes first = 1 into a fresh buffer"),
    (RT, "        memcpy(gbuf, c, (size_t)n * sizeof(real));", "        memset(gbuf, 0, (size_t)n * sizeof(real));",
     NATIVE, "gradient accumulation: the first contribution is dropped"),
    (RT, "            gbuf[i] = gbuf[i] + c[i];", "            gbuf[i] = c[i] + c[i];", NATIVE,
     "gradient accumulation: adds the contribution twice instead of to the buffer"),
    (RT, "        tg_fill(C, (long)m * n, R(0.0));\n        return;", "        return;", NATIVE,
     "matmul with k = 0 leaves the output unwritten"),
    (RT, "    char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';", "    char tA = ta ? 'T' : 'N', tB = ta ? 'T' : 'N';",
     NATIVE, "matmul: b's transpose flag taken from a's"),
    (RT, "                out[p] = a[p] - r[o * inner + i];", "                out[p] = a[p];", NATIVE,
     "softmax without subtracting the max (overflows for large logits)"),
    (RT, "                    c[p] = out[p] * t;", "                    c[p] = g[p] * t;", NATIVE,
     "softmax backward multiplies by g instead of out"),
    (RT, "                    c[p] = g[p] - t;", "                    c[p] = t - g[p];", NATIVE,
     "logsoftmax backward with the sign flipped"),
    (RT, "    double count = sc[0] + 1.0;", "    double count = sc[0];", NATIVE, "the step count does not advance"),
    (SS, "    double bc1 = 1.0 - pow(b1, count), bc2 = 1.0 - pow(b2, count);",
     "    double bc1 = 1.0 - pow(b1, count), bc2 = 1.0 - pow(b2, count - 1.0);", NATIVE + ["tests/test_gpu_handler.py"],
     "Adam: the second bias correction one step behind"),
    (SS, "        s[0] = lr * sqrt(bc2) / bc1;", "        s[0] = lr * sqrt(bc1) / bc2;", NATIVE + ["tests/test_gpu_handler.py"],
     "Adam (hat): bias corrections swapped"),
    (RT, "        if (!p[6])\n            continue;\n        real *w = TG_B(p[0])",
     "        real *w = TG_B(p[0])", NATIVE, "equivalent: preparing gt for an untouched parameter is harmless, the norm and update loops skip it"),
    (RT, "                real t = l * w[i];\n                gt[i] = g[i] + t;",
     "                real t = l * w[i];\n                gt[i] = g[i] - t;", NATIVE, "L2 term subtracted"),
    (RT, "cmode == 0 ? !(norm < maxn)", "cmode == 0 ? !(norm <= maxn)", NATIVE, "optax clipping misses the exact limit"),
    (RT, "cmode == 1 ? norm > maxn", "cmode == 1 ? norm >= maxn", NATIVE,
     "equivalent: seed clipping at norm == maxn rescales by maxn/norm == 1.0 exactly"),
    (RT, "                        real t = gt[i] / rn;\n                        gt[i] = t * rm;",
     "                        real t = gt[i] * rm;\n                        gt[i] = t / rn;", NATIVE,
     "optax clipping rounded in the seed's order"),
    (RT, "            total += (double)dot(&n, TG_B(p[2]), &one, TG_B(p[2]), &one);",
     "            total += (double)dot(&n, TG_B(p[1]), &one, TG_B(p[1]), &one);", NATIVE,
     "clip norm measured on the raw gradient, without the L2 term"),
    (RT, "            w[i] = w[i] - t;\n        }\n        return;",
     "            w[i] = w[i] + t;\n        }\n        return;", NATIVE, "SGD steps uphill"),
    (RT, "        if (!p[6])\n            continue;\n        long n = (long)p[5], i0",
     "        long n = (long)p[5], i0", NATIVE, "untouched parameters are updated (PyTorch skips them)"),
    (RT, "                    t = t + re;\n                    real u = tg_qdiv(mu[i], bc1, y1);",
     "                    real u = tg_qdiv(mu[i], bc1, y1);", NATIVE, "Adam (optax): eps dropped"),
    (RT, "                    t = t + re;\n                    real u = mu[i] / bc1;", "                    real u = mu[i] / bc1;",
     DIVISION, "Adam (optax): eps dropped where a run divides"),
    (RT, "    return x == R(0.0) ? x : q;", "    return q;", DIVISION,
     "equivalent: GCC 12 keeps -(q·c - x) here and so the sign of a zero (the tests check it); the guard is for a "
     "compiler that folds the negation into x - q·c, as GCC did when the corrections ran in a loop of their own"),
    (RT, "0x1p-60 : 0x1p-900))", "0x1p-140 : 0x1p-1060))", DIVISION,
     "exact quotient taken where its residuals underflow"),
    (RT, "        wild |= (!(m >= TG_QLO) | !(m <= TG_QHI)) & (m != R(0.0));",
     "        wild |= (m < TG_QLO) & (m != R(0.0));", DIVISION,
     "exact quotient taken for infinities, NaN and overflowing quotients"),
    (RT, "    return c >= TG_CLO && c <= R(1.0);", "    return c <= R(1.0);", DIVISION,
     "exact quotient taken for a divisor so small that quotients overflow"),
    (RT, " && tg_qdiv_ok(nu + s, e - s);", ";", DIVISION,
     "Adam: the fast path checks m's run but not v's"),
    (RT, "            t = RSQRT(v);\n            t = t + re;", "            t = RSQRT(v + re);", NATIVE,
     "Adam (hat): eps inside the square root"),
    (RT, "i1 = hi - off < n ? hi - off : n;", "i1 = n;", INTEROP,
     "a split update's part runs on to its parameter's end (elements updated twice)"),
    (RT, "    for (int k = 0; k < u->np_ && off < hi; k++) {", "    for (int k = 0; k < u->np_; k++) {", INTEROP,
     "equivalent: a parameter past the part's end gets an empty range (i1 <= i0)"),
    (RT, "if (pool && pool->parts > 1 && pool->min_mnk > 0 && ", "if (pool && pool->parts > 1 && ", INTEROP,
     "every product split when only updates should be (min_mnk 0)"),
    (XLA, "      ptr[k] = tg_data(cf, 0, k) + b * tg_slot_elems(p, k) * es;", "      ptr[k] = tg_data(cf, 0, k);",
     INTEROP, "vmap: every batch element reads the first one"),
    (XLA, "    memcpy(tg_data(cf, 1, 0) + b * es, (char *)(intptr_t)in->run[p->loss], es);",
     "    memcpy(tg_data(cf, 1, 0), (char *)(intptr_t)in->run[p->loss], es);", INTEROP,
     "vmap: every loss written to element 0"),
    (XLA, "    if (grads) p->backward(in->run);", "    if (grads) p->forward(in->run);", INTEROP,
     "value_and_grad never runs backward"),
    (XLA, "  in->sc[0] = es == 8 ? *(double *)cnt_in : (double)*(int32_t *)cnt_in;", "  in->sc[0] = 0.0; (void)cnt_in;", INTEROP,
     "episode ignores the count operand (Adam restarts its bias correction)"),
    (XLA, "  if (es == 8) *(double *)cnt = in->sc[0]; else *(int32_t *)cnt = (int32_t)in->sc[0];",
     "  if (es == 8) *(double *)cnt = in->sc[0] - 1.0; else *(int32_t *)cnt = (int32_t)in->sc[0];", INTEROP,
     "episode returns the count before the step"),
    (XLA, "    if (d < 0 && b->dtype != want) {", "    if (0 && d < 0 && b->dtype != want) {", INTEROP, "operand dtype unchecked"),
    (XLA, "  if (!n || b * n != e || (B >= 0 && b != B)) {", "  if (!n || (B >= 0 && b != B)) {", INTEROP,
     "operand sizes that are not a multiple of the slot accepted"),
    (XLA, "  while (p && p->hash != hash) p = p->next;", "  while (p && p->hash == hash) p = p->next;", INTEROP,
     "program lookup finds the wrong entry"),
    (XLA, "    if ((*q)->hash == (uint64_t)hash) { *q = (*q)->next; found = 1; break; }",
     "    if ((*q)->hash == (uint64_t)hash) { found = 1; break; }", INTEROP, "unload leaves the program callable"),
    (XLA, "    off += wn[k] * es;\n    if (src[k] != dst[k])", "    if (src[k] != dst[k])", INTEROP,
     "flat episode reads every slot from offset 0"),
    (GPU, "  double count = (es == 8 ? cnt.d : (double)cnt.i) + 1.0;",
     "  double count = (es == 8 ? cnt.d : (double)cnt.i) + 0.0;", HANDLER, "GPU episode: the count does not advance"),
    (GPU, "  if (opt == 2) tg_adam_scalars(lr, b1, b2, (int)hat, count, ctl);",
     "  if (opt == 1) tg_adam_scalars(lr, b1, b2, (int)hat, count, ctl);", HANDLER,
     "GPU episode: Adam's step scalars never uploaded"),
    (GPU, "    ptr[n++] = (int64_t)(intptr_t)(k < nw ? rets[1 + k] : args[k]);",
     "    ptr[n++] = (int64_t)(intptr_t)(k < nw ? args[k] : args[k]);", HANDLER,
     "GPU episode: written slots point at the operands"),
    (GPU, "  home[nset - 1] = a.loss_home;", "  home[nset - 1] = 0;", HANDLER,
     "GPU episode: the loss's table entry is not pointed back"),
    (GPU, "    if (args[k] != rets[1 + k])", "    if (0)", HANDLER,
     "GPU episode: a result XLA did not alias is not copied from its operand"),
    (GPU, "  TG_CU(tg_cu.StreamSynchronize(stream), \"cuStreamSynchronize\");", "", HANDLER,
     "GPU episode: the count is used before its copy completes"),
    (RT, "    fn(arg, 0);\n    for (int i = 1; i < parts; i++) {\n        if (up[i])",
     "    for (int i = 1; i < parts; i++) {\n        if (up[i])", NATIVE,
     "the native runner's threads: the caller's own part of a split update is skipped"),
    (RT, "        job[i] = (tg_thread_part){fn, arg, i};", "        job[i] = (tg_thread_part){fn, arg, 0};", NATIVE,
     "the native runner's threads: every thread runs the first part"),
    (CT, "    if (tsi == NULL || toff == NULL || PyObject_IsTrue(tsi) || PyObject_IsTrue(toff)) {",
     "    if (tsi == NULL || toff == NULL || PyObject_IsTrue(tsi)) {", TAPE,
     "apply: forward scratch that stayed in the first slab is not handed back"),
    (CT, "    int req = PyTuple_GET_ITEM(na, 4) == Py_True || (nb && PyTuple_GET_ITEM(nb, 4) == Py_True);",
     "    int req = PyTuple_GET_ITEM(na, 4) == Py_True;", TAPE, "apply: a parameter reached through b only gets no gradient"),
    (CT, "    pos = PyTuple_Pack(2, si, off);", "    pos = PyTuple_Pack(2, si, PyTuple_GET_ITEM(hit, 1));", TAPE,
     "apply: the node's arena position is taken after its value instead of before"),
    (CT, "    if (PyTuple_GET_ITEM(na, 7) != Py_False || (nb && PyTuple_GET_ITEM(nb, 7) != Py_False))",
     "    if (PyTuple_GET_ITEM(na, 7) != Py_False)", TAPE, "apply: an op on a lazy constant as b runs its forward"),
    (CT, "    if (memo == NULL || PyTuple_GET_ITEM(memo, 2) != Py_None)", "    if (memo == NULL)", TAPE,
     "apply: an op that keeps buffers for its backward runs without them"),
    (CT, "        PyErr_Clear();   /* a value the op cannot take: Python rewinds and reports it */\n        goto undo;",
     "        PyErr_Clear();   /* a value the op cannot take: Python rewinds and reports it */\n        goto python;",
     TAPE, "apply: a failed forward leaves its value's arena space taken"),
    (CT, "        if (!ours) {", "        if (ours) {", TAPE, "sources: the package's own frame is recorded instead of the caller's"),
    (CT, "    int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(n, 5), SLOT(v, off_epoch), Py_EQ);",
     "    int same = 1;", TAPE, "apply: a Var dropped by reset_to is taken for the node now at its id"),
    (CT, "ordered != Py_None || check != Py_False", "ordered == NULL || check != Py_False", TAPE,
     "apply: an ordered tape records the op's plain variant"),
    (CT, "ordered != Py_None || check != Py_False", "ordered != Py_None || check == NULL", TAPE,
     "apply: check_finite is not checked on the C path"),
    (CT, "        Py_TYPE(SLOT(args[0], off_tape)) == (PyTypeObject *)TapeCls &&", "", TAPE,
     "methods: a Tape subclass's own apply is bypassed"),
    (CT, "                PyList_SetItem(gpass, j, Py_NewRef(p));\n                continue;",
     "                continue;", TAPE, "replay: a gradient written in place is not marked as this pass's"),
    (CT, "        r = call_kw(np_add, ad, 3, kw_out);", "        r = PyObject_Vectorcall(np_copyto, ad, 2, NULL);",
     TAPE, "replay: a later contribution overwrites the gradient instead of adding to it"),
    (CT, "            if (!there) {", "            if (0) {", TAPE, "replay: the scratch arena is not rewound before a rule"),
    (CT, "        SLOT(res, off_epoch) = Py_NewRef(epoch);", "        SLOT(res, off_epoch) = Py_NewRef(zero);", TAPE,
     "apply: the Var is stamped with the first episode instead of the tape's current one"),
    (CT, "        return PyList_Append(kept, jobj);", "        return 0;", TAPE,
     "replay: a gradient adopted from the scratch arena is not listed as living there"),
    (CT, "            if (x == -2) {", "            if (x == -3) {", TAPE,
     "replay: an op's kept buffers are not passed to its rule"),
    (CT, "            c = Py_NewRef(PyTuple_GET_ITEM(buf, 2));", "            c = Py_NewRef(PyTuple_GET_ITEM(buf, 0));", TAPE,
     "replay: a summed contribution is taken in its reduced shape's view instead of the buffer"),
    (RT, "cmode == 0 ? !(norm < maxn)", "cmode == 0 ? norm >= maxn", ["tests/test_reliability_clip.py"],
     "optax clipping leaves g alone at a NaN norm (optax makes every update NaN)"),
]


def tree_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [f for f in out if f and f.split("/")[0] in ("tapegrad", "interop", "tests", "pyproject.toml", "conftest.py")]


def copy_tree(work):
    shutil.rmtree(work, ignore_errors=True)
    for f in tree_files():
        if os.path.exists(os.path.join(ROOT, f)):
            os.makedirs(os.path.dirname(os.path.join(work, f)) or work, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(work, f))


def build_core(work):
    """Compile tapegrad/_ctape.c of the scratch tree as setuptools would (warnings are errors)."""
    import sysconfig
    so = os.path.join(work, "tapegrad", "_ctape" + sysconfig.get_config_var("EXT_SUFFIX"))
    return subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
                           "-Wno-unused-parameter", "-I", sysconfig.get_paths()["include"], os.path.join(work, CT),
                           "-o", so], capture_output=True, text=True, timeout=300)


def run_one(work, k):
    path, old, new, tests, what = MUTATIONS[k]
    full = os.path.join(work, path)
    with open(os.path.join(ROOT, path)) as f:
        orig = f.read()
    if orig.count(old) != 1:
        return {"index": k, "file": path, "what": what, "status": "stale",
                "detail": f"the original text occurs {orig.count(old)} times (update the mutation)"}
    with open(full, "w") as f:
        f.write(orig.replace(old, new))
    # the FFI handler falls back silently when it does not build (programs then run through a host callback),
    # so a tg_xla.c mutation is first built on its own: one that does not compile is invalid, not killed
    probe = "import sys; from interop.xla import program as P; sys.exit(0 if P.native_library() else P._LIB['why'])"
    env = {**os.environ, "PYTHONPATH": work, "TAPEGRAD_CACHE": os.path.join(OUT, "cache"),
           "CC": os.path.join(ROOT, "tools", "cc_mutants")}   # -O0: same bits, compiles 20x faster
    try:
        if path == XLA:
            b = subprocess.run([sys.executable, "-c", probe], cwd=work, env={**env, "TAPEGRAD_WERROR": "1"},
                               capture_output=True, text=True, timeout=900)
            if b.returncode:
                return {"index": k, "file": path, "what": what, "status": "invalid",
                        "detail": (b.stdout + b.stderr).strip()[:160]}
        if path == CT:   # build the mutated core where the scratch tree's tapegrad imports it from
            b = build_core(work)
            if b.returncode:
                return {"index": k, "file": path, "what": what, "status": "invalid",
                        "detail": (b.stdout + b.stderr).strip()[:160]}
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                            *tests], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired:
        text, rc = "timeout", 124
    finally:
        with open(full, "w") as f:
            f.write(orig)
        if path == CT:   # the other mutations run on the Python paths, as the scratch tree has no core
            for so in glob.glob(os.path.join(work, "tapegrad", "_ctape*.so")):
                os.remove(so)
    if "BuildError" in text and ("error:" in text or "warning" in text):
        status = "invalid"
    elif rc == 0:
        status = "survived"
    else:
        status = "killed"
    failed = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))][:1]
    return {"index": k, "file": path, "what": what, "status": status, "detail": failed[0][:160] if failed else ""}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pick", nargs="*", type=int, help="mutation indices (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="mutations run in parallel, each in its own copy (default 2)")
    args = ap.parse_args()
    pick = args.pick or range(len(MUTATIONS))
    os.makedirs(OUT, exist_ok=True)
    works = queue.Queue()
    for j in range(max(1, args.jobs)):
        work = os.path.join(OUT, "c" if j == 0 else f"c{j}")
        copy_tree(work)
        works.put(work)
    t0 = time.time()

    def one(k):
        work = works.get()
        try:
            r = run_one(work, k)
        finally:
            works.put(work)
        print(f"[{k:2d}] {r['status']:9s} {r['file']}: {r['what']}  {r['detail']}", flush=True)
        return r
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, pick))
    path = os.path.join(OUT, "c.json")
    if args.pick and os.path.exists(path):   # a partial rerun: keep the other mutations' last results
        with open(path) as f:
            earlier = {r["index"]: r for r in json.load(f)["results"]}
        earlier.update({r["index"]: r for r in results})
        results = [earlier[k] for k in sorted(earlier)]
    equivalent = [r for r in results if r["what"].startswith("equivalent:")]
    counted = [r for r in results if r not in equivalent and r["status"] in ("killed", "survived")]
    killed = sum(r["status"] == "killed" for r in counted)
    summary = {"killed": killed, "total": len(counted), "equivalent": len(equivalent),
               "seconds": round(time.time() - t0), "results": results,
               "survivors": [f"{r['file']} [{r['index']}]: {r['what']}" for r in counted if r["status"] == "survived"],
               "invalid": [r for r in results if r["status"] in ("invalid", "stale")]}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"C mutations: {killed} / {len(counted)} killed, {len(equivalent)} equivalent (not counted), "
          f"{len(summary['invalid'])} invalid or stale, {summary['seconds']} s")
    for s in summary["survivors"]:
        print("  survived:", s)
    return 1 if summary["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
