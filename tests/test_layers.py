"""The house has layers: no import cycle among the modules of ``tapegrad`` and ``interop``, and no
import reaching up from one of docs/design.md's layers to a higher one.

The graph is read statically (``ast`` over the source files, nothing imported). An import executed when
its module loads (at the top, or inside a top-level ``if``/``try``/``with``/``class``) is a
module-level edge; one inside a function body runs only when it is called, a function-level edge, kept
apart. A cycle of module-level edges is what must not exist: it makes the order in which modules load
decide whether a name is defined yet. ``from . import x`` is an edge to the submodule ``x``;
``from .m import name`` one to ``m`` (and to ``m.name`` where that is a submodule). Imports under
``if TYPE_CHECKING:`` never run and are not edges.
"""
import ast
import os
import pathlib
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tapegrad", "interop")


def modules(root, packages):
    """{module name: source path} for every .py file of ``packages`` under ``root``."""
    found = {}
    for pkg in packages:
        for folder, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            rel = os.path.relpath(folder, root).split(os.sep)
            for f in sorted(files):
                if f.endswith(".py"):
                    name = rel if f == "__init__.py" else rel + [f[:-3]]
                    found[".".join(name)] = os.path.join(folder, f)
    return found


def _imports(tree):
    """(node, module_level) for every Import/ImportFrom in ``tree``."""
    out = []

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, top))
            elif isinstance(child, ast.If) and _type_checking(child.test):
                for grand in child.orelse:
                    visit(ast.Module(body=[grand], type_ignores=[]), top)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            else:
                visit(child, top)
    visit(tree, True)
    return out


