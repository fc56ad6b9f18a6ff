"""The repository documents itself: every repository file its docs, docstrings and comments name exists."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIRS = ("tapegrad", "interop", "tests", "experiments", "docs")
# a path-like token: dir/…/name.ext, not part of a URL or a longer path
TOKEN = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:md|py|c|h|cu|toml|txt|json))(?![\w/])")


def sources():
    files = [ROOT / n for n in ("README.md", "pyproject.toml", "Makefile")]
    for d in DIRS:
        files += [p for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".md", ".c", ".h", ".toml")
                  and "golden" not in p.parts and "out" not in p.relative_to(ROOT).parts[:2]]
    return [p for p in files if p != pathlib.Path(__file__).resolve()]   # this file's examples are deliberate


def named_paths(text):
    """The tokens of ``text`` that must be repository files: dir/… under a repository folder, any other
    dir/….md, and capitalised documents (README.md, LICENSE.md). Lower-case bare names (``report.md``) and
    ``experiments/out/`` are what experiments write, not files the repository holds."""
    out = set()
    for t in TOKEN.findall(text):
        if t.startswith("experiments/out/"):
            continue
        if "/" in t and (t.endswith(".md") or t.split("/")[0] in DIRS) or "/" not in t and t[0].isupper() \
                and t.endswith(".md"):
            out.add(t)
    return out


def test_the_scanner_sees_paths():
    notes, plan = "notes/" + "facts.md", "PLAN" + ".md"    # names built here, so no scan of this file sees them
    text = (f"see {notes} §5, {plan} and tapegrad/native/build.py; not https://x.org/docs/" + "ffi.md, "
            "report.md or experiments/out/table.md")
    assert named_paths(text) == {notes, plan, "tapegrad/native/build.py"}


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_repository_file_exists(path):
    missing = [t for t in sorted(named_paths(path.read_text(encoding="utf-8")))
               if not (ROOT / t).exists() and not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(ROOT)} names files that are not in the repository: {missing}"


def test_readme_states_requirements_and_every_environment_variable():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for fact in ("Linux", "x86-64", "C compiler", "Python ≥ 3.10"):
        assert fact in readme, fact
    table = readme.split("| variable | effect |", 1)[1].split("\n\n", 1)[0]
    used = set()
    for path in sources():
        if path.suffix == ".py" and path.parts[len(ROOT.parts)] in ("tapegrad", "interop"):
            text = path.read_text(encoding="utf-8")
            used |= set(re.findall(r"environ(?:\.get)?\(\s*[\"']([A-Z_]+)[\"']", text))
            used |= set(re.findall(r"environ\[[\"']([A-Z_]+)[\"']\]", text))
            used |= set(re.findall(r"[\"'](TAPEGRAD_[A-Z0-9_]+)[\"']", text))   # names kept in constants
    assert {"TAPEGRAD_CACHE", "TAPEGRAD_BLAS", "CC"} <= used
    undocumented = sorted(v for v in used if f"| `{v}` |" not in table)
    assert not undocumented, f"environment variables the package reads but the README's table lacks: {undocumented}"
