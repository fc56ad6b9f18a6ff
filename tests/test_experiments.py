"""Each experiment's --quick mode, asserting its agreement claims (never its timings)."""
import os
import sys

import pytest

EXPERIMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments")
sys.path[:0] = [os.path.join(EXPERIMENTS, "studies"), os.path.join(EXPERIMENTS, "bench"), EXPERIMENTS]
pytest.importorskip("interop")


def replot(module, name, data, out):
    """Save ``data`` as the experiment's measurements and redraw them with ``--plot-only``: the PNG appears."""
    import plots
    plots.dump(str(out), name, data)
    module.main(["--plot-only", "--out", str(out)])
    assert (out / (name + ".png")).stat().st_size > 10_000


@pytest.mark.matrix
def test_transformer_three_ways():
    import transformer
    r = transformer.run(transformer.QUICK, out_dir=None, quiet=True)
    log, pairs = r["log"], r["pairs"]
    assert log["eager tape"]["loss"] == log["NumPy replay"]["loss"]          # bit for bit, every step
    assert pairs[("eager tape", "NumPy replay")] == [0.0] * len(log["eager tape"]["loss"])
    # libm (exp, log in softmax) and XLA's summation order: a few ulp per op, still far inside 1e-12
    assert max(pairs[("eager tape", "native program")]) < 1e-12
    assert max(pairs[("eager tape", "jax.jit + optax")]) < 1e-12
    assert log["eager tape"]["loss"][-1] < log["eager tape"]["loss"][0]
    ep = log["program_episode in jax.jit"]["loss"]    # the one-hot form: other sums, same model
    assert max(abs(a - b) / abs(b) for a, b in zip(ep, log["eager tape"]["loss"])) < 1e-12


@pytest.mark.matrix
def test_fusion_study_fused_equals_unfused_with_fewer_kernels(tmp_path):
    import fusion_study
    import transformer
    rows = fusion_study.run(fusion_study.QUICK_MLPS, transformer.QUICK, 1, 2, quiet=True)
    for name, nodes, (unfused, fused), t, same in rows:
        assert same, name
        assert fused < unfused, (name, unfused, fused)
    replot(fusion_study, "fusion_study", {"rows": rows}, tmp_path)
    assert fusion_study.short("MLP 64-512-512-512-512-10 (batch 64)") == "MLP 64-512×4-10"


def test_finetune_memory_lazy_constants_hold_the_frozen_weight_once():
    import finetune_memory as F
    n = 512
    res, agree = F.measure((n,), quiet=True)
    w = n * n * 8 / 2**20
    eager, dropped, lazy = (res[(v, n)] for v in F.VARIANTS)
    assert agree                                     # the same adapter, bit for bit, whichever way
    # peak: no loaded copy and no tape copy (2w), less the transient of verification on first run, a
    # few activation-sized arrays (batch 64 x 512: w/8 each) that the lazy program pays at its first
    # episode and the eager one at capture, under the tape copy's peak
    assert lazy[0] <= eager[0] - 1.25 * w
    assert dropped[1] <= eager[1] - 0.9 * w and lazy[1] <= eager[1] - 0.9 * w   # held after training


def test_reproducibility_claims(tmp_path):
    import reproducibility as R
    r = R.run(R.QUICK, quiet=True)
    same, drift = r["same"], r["drift"]
    for name in ("eager tape, BLAS 1 thread", "NumPy replay"):
        assert same[(name, "eager tape")], name                  # the same rules in the same order
    assert same[("native fused", "native unfused")]               # fusion never changes a bit
    assert same[("native fused, BLAS 1 thread", "native program_episode in jax.jit")]   # the same C inside XLA
    assert same[("ordered: NumPy replay", "ordered: eager tape")]
    # ordered native vs ordered tape: products and sums agree, but this MLP's softmax cross-entropy calls
    # exp/log, where the C library and NumPy's SIMD functions differ by an ulp now and then (libm tier)
    assert same[("jax.jit + optax", "jax.jit + optax, again")]    # XLA is deterministic run to run
    for name, d in drift.items():
        assert max(d) < 1e-12, (name, max(d))                     # and everyone stays within 1e-12
    groups = R.classes(r["names"], same)          # the plot's lines: one per class of bit-identical runs
    assert sorted(sum(groups, [])) == sorted(r["names"])
    assert all(same[(g[0], b)] for g in groups for b in g)
    assert not any(same[(g[0], h[0])] for g in groups for h in groups if g is not h)
    replot(R, "reproducibility", R.saved(r), tmp_path)


def test_data_parallel_two_processes_two_devices_match_one_process(tmp_path):
    import data_parallel as D
    rows = D.run([(2, 2)], D.QUICK, quiet=True)
    (nproc, ndev, diff, rate, times), = rows
    assert diff <= D.BOUND, diff      # the all-reduce sums per-shard means in another order: not ==
    assert rate > 0 and len(times) == D.QUICK["steps"] - 1 and min(times) > 0
    replot(D, "data_parallel", {"cfg": D.QUICK, "rows": rows}, tmp_path)


def test_bench_peers_measures_every_installed_system(tmp_path):
    import bench_peers
    rows, missing = bench_peers.run(("tiny",), quick=True, quiet=True)
    t = rows["tiny"]
    assert {"tapegrad eager", "tapegrad native", "tapegrad program_episode in jax.jit", "jax.jit + optax"} <= set(t)
    assert all(v > 0 for v in t.values())
    for name, system in (("PyTorch", "PyTorch eager"), ("HIPS autograd", "HIPS autograd")):
        assert (name in missing) != (system in t)          # measured, or said to be missing
    replot(bench_peers, "bench_peers", {"rows": rows, "missing": missing}, tmp_path)


def test_plot_only_without_saved_measurements_says_what_to_run(tmp_path):
    import bench_peers
    with pytest.raises(SystemExit, match=r"no saved measurements at .*bench_peers\.json; run `python "
                                         r"experiments/bench/bench_peers\.py` \(with the same --out\) once first"):
        bench_peers.main(["--plot-only", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())                           # and wrote nothing


def test_bench_optim_add_registers_lazily_into_the_state_the_old_scheme_reached():
    import bench_optim_add
    rows = bench_optim_add.main(["--quick", "--repeats", "1"])
    assert [n for n, *_ in rows] == list(bench_optim_add.QUICK) and all(same for *_, same in rows)