def _type_checking(test):
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph(root=ROOT, packages=PACKAGES):
    """({module: set of modules it imports at module level}, the same for function-level imports), over
    the modules of ``packages`` only (imports of anything else are not edges)."""
    mods = modules(root, packages)
    top, inner = {m: set() for m in mods}, {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node, module_level in _imports(tree):
            edges = top[name] if module_level else inner[name]
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module
                subs = [f"{stem}.{a.name}" for a in node.names if f"{stem}.{a.name}" in mods]
                # the module itself is an edge unless every name imported is one of its submodules
                targets = subs + ([stem] if len(subs) < len(node.names) else [])
            edges.update(t for t in targets if t in mods and t != name)
    return top, inner


def cycles(edges):
    """The strongly connected components of more than one module, each as one cycle through it (a list
    of modules, the first repeated at the end), found without recursion."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(_cycle_in(sorted(comp), edges))
    return comps


def _cycle_in(comp, edges):
    """One cycle through the first module of a strongly connected component (breadth-first: a shortest)."""
    members, first = set(comp), comp[0]
    back = {first: None}
    queue = [first]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & members):
            if w == first:
                path = [v]
                while back[path[-1]] is not None:
                    path.append(back[path[-1]])
                return path[::-1] + [first]
            if w not in back:
                back[w] = v
                queue.append(w)
    raise AssertionError(f"{comp} is not strongly connected")


def describe(found):
    return "; ".join(" -> ".join(c) for c in found)


TOP, INNER = graph()


def test_tapegrad_has_no_import_cycle_module_or_function_level():
    both = {m: TOP[m] | INNER[m] for m in TOP}
    found = [c for c in cycles(both) if all(m.startswith("tapegrad") for m in c)]
    assert not found, f"import cycles in tapegrad: {describe(found)}"


def test_interop_has_no_import_cycle_module_or_function_level():
    both = {m: TOP[m] | INNER[m] for m in TOP}
    found = [c for c in cycles(both) if any(m.startswith("interop") for m in c)]
    assert not found, f"import cycles through interop: {describe(found)}"


def test_the_oracle_s_table_sits_below_its_rules_and_the_capture_above_the_oracle_and_xla():
    """As tapegrad/ops/registry.py below the op families: the table imports nothing of interop, the
    families register into it, the replay reads it; the capture stands on the oracle and calls through xla."""
    assert not {t for t in TOP["interop.oracle.table"] | INNER["interop.oracle.table"] if t.startswith("interop")}
    for family in ("rules", "loops", "trust"):
        assert "interop.oracle.table" in TOP[f"interop.oracle.{family}"]
    assert "interop.oracle.table" in TOP["interop.oracle.replay"]
    assert {"interop.oracle.replay", "interop.xla.program"} <= set().union(*(TOP[m] for m in TOP
                                                                           if m.startswith("interop.capture")))
    assert not any(t.startswith(("interop.capture", "interop.oracle")) for m in TOP if m.startswith("interop.xla")
                   for t in TOP[m] | INNER[m])


# docs/design.md's layers, bottom to top: a module's layer is the first whose names or prefixes match it
LAYERS = [
    ("foundations", {"tapegrad.errors", "tapegrad._arena", "tapegrad._files", "tapegrad._interrupts",
                     "tapegrad.schedule", "tapegrad.blas", "tapegrad._version"}),
    ("the op registry", {"tapegrad.ops", "tapegrad.ops."}),
    ("the tape", {"tapegrad.tape", "tapegrad.ordered", "tapegrad.functional", "tapegrad.numpy_dispatch",
                  "tapegrad.optim", "tapegrad.checkpoint", "tapegrad.gradcheck", "tapegrad.emit"}),
    ("programs", {"tapegrad.capture", "tapegrad.replay", "tapegrad.verify"}),
    ("the package", {"tapegrad", "tapegrad.__main__", "tapegrad.environment"}),
    ("the native backend", {"tapegrad.native", "tapegrad.native."}),
    ("the GPU backend", {"tapegrad.gpu", "tapegrad.gpu."}),
    ("interop's one import of jax", {"interop._jax"}),
    ("interop: JAX calls tapegrad", {"interop.xla", "interop.xla."}),
    ("interop: the oracle", {"interop.oracle", "interop.oracle."}),
    ("interop: the capture", {"interop.capture", "interop.capture."}),
    ("interop", {"interop"}),
]


def layer_of(module):
    for k, (_, names) in enumerate(LAYERS):
        if module in names or any(n.endswith(".") and module.startswith(n) for n in names):
            return k
    return None


def reaching_up(edges):
    return [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
            for m in sorted(edges) for d in sorted(edges[m])
            if layer_of(m) is not None and layer_of(d) is not None and layer_of(d) > layer_of(m)]


def test_no_module_imports_from_a_layer_above_its_own():
    up = reaching_up(TOP)
    assert not up, "imports reaching up a layer (docs/design.md, Architecture): " + "; ".join(up)
    assert reaching_up({"tapegrad.ops.core": {"tapegrad.native.runner", "tapegrad.errors"}}) == [
        "tapegrad.ops.core (the op registry) imports tapegrad.native.runner (the native backend)"]


def test_every_module_has_a_layer():
    assert [m for m in TOP if layer_of(m) is None] == [], "place it in LAYERS and in docs/design.md"


def test_the_registries_sit_below_their_families():
    """The op registry imports no family and nothing of the native backend; the ops reach LAPACK through
    the low-level ``tapegrad.blas``."""
    assert TOP["tapegrad.ops.registry"] <= set(), TOP["tapegrad.ops.registry"]
    for m in [m for m in TOP if m.startswith("tapegrad.ops.")]:
        assert not {t for t in TOP[m] | INNER[m] if t.startswith("tapegrad.native")}, (m, TOP[m] | INNER[m])
    assert "tapegrad.blas" in TOP["tapegrad.ops.linalg"]
    assert not {t for t in TOP["tapegrad.blas"] | INNER["tapegrad.blas"] if t != "tapegrad.errors"}


def test_the_walker_finds_a_cycle_and_names_it(tmp_path):
    """A made-up package: a -> b -> c -> a at module level, d -> a only inside a function, e <-> f via
    ``from . import``; the walker reports the two cycles and not the function-level edge."""
    pkg = tmp_path / "house"
    pkg.mkdir()
    files = {"__init__.py": "",
             "a.py": "from .b import thing\n",
             "b.py": "import house.c\n",
             "c.py": "try:\n    from . import a\nexcept ImportError:\n    pass\n",
             "d.py": "from . import a\ndef f():\n    from . import d2\n",
             "d2.py": "def g():\n    from . import d\n",
             "e.py": "from . import f\n",
             "f.py": "class K:\n    from .e import x\n",
             "g.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import h\n",
             "h.py": "from . import g\n"}
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    top, inner = graph(str(tmp_path), ("house",))
    assert top["house.a"] == {"house.b"} and top["house.b"] == {"house.c"} and top["house.c"] == {"house.a"}
    assert top["house.d"] == {"house.a"} and inner["house.d"] == {"house.d2"} and inner["house.d2"] == {"house.d"}
    assert top["house.g"] == set() and top["house.h"] == {"house.g"}
    assert describe(cycles(top)) == "house.a -> house.b -> house.c -> house.a; house.e -> house.f -> house.e"
    assert cycles(inner) == [["house.d", "house.d2", "house.d"]]   # counted apart: the test reads only top


def test_the_graph_sees_the_real_imports():
    """The walker reads this tree's imports as they are (a guard against a walker that finds nothing)."""
    assert "tapegrad.ops.registry" in TOP["tapegrad.ops.core"]
    assert {"tapegrad.ops.core", "tapegrad.ops.linalg"} <= TOP["tapegrad.ops"]
    assert "tapegrad.ops" in TOP["tapegrad.tape"] and "tapegrad.ops" in TOP["interop.oracle.rules"]
    assert sum(len(v) for v in TOP.values()) > 100


def test_design_names_every_module_in_its_architecture():
    """docs/design.md's Architecture section (the layers drawn and listed) names every module of both packages."""
    root = pathlib.Path(ROOT)
    text = (root / "docs" / "design.md").read_text()
    arch = text[text.index("## Architecture"):text.index("**The op registry.** Every op")]
    missing = [str(f.relative_to(root)) for pkg in ("tapegrad", "interop") for f in sorted((root / pkg).rglob("*.py"))
               if f.name != "__init__.py" and f"`{f.name}`" not in arch]
    assert missing == [], "name them in docs/design.md's Architecture: " + ", ".join(missing)
