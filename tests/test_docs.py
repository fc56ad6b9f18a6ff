"""The repository documents itself: every repository file its docs, docstrings and comments name exists, and
the tables the docs generate are the code's."""
import pathlib
import re

import pytest

import tapegrad.ops as O
from docs_pages import fenced_blocks, generated, pages, text

ROOT = pathlib.Path(__file__).resolve().parents[1]
DIRS = ("tapegrad", "interop", "tests", "experiments", "docs")
# a path-like token: dir/…/name.ext, not part of a URL or a longer path
TOKEN = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:md|py|c|h|cu|toml|txt|json))(?![\w/])")


def sources():
    files = [ROOT / n for n in ("README.md", "pyproject.toml", "Makefile", "mkdocs.yml")]
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
    bases = [ROOT, path.parent] + [ROOT / "docs"] * (path.name == "mkdocs.yml")   # its nav is relative to docs/
    missing = [t for t in sorted(named_paths(path.read_text(encoding="utf-8")))
               if not any((base / t).exists() for base in bases)]
    assert not missing, f"{path.relative_to(ROOT)} names files that are not in the repository: {missing}"


def test_the_docs_state_requirements_and_every_environment_variable():
    python = re.search(r'^requires-python = ">=([\d.]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for fact in ("Linux", "x86-64", "C compiler", f"Python ≥ {python}", "0.10.2 to 0.12"):
        assert fact in text("install.md"), fact
    assert f"Python ≥ {python}" in text("README.md")
    page = text("getting-started.md")
    table = page.split("| variable | effect |", 1)[1].split("\n\n", 1)[0]
    used = set()
    for path in sources():
        if path.suffix == ".py" and path.parts[len(ROOT.parts)] in ("tapegrad", "interop"):
            source = path.read_text(encoding="utf-8")
            used |= set(re.findall(r"environ(?:\.get)?\(\s*[\"']([A-Z_]+)[\"']", source))
            used |= set(re.findall(r"environ\[[\"']([A-Z_]+)[\"']\]", source))
            used |= set(re.findall(r"[\"'](TAPEGRAD_[A-Z0-9_]+)[\"']", source))   # names kept in constants
    assert {"TAPEGRAD_CACHE", "TAPEGRAD_BLAS", "CC"} <= used
    undocumented = sorted(v for v in used if f"| `{v}` |" not in table)
    assert not undocumented, f"environment variables the package reads but docs/getting-started.md's table lacks: {undocumented}"


def test_the_op_table_is_generated_from_the_registry():
    assert generated("ops.md", "ops") == O.markdown_table(), "run: python tools/readme_ops.py"


def _gpu():
    """None where CuPy sees an NVIDIA device, else why not."""
    try:
        import cupy
        return None if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device"
    except Exception as e:   # no CuPy, or CuPy without a driver
        return f"needs an NVIDIA GPU with CuPy ({type(e).__name__})"


NEEDS = {"gpu": _gpu}      # what a `<!-- docs-test: needs X -->` marker may ask for


def _python_blocks():
    for name in pages():
        for i, (lang, code, marker) in enumerate(b for b in fenced_blocks(text(name)) if b[0] == "python"):
            yield pytest.param(name, code, marker, id=f"{name}:{i}")


@pytest.mark.parametrize("name, code, marker", list(_python_blocks()))
def test_every_python_block_runs_on_its_own(name, code, marker):
    """Each block of each page runs in a fresh namespace: a page's examples never lean on each other."""
    if marker is not None and marker.startswith("needs "):
        why = NEEDS[marker[len("needs "):]]()
        if why is not None:
            pytest.skip(f"{name}: {why}")
    elif marker is not None:
        path, test = marker.split("::")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {test}\(", source, re.M) and name in source, \
            f"{name}: the marker names {marker}, which does not exist or does not read {name}"
        return                                            # that test runs it and checks what it computes
    if "interop" in code or "jax" in code:
        pytest.importorskip("jax")
    exec(compile(code, name, "exec"), {"__name__": "__docs__"})


def test_the_markers_ask_for_what_the_runner_knows():
    for name in pages():
        for _, _, marker in fenced_blocks(text(name)):
            assert marker is None or "::" in marker or marker.split(" ", 1)[1] in NEEDS, (name, marker)


MAKE_TARGETS = set(re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), re.M))
EXTRAS = set(re.findall(r"^(\w+) = \[", (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
                        .split("\n[", 1)[0], re.M))


@pytest.mark.parametrize("name", pages())
def test_every_shell_command_names_what_exists(name):
    """The sh blocks are commands for a user's shell: each make target, extra and script they name exists."""
    for lang, code, _ in fenced_blocks(text(name)):
        if lang != "sh":
            continue
        for line in code.splitlines():
            cmd = line.split("#", 1)[0].split()
            if cmd[:1] == ["make"]:
                assert cmd[1] in MAKE_TARGETS, (name, line)
            elif cmd[:2] == ["pip", "install"]:
                extra = re.search(r"\[(\w+)\]", line)
                assert extra is None or extra.group(1) in EXTRAS, (name, line)
            elif cmd[:1] == ["python"] and cmd[1].endswith(".py"):
                assert (ROOT / cmd[1]).exists(), (name, line)
            else:
                assert not cmd, f"{name}: a command the test does not know how to check: {line}"


def _public_docstrings():
    """(name, docstring) of everything the API pages show: each public name of tapegrad and interop, and
    the public methods of their classes."""
    import inspect
    out = []
    for modname in ("tapegrad", "interop"):
        try:
            mod = __import__(modname)
        except ImportError:       # interop without jax
            continue
        names = list(getattr(mod, "__all__", [])) + (["sum", "max", "min", "abs"] if modname == "tapegrad" else [])
        for name in names:
            obj = getattr(mod, name)
            if inspect.ismodule(obj) and not obj.__name__.startswith(modname):
                continue                                              # interop.jax, interop.jnp
            out.append((f"{modname}.{name}", obj.__doc__ or ""))
            if inspect.isclass(obj):
                out += [(f"{modname}.{name}.{k}", getattr(v, "__doc__", None) or "") for k, v in vars(obj).items()
                        if not k.startswith("_")]
    return out


def _unbound_names(source):
    """The names ``source`` reads that it neither binds nor gets from the builtins (assignments, imports,
    defs, loop and comprehension variables bind; no scopes are told apart: enough for an example)."""
    import ast
    import builtins
    bound, read = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):                           # a def's or a lambda's parameter
            bound.add(node.arg)
    return sorted(read - bound - set(dir(builtins)))


