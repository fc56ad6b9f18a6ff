"""The README's oracle section: its primitive table is the rules', its example runs and says what it shows."""
import pathlib
import re

import pytest

oracle_rules = pytest.importorskip("interop.oracle_rules")

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README[README.index("## The gradient oracle"):README.index("## What the tape promises")]


def test_primitive_table_is_generated_from_the_rules():
    table = re.search(r"<!-- oracle:begin -->\n(.*?)\n<!-- oracle:end -->", README, re.S).group(1)
    assert table == oracle_rules.primitive_table(), "run: python experiments/readme_ops.py"


def _words(text):
    """The report's text with its numbers masked: XLA's float32 rounding differs between CPUs."""
    return re.sub(r"[-+]?\d[\d.e+-]*", "#", str(text).strip())


def test_the_oracle_example_runs_and_prints_what_the_readme_shows():
    code = re.search(r"```python\n(.*?)```", SECTION, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    shown = re.findall(r"```\n(check_grads:.*?)```", SECTION, re.S)
    assert _words(scope["report"]) == _words(shown[0])
    assert _words(str(scope["kinked"]) + "\n" + str(scope["mixed"])) == _words(shown[1])
    assert scope["report"].verdict == "agree" and scope["kinked"].verdict == "kink"
    assert scope["mixed"].precision.dtype == "float32" and scope["report"].aux["logits"].shape == (5, 3)


def test_the_corpus_size_the_readme_states():
    import test_oracle_corpus as corpus
    assert f"runs {len(corpus.CORPUS)} real functions" in SECTION
