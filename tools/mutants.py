"""Mutation testing of tapegrad's core with mutmut, one module at a time (``make mutants``).

Each module is mutated in a scratch copy of the working tree (``build/mutants/<module>/``) against its own
selection of test files; mutmut narrows that further to the tests that call the mutated function, and
forks every mutant from a process that has already imported and collected everything. The C runtime is
covered by ``tools/c_mutants.py`` (hand-written mutations), which ``make mutants`` runs afterwards.

    python tools/mutants.py                  # every core module (under an hour on 2 cores)
    python tools/mutants.py gpu              # the GPU backend's modules, named one by one
    python tools/mutants.py tape optim       # some of them
    python tools/mutants.py --report         # rebuild the report from the last runs only

Mutants listed in ``tools/mutants_equivalent.toml`` (cannot change behaviour; each with its reason) are
not counted. The figures and every surviving mutant's diff go to report.md in the ``build/mutants`` folder; a machine
readable copy to ``build/mutants/results.json``. Killed = the selected tests failed, timed out or
crashed; survived = they passed, or no selected test reached the mutated function.
"""
import argparse
import ast
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "build", "mutants")
EQUIVALENT = os.path.join(ROOT, "tools", "mutants_equivalent.toml")

# module -> (source file, test files that exercise it). mutmut runs, per mutant, only those of these
# tests that call the mutated function, fastest first, stopping at the first failure.
MODULES = {
    "tape": ("tapegrad/tape.py", ["tests/test_tape.py", "tests/test_tape_errors.py", "tests/test_tape_semantics.py",
                                  "tests/test_tape_sweep.py", "tests/test_capture_inputs.py", "tests/test_optim.py",
                                  "tests/test_bad_input_tape.py", "tests/test_names.py", "tests/test_ops_index.py",
                                  "tests/test_tape_reports.py", "tests/test_tape_edges.py", "tests/test_schedule.py"]),
    "schedule": ("tapegrad/schedule.py", ["tests/test_schedule.py", "tests/test_tape_semantics.py", "tests/test_tape.py"]),
    "optim": ("tapegrad/optim.py", ["tests/test_optim.py", "tests/test_optim_edges.py",
                                    "tests/test_optim_continuity.py", "tests/test_capture.py",
                                    "tests/test_optim_args.py"]),
    "capture": ("tapegrad/capture.py", ["tests/test_capture.py", "tests/test_capture_errors.py",
                                        "tests/test_names.py",
                                        "tests/test_capture_inputs.py",
                                        "tests/test_optim_continuity.py", "tests/test_tape_sweep.py",
                                        "tests/test_capture_data.py", "tests/test_capture_sync.py",
                                        "tests/test_capture_paths.py", "tests/test_capture_device.py",
                                        "tests/test_native_memory.py"]),
    "checkpoint": ("tapegrad/checkpoint.py", ["tests/test_optim.py", "tests/test_checkpoint_atomic.py",
                                              "tests/test_checkpoint_errors.py", "tests/test_faults_checkpoint.py",
                                              "tests/test_checkpoint_formats.py", "tests/test_names.py"]),
    "replay": ("tapegrad/replay.py", ["tests/test_capture.py", "tests/test_capture_errors.py", "tests/test_tape_sweep.py",
                                      "tests/test_optim_continuity.py", "tests/test_capture_inputs.py",
                                      "tests/test_replay_paths.py"]),
    "ops": ("tapegrad/ops/core.py", ["tests/test_ops.py", "tests/test_tape.py", "tests/test_native_reductions.py",
                                "tests/test_ops_helpers.py", "tests/test_ops_shapes.py", "tests/test_docs.py",
                                "tests/test_bad_input_tape.py"]),
    "fuse": ("tapegrad/native/fuse.py", ["tests/test_fuse.py", "tests/test_fuse_edges.py", "tests/test_native_reductions.py"]),
    "codegen": ("tapegrad/native/codegen.py", ["tests/test_native.py", "tests/test_fuse.py", "tests/test_emit.py",
                                               "tests/test_native_reductions.py", "tests/test_tape_sweep.py",
                                               "tests/test_codegen_paths.py", "tests/test_native_views.py",
                                               "tests/test_native_memory.py"]),
    "oracle": ("interop/oracle/check.py", ["tests/test_oracle_check_grads.py", "tests/test_interop_edges.py",
                                     "tests/test_oracle_reports.py"]),
    "program": ("interop/xla/program.py", ["tests/test_interop_program.py", "tests/test_interop_edges.py"]),
    "gpu": ("tapegrad/gpu/source.py", ["tests/test_gpu_source.py", "tests/test_gpu.py", "tests/test_gpu_ops.py",
                                       "tests/test_gpu_ops_more.py"]),
    "ordered": ("tapegrad/ordered.py", ["tests/test_ordered.py", "tests/test_tape_edges.py"]),
    "gpu_runner": ("tapegrad/gpu/runner.py", ["tests/test_gpu_cupy_runner.py", "tests/test_gpu.py", "tests/test_capture_device.py",
                                             "tests/test_gpu_host.py"]),
    "gpu_host": ("tapegrad/gpu/host.py", ["tests/test_gpu.py", "tests/test_gpu_host.py"]),
    "gpu_rowspace": ("tapegrad/gpu/rowspace.py", ["tests/test_gpu_rowspace.py", "tests/test_gpu.py"]),
    "gpu_conv": ("tapegrad/gpu/source_conv.py", ["tests/test_gpu_ops_more.py"]),
    "gpu_index": ("tapegrad/gpu/source_index.py", ["tests/test_gpu_ops.py"]),
    "gpu_linalg": ("tapegrad/gpu/source_linalg.py", ["tests/test_gpu_ops_more.py"]),
    "gpu_layout": ("tapegrad/gpu/source_layout.py", ["tests/test_gpu_ops.py"]),
    "gpu_reduce": ("tapegrad/gpu/source_reduce.py", ["tests/test_gpu_ops.py"]),
    "gpu_scan": ("tapegrad/gpu/source_scan.py", ["tests/test_gpu_ops.py"]),
    "gpu_device_runtime": ("tapegrad/gpu/device_runtime.py", ["tests/test_gpu_ops.py", "tests/test_gpu_ops_more.py"]),
    "gpu_call": ("interop/xla/gpu_call.py", ["tests/test_interop_gpu.py", "tests/test_gpu_handler.py"]),
    "dlpack": ("interop/xla/dlpack.py", ["tests/test_dlpack_gpu.py", "tests/test_interop.py", "tests/test_interop_edges.py",
                                     "tests/test_bad_input_interop.py"]),
}
# the registry (the Op record, the table, the test domains) is read by the same tests as the core ops
MODULES["ops_registry"] = ("tapegrad/ops/registry.py", MODULES["ops"][1])
# The GPU backend's modules are named on the command line (make mutants MUTANTS="gpu ..."); the default
# run is the core, which is meant to finish in under an hour on 2 cores.
GPU = ["gpu", "ordered", "gpu_runner", "gpu_host", "gpu_rowspace", "gpu_conv", "gpu_index", "gpu_linalg",
       "gpu_layout", "gpu_reduce", "gpu_scan", "gpu_device_runtime", "gpu_call", "dlpack"]
