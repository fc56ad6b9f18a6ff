"""The README fits on a screen, its four examples run and show what they say, and it points into the docs."""
import re

import numpy as np
import pytest

from docs_pages import ROOT, block, masked, python_blocks, section, text

README = text("README.md")


def test_the_readme_is_at_most_200_lines():
    assert len(README.splitlines()) <= 200, "the README is a front page: move detail into docs/"


def test_it_says_what_why_install_the_two_commands_and_where_bugs_go():
    for heading in ("## Why", "## Install", "## Two commands", "## The gradient oracle", "## Capture once, replay fast",
                    "## Inside `jax.jit`", "## One benchmark", "## Documentation", "## Reporting a bug"):
        assert heading + "\n" in README, heading
    assert "make demo" in README and "make test" in README
    assert "`python -m tapegrad info`" in section("README.md", "## Reporting a bug")
    assert len(python_blocks(README)) == 4


def test_it_links_every_docs_page_that_exists():
    linked = set(re.findall(r"\]\((docs/[\w/.-]+\.md)\)", README))
    assert all((ROOT / p).exists() for p in linked), sorted(p for p in linked if not (ROOT / p).exists())
    pages = {f"docs/{p.relative_to(ROOT / 'docs').as_posix()}" for p in (ROOT / "docs").rglob("*.md")}
    assert pages - {"docs/index.md"} <= linked, sorted(pages - linked)


def test_the_oracle_example_agrees_and_prints_what_the_readme_shows():
    pytest.importorskip("jax")
    scope = {}
    exec(compile(block("README.md", "## The gradient oracle"), "README.md", "exec"), scope)
    shown = re.search(r"^```\n(check_grads:.*?)^```", section("README.md", "## The gradient oracle"), re.S | re.M)
    assert scope["report"].ok and scope["report"].verdict == "agree"
    assert masked(scope["report"]) == masked(shown.group(1))


def test_the_capture_example_trains_natively_and_syncs_back():
    scope = {}
    exec(compile(block("README.md", "## Capture once, replay fast"), "README.md", "exec"), scope)
    tape, program, W = scope["tape"], scope["program"], scope["W"]
    assert program.backend == "native"
    assert np.array_equal(tape.value(W), program.value(W))
    assert float(program.loss()) < 0.6


def test_the_jit_example_trains_inside_jax_jit():
    pytest.importorskip("jax")
    scope = {}
    exec(compile(block("README.md", "## Inside `jax.jit`"), "README.md", "exec"), scope)
    params, opt_state = scope["params"], scope["opt_state"]
    assert list(params) == ["W", "b"] and int(opt_state.count) == 10 and set(opt_state.mu) == {"W", "b"}
    assert 0 < float(scope["loss_value"]) < np.log(3)            # from log 3 at W = 0.1, b = 0: it trained
    assert not np.array_equal(np.asarray(params["W"]), np.full((8, 3), 0.1))


def test_the_flax_example_trains_with_train_step_then_continues_with_optax():
    jax = pytest.importorskip("jax")
    pytest.importorskip("flax")
    scope = {}
    with jax.enable_x64(False):   # as a script runs it: flax's float32 parameters, float32 data
        exec(compile(block("README.md", "## Inside `jax.jit`", 1), "README.md", "exec"), scope)
    assert scope["step"].native_update
    x, y, loss = scope["x"], scope["y"], scope["loss"]
    first = float(loss(scope["model"].init(scope["jax"].random.key(0), x)["params"], x, y))
    assert float(loss(scope["params"], x, y)) < first
    assert int(scope["opt_state"][0].count) == 11    # ten native steps and one of optax's


def test_the_train_step_speed_ups_are_the_benchmarks_page_s():
    """The README's train_step table: the four forms' ratios of docs/benchmarks.md's float32 table, row for
    row by model, copied, not measured again."""
    ours = {r.split(" | ")[0].lstrip("| "): re.findall(r"([\d.]+)×", r)
            for r in section("README.md", "## Inside `jax.jit`").splitlines() if r.startswith("| ") and "×" in r}
    page_text = section("benchmarks.md", "## Your JAX model (`experiments/bench/bench_capture_jax.py`)")
    float32 = page_text[page_text.index("### float32"):page_text.index("### float64")]
    page = {}
    for r in float32.splitlines():
        cells = [c.strip() for c in r.strip("|").split("|")]
        if r.startswith("| ") and len(cells) == 9 and "×" in r and cells[0] not in page:
            page[cells[0]] = [re.match(r"([\d.]+)×", c).group(1) for c in cells[3:7]]
    assert len(ours) >= 4 and set(ours) <= set(page), (sorted(ours), sorted(page))
    for model, mine in ours.items():
        assert mine == page[model], (model, mine, page[model])


def test_the_benchmark_rows_are_the_peers_experiments():
    """The README's table is a few rows of docs/experiments.md's peers table, copied, not measured again."""
    rows = [l for l in section("README.md", "## One benchmark").splitlines() if l.startswith("| ")]
    peers = section("experiments.md", "## Peers (`python experiments/bench/bench_peers.py`)").splitlines()
    assert len(rows) >= 4 and all(r in peers for r in rows), [r for r in rows if r not in peers]
