"""Each experiment's --quick mode, asserting its agreement claims (never its timings)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))
pytest.importorskip("interop")


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


def test_fusion_study_fused_equals_unfused_with_fewer_kernels():
    import fusion_study
    import transformer
    rows = fusion_study.run(fusion_study.QUICK_MLPS, transformer.QUICK, 1, 2, quiet=True)
    for name, nodes, (unfused, fused), t, same in rows:
        assert same, name
        assert fused < unfused, (name, unfused, fused)