CORE = [m for m in MODULES if m not in GPU]
# Tests that cannot pass under mutmut: the tape reports the first stack frame outside the tapegrad package as
# the place that created a node, and a mutated module calls through mutmut's trampoline (outside it); the
# allocation count of a NumPy replay includes the trampoline's own bookkeeping.
NO_ALLOC = "tests/test_capture.py::test_numpy_episode_allocates_no_arrays_after_the_first"
JAX_INDEX = ["tests/test_ops_index.py::" + t for t in (
    "test_strided_slices_flip_split_stack", "test_embedding_bag_classifier_with_integer_labels",
    "test_masked_causal_attention_with_minus_inf", "test_gru_unrolled_by_a_python_loop_matches_lax_scan",
    "test_graph_convolution_with_scatter_add", "test_cnn_with_integer_labels",
    "test_data_slots_are_part_of_the_program_inside_jax_jit")]   # these run JAX (the data-input tests before them do not)
LINES = ["tests/test_tape.py::test_check_finite_names_the_first_bad_node_and_its_line",
         "tests/test_tape.py::test_first_nonfinite_finds_values_then_gradients",
         "tests/test_tape.py::test_first_nonfinite_reports_the_exact_line_of_each_creating_call"]
DESELECT = {
    "tape": JAX_INDEX + LINES + ["tests/test_tape_edges.py::test_a_direct_apply_names_the_line_that_called_it"],
    "schedule": LINES,
    "capture": [NO_ALLOC],
    "replay": [NO_ALLOC],
    "optim": [NO_ALLOC],
    # the families' programs through nvcc (4 s each): their kernels are the families' text; what source.py
    # writes is compiled by the host emulation and by the nvcc tests of tests/test_gpu.py and test_gpu_source.py
    "gpu": ["tests/test_gpu_ops.py::test_family_kernels_compile_with_nvcc",
            "tests/test_gpu_ops_more.py::test_conv_and_linalg_kernels_compile_with_nvcc"],
    # a warning's stacklevel counts mutmut's trampoline as a frame (as the tape's file:line tests do)
    "dlpack": ["tests/test_dlpack_gpu.py::test_jax_to_cupy_warns_at_the_callers_line"],
}
FORKSERVER = {"oracle", "program", "codegen", "gpu_call", "dlpack"}   # ops: its tests (test_ops, test_tape, test_native_reductions) never run JAX
# imported by the fork server (none of them starts JAX's backend, which forked children would inherit dead)
PRELOAD = ["numpy", "scipy", "scipy.linalg", "jax", "jax.numpy", "chex", "optax", "hypothesis", "pytest",
           "absl.testing.parameterized"]
