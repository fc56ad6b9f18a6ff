"""The oracle's docs page (docs/oracle.md): its primitive table is the rules', its example runs and says what it shows."""
import re

import pytest

oracle = pytest.importorskip("interop.oracle")

from docs_pages import block, generated, masked, text

SECTION = text("oracle.md")


def test_primitive_table_is_generated_from_the_rules():
    assert generated("oracle.md", "oracle") == oracle.primitive_table(), "run: python tools/readme_ops.py"


def test_the_oracle_example_runs_and_prints_what_the_page_shows():
    scope = {}
    exec(compile(block("oracle.md"), "docs/oracle.md", "exec"), scope)
    shown = re.findall(r"```\n(check_grads:.*?)```", SECTION, re.S)
    assert masked(scope["report"]) == masked(shown[0])
    assert masked(str(scope["kinked"]) + "\n" + str(scope["mixed"])) == masked(shown[1])
    assert scope["report"].verdict == "agree" and scope["kinked"].verdict == "kink"
    assert scope["mixed"].precision.dtype == "float32" and scope["report"].aux["logits"].shape == (5, 3)


def test_the_corpus_size_the_page_states():
    import test_oracle_corpus as corpus
    assert f"runs {len(corpus.CORPUS)} real functions" in SECTION