def test_the_unbound_name_finder_sees_a_missing_import():
    assert _unbound_names("from interop import jnp\nf = lambda x: jax.nn.relu(jnp.sum(x))") == ["jax"]
    assert _unbound_names("import numpy as np\nfor k in range(3):\n    y = [np.ones(k) for _ in 'ab']") == []


def test_every_docstring_example_imports_what_it_uses():
    """A docstring's examples run as doctests in the module's namespace, where a name it never imports may
    still be defined; on the API page a reader has only the example."""
    import doctest
    parser, bad = doctest.DocTestParser(), {}
    for name, doc in _public_docstrings():
        source = "".join(e.source for e in parser.get_examples(doc))
        if source and _unbound_names(source):
            bad[name] = _unbound_names(source)
    assert not bad, f"docstring examples that use names they do not define: {bad}"


def test_the_api_pages_show_doctest_lines_as_code():
    pytest.importorskip("griffe")
    import importlib.util
    spec = importlib.util.spec_from_file_location("griffe_api", ROOT / "docs" / "griffe_api.py")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    doc = "Sum.\n\n>>> x = 1\n>>> x + 1\n2\n\nMore text.\n    >>> y = 2\n"
    assert ext.fence(doc) == ("Sum.\n\n```pycon\n>>> x = 1\n>>> x + 1\n2\n```\n\nMore text.\n"
                              "    ```pycon\n    >>> y = 2\n    ```\n")
    section = "Examples:\n    >>> z = 3\n"          # a Google-style section: griffe's parser fences it
    assert ext.fence_prose(doc + section) == ext.fence(doc) + section


def test_every_page_is_in_the_site_navigation():
    """mkdocs.yml's nav lists every page under docs/ (make docs fails on one left out, make test says so first)."""
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == set(pages()) - {"README.md"}, (sorted(set(pages()) - nav - {"README.md"}), sorted(nav - set(pages())))


def test_no_page_has_a_stray_reference_link():
    """Outside code, ``a[i][j]`` reads as a Markdown reference link to a label ``j`` (make docs fails on it)."""
    for name in pages():
        prose = re.sub(r"^```.*?^```", "", text(name), flags=re.S | re.M)
        prose = re.sub(r"(`+).*?\1", "", prose, flags=re.S)
        labels = set(re.findall(r"^\[([^\]]+)\]:", prose, re.M))
        stray = [m for m in re.findall(r"\]\[([^\]]+)\]", prose) if m not in labels]
        assert not stray, f"{name}: put these in backticks: {stray}"


SUBMODULES = {"emit", "ops", "environment"}   # exported modules: the pages show their public functions instead


def test_the_api_reference_shows_everything_public():
    """What the API pages render: every name in tapegrad's and interop's ``__all__`` (and tg.sum, max, min,
    abs) with a docstring, read as mkdocstrings reads them (griffe and this repository's extension; the
    docs extra installs griffe, and make docs runs this test). A name that is also a submodule's
    (``tapegrad.capture``) is rendered by a directive of its own on the page."""
    griffe = pytest.importorskip("griffe")
    extensions = griffe.load_extensions(str(ROOT / "docs" / "griffe_api.py"))
    missing = []
    for modname, extra in (("tapegrad", ["sum", "max", "min", "abs"]), ("interop", [])):
        page = text(f"api/{modname}.md")
        pkg = griffe.load(modname, search_paths=[str(ROOT)], extensions=extensions, docstring_parser="google")
        for name in list(pkg.exports or []) + extra:
            obj = pkg[name]
            try:
                obj = obj.final_target if isinstance(obj, griffe.Alias) else obj
            except griffe.AliasResolutionError:     # interop.jax, interop.jnp: jax's own modules
                continue
            if isinstance(obj, griffe.Module):
                if name in SUBMODULES:
                    continue
                if f"::: {modname}.{name}.{name}\n" not in page:
                    missing.append(f"{modname}.{name} (read as its module: give the page a ::: directive)")
            elif not (obj.docstring and obj.docstring.value.strip()):
                missing.append(f"{modname}.{name}")
    assert not missing, f"public names the API pages would not show: {missing}"