# pytest's 2 (interrupted: a collection error) counts as killed: a mutant that breaks a test module's setup
# (e.g. the FFI handler's source, built when the interop tests are imported) fails those tests.
STATUS = {1: "killed", 2: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault",
          -6: "segfault"}   # -6: SIGABRT, the C library stopping a child whose mutant corrupted the heap
KILLED = {"killed", "timeout", "segfault"}


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    return [f for f in out if f and f.split("/")[0] in ("tapegrad", "interop", "tests", "pyproject.toml", "conftest.py",
                                                            "README.md", "docs")]


def prepare(name):
    src, tests = MODULES[name]
    work = os.path.join(OUT, name)
    args = ["-p", "no:cacheprovider", "-W", "ignore"] + [a for t in DESELECT.get(name, []) for a in ("--deselect", t)]
    shutil.rmtree(work, ignore_errors=True)
    for f in tracked_files():
        if os.path.exists(os.path.join(ROOT, f)):
            os.makedirs(os.path.dirname(os.path.join(work, f)) or work, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(work, f))
    with open(os.path.join(work, "pyproject.toml"), "a") as f:
        f.write("\n[tool.mutmut]\n"
                f"source_paths = [{json.dumps(src)}]\n"
                f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
                f"pytest_add_cli_args = {json.dumps(args)}\n"
                'also_copy = ["tapegrad", "interop", "tests", "conftest.py", "README.md", "docs"]\n'   # conftest: JAX x64
                "use_git_change_detection = false\n"
                # JAX (imported by the interop and op-family tests) starts threads: children forked from a
                # process that ran JAX can deadlock, so they fork from a server that has only collected the tests.
                f'process_isolation = "{"forkserver" if name in FORKSERVER else "fork"}"\n'
                # The server must not start JAX's backend either, and collecting the interop tests would
                # (module-level jnp arrays): it only imports the libraries, each child collects for itself.
                # A child then compiles its JAX functions cold, far slower than mutmut's warm estimate.
                + ('forkserver_warmup = "import"\npreload_modules_file = "mutmut_preload.txt"\n'
                   "timeout_constant = 10.0\n" if name in FORKSERVER else ""))
    if name in FORKSERVER:
        with open(os.path.join(work, "mutmut_preload.txt"), "w") as f:
            f.write("\n".join(PRELOAD) + "\n")
    return work


def run_module(name, jobs):
    work = prepare(name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TAPEGRAD_CACHE"] = os.path.join(OUT, "cache")   # mutated C never lands in the user's build cache
    # mutmut mutates the Python paths; the eager tape's C core (which an editable install would load
    # from the checkout) is switched off so they run. tools/c_mutants.py mutates the core itself.
    env["TAPEGRAD_PURE"] = "1"
    env["CC"] = os.path.join(ROOT, "tools", "cc_mutants")   # -O0: same bits, compiles 20x faster
    env["CXX"] = os.path.join(ROOT, "tools", "cxx_mutants")   # the GPU host emulation's C++, -O0 likewise
    t0 = time.time()
    with open(os.path.join(OUT, f"{name}.log"), "w") as log:
        rc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)], cwd=work, env=env,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.time() - t0
    with open(os.path.join(OUT, f"{name}.seconds"), "w") as f:
        f.write(f"{seconds:.0f}\n")
    return collect(name, seconds, rc)


def mutant_diffs(work, src):
    """{mutant key: unified diff against the original function}, read from mutmut's mutated copy."""
    path = os.path.join(work, "mutants", src)
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    funcs = {n.name: "\n".join(lines[n.lineno - 1:n.end_lineno]) for n in ast.walk(ast.parse(text))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and "__mutmut_" in n.name}
    prefix = src[:-3].replace("/", ".") + "."
    out = {}
    for name, body in funcs.items():
        base, _, tag = name.rpartition("__mutmut_")
        if tag == "orig":
            continue
        orig = funcs.get(base + "__mutmut_orig", "")
        a = orig.replace(base + "__mutmut_orig", base).splitlines()
        b = body.replace(name, base).splitlines()
        out[prefix + name] = "\n".join(difflib.unified_diff(a, b, src, src, n=1, lineterm=""))
    return out


def function_of(key):
    """``tapegrad.optim.xǁOptimizerǁadd__mutmut_8`` -> ``Optimizer.add``; ``...x_clips__mutmut_5`` -> ``clips``."""
    fn = key.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
    return fn[2:] if fn.startswith("x_") else fn.lstrip("x").strip("ǁ").replace("ǁ", ".")


def added_lines(diff):
    return "\n".join(ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++"))


def load_equivalents():
    if not os.path.exists(EQUIVALENT):
        return []
    with open(EQUIVALENT, "rb") as f:
        return tomllib.load(f).get("equivalent", [])


def collect(name, seconds=None, rc=None):
    src, _ = MODULES[name]
    work = os.path.join(OUT, name)
    meta = os.path.join(work, "mutants", src + ".meta")
    if not os.path.exists(meta):
        return {"module": name, "file": src, "error": f"no results (mutmut exit {rc}); see build/mutants/{name}.log"}
    with open(meta) as f:
        codes = json.load(f)["exit_code_by_key"]
    eqs = [e for e in load_equivalents() if e["module"] == name]
    diffs = mutant_diffs(work, src)
    counts, survivors, equivalent = {}, [], []
    for key, code in codes.items():
        status = STATUS.get(code, "not checked" if code is None else "suspicious")
        if status in ("survived", "no tests", "suspicious"):
            diff = diffs.get(key, "(diff not found)")
            fn, added = function_of(key), added_lines(diff)
            why = next((e["why"] for e in eqs if e["function"] == fn and e["line"].strip() == added), None)
            if why is not None:
                equivalent.append({"key": key, "function": fn, "line": added, "why": why})
                status = "equivalent"
            else:
                survivors.append({"key": key, "function": fn, "status": status, "diff": diff})
        counts[status] = counts.get(status, 0) + 1
    killed = sum(counts.get(s, 0) for s in KILLED)
    total = sum(counts.values()) - counts.get("equivalent", 0) - counts.get("not checked", 0) - counts.get("skipped", 0)
    res = {"module": name, "file": src, "counts": counts, "killed": killed, "total": total,
           "score": killed / total if total else None, "survivors": survivors, "equivalent": equivalent}
    timing = os.path.join(OUT, f"{name}.seconds")
    if seconds is None and os.path.exists(timing):
        with open(timing) as f:
            seconds = float(f.read())
    if seconds is not None:
        res["seconds"] = round(seconds)
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1, ensure_ascii=False)
    return res


def report():
    results = []
    for name in MODULES:
        p = os.path.join(OUT, f"{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                results.append(json.load(f))
    c = os.path.join(OUT, "c.json")
    cres = json.load(open(c)) if os.path.exists(c) else None
    lines = ["# Mutation testing report", "",
             "| module | killed / non-equivalent | score | equivalent | survived | no tests | minutes |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| `{r['file']}` | {r['error']} | | | | | |")
            continue
        n = r["counts"]
        lines.append(f"| `{r['file']}` | {r['killed']} / {r['total']} | {100 * (r['score'] or 0):.1f}% | "
                     f"{n.get('equivalent', 0)} | {n.get('survived', 0)} | {n.get('no tests', 0)} | "
                     f"{r.get('seconds', 0) / 60:.1f} |")
    if cres:
        lines.append(f"| C runtime (`tools/c_mutants.py`) | {cres['killed']} / {cres['total']} | "
                     f"{100 * cres['killed'] / max(cres['total'], 1):.1f}% | {cres['equivalent']} | "
                     f"{cres['total'] - cres['killed']} | | {cres['seconds'] / 60:.1f} |")
    for r in results:
        if r.get("survivors"):
            lines += ["", f"## Survivors in `{r['file']}`", ""]
            for s in r["survivors"]:
                lines += [f"### {s['key']} ({s['status']})", "", "```diff", s["diff"].strip(), "```", ""]
    if cres and cres["survivors"]:
        lines += ["", "## Surviving C mutations", ""] + [f"- {s}" for s in cres["survivors"]]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(OUT, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump({"modules": results, "c": cres}, f, indent=1, ensure_ascii=False)
    return text


def equivalents_markdown():
    """The equivalent mutants as a markdown list (for docs/testing.md)."""
    out = []
    for e in load_equivalents():
        line = e["line"].replace("\n", " ⏎ ")
        out.append(f"- `{MODULES[e['module']][0]}` `{e['function']}`: `{line}` — {e['why']}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from c_mutants import MUTATIONS
    for k, (path, old, new, _, what) in enumerate(MUTATIONS):
        if what.startswith("equivalent:"):
            out.append(f"- `{path}` C mutation {k}: `{old.strip()}` → `{new.strip()}` — {what[len('equivalent: '):]}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help=f"some of {', '.join(MODULES)} (default: the core, "
                                                        f"all but {', '.join(GPU)})")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run in parallel (default 2)")
    ap.add_argument("--report", action="store_true", help="only rebuild the report from earlier runs")
    ap.add_argument("--equivalents", action="store_true", help="print the equivalent mutants as markdown")
    ap.add_argument("--collect", action="store_true", help="re-read finished mutmut runs (after editing the "
                                                           "equivalents) without running mutants")
    args = ap.parse_args()
    bad = [m for m in args.modules if m not in MODULES]
    if bad:
        ap.error(f"unknown module(s) {bad}; choose from {list(MODULES)}")
    os.makedirs(OUT, exist_ok=True)
    if args.equivalents:
        print(equivalents_markdown())
        return
    if not args.report:
        for name in args.modules or CORE:
            r = collect(name) if args.collect else run_module(name, args.jobs)
            if "error" in r:
                print(f"{name}: {r['error']}", flush=True)
            else:
                print(f"{name}: {r['killed']} / {r['total']} killed ({100 * (r['score'] or 0):.1f}%), "
                      f"{len(r['survivors'])} survivors, {len(r['equivalent'])} equivalent, {r.get('seconds')} s",
                      flush=True)
    text = report()
    print(text.split("\n## ")[0])


if __name__ == "__main__":
    main()
