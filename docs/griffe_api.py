"""griffe extensions for the API pages (mkdocs.yml loads this file).

``RuntimeFunctions``: most of ``tapegrad``'s elementwise functions and reductions are built by small
factories from the op registry (``relu, sigmoid, ... = (_unary(...) ...)``) and take the entry's
description as their docstring, and the ``Var`` methods are installed when the package is imported. Read
statically they are attributes with no docstring; this imports ``tapegrad`` and describes each one as the
function it is at run time: its signature and its docstring.

``DoctestFences``: the docstrings keep their examples as bare ``>>>`` lines (pytest runs them as doctests);
Markdown would read ``>>>`` as nested quotes, so each run of prompt and output lines outside a Google-style
``Examples:`` section is fenced as ``pycon``. The section itself is left as it is: the parser fences it.

mkdocs.yml loads this file by path; ``exclude_docs`` keeps it out of the built site.
"""
import importlib
import inspect
import re
from typing import Callable

import griffe

_SECTION = re.compile(r"^[ \t]*Examples:[ \t]*$", re.M)   # a Google-style section: griffe fences its examples
# a run of lines starting with a ">>> " prompt, with the continuation and output lines after it
_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)>>> .*(?:\n(?!(?P=indent)[ \t]*$)(?P=indent)\S.*)*", re.M)


def fence(text: str) -> str:
    """``text`` with each doctest example fenced, at its own indentation."""
    def one(m: "re.Match[str]") -> str:
        pad = m.group("indent")
        return f"{pad}```pycon\n{m.group(0)}\n{pad}```"
    return _EXAMPLE.sub(one, text)


def fence_prose(text: str) -> str:
    """``text`` with the examples before its ``Examples:`` section (if any) fenced, the section left as it is."""
    m = _SECTION.search(text)
    return fence(text) if m is None else fence(text[:m.start()]) + text[m.start():]


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None and ">>> " in obj.docstring.value:
            obj.docstring.value = fence_prose(obj.docstring.value)


KINDS = {p.kind: griffe.ParameterKind[p.kind.name.lower()] for p in
         inspect.signature(lambda a, /, b, *c, d, **e: None).parameters.values()}


def as_function(name: str, f: Callable[..., object], like: griffe.Object, method: bool = False) -> griffe.Function:
    """``f`` as griffe's Function ``name``, its docstring parsed as ``like``'s are (a method of the tape's
    C core has no signature to read: its parameters stay unnamed)."""
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):
        signature = inspect.Signature()
    params = []
    for p in signature.parameters.values():
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        params.append(griffe.Parameter(p.name, kind=KINDS[p.kind], default=default, annotation=_named(p.annotation)))
    returns = _named(signature.return_annotation) or ("Var" if name != "split" else None)
    fn = griffe.Function(name, parameters=griffe.Parameters(*params), returns=returns)
    fn.docstring = _docstring(f, fn, like, method)
    return fn


def _named(annotation: object) -> "str | None":
    """An annotation as written (``from __future__ import annotations`` keeps them as strings), or None."""
    if annotation is inspect.Parameter.empty:
        return None
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))


def _docstring(f: Callable[..., object], owner: griffe.Function, like: griffe.Object,
               method: bool = False) -> griffe.Docstring:
    """``f``'s run-time docstring for ``owner``, parsed as ``like``'s is. For a ``method`` (``Var.sum`` is
    ``tg.sum``), the ``Args:`` entries of parameters the method lacks (``a``: the Var itself) are dropped."""
    doc = like.docstring
    parser, options = (doc.parser, dict(doc.parser_options)) if doc else (None, {})
    out = griffe.Docstring(fence_prose(inspect.cleandoc(f.__doc__ or "")), parent=owner, parser=parser,
                           parser_options=options)
    if method and parser is not None:
        have = {p.name for p in owner.parameters}
        sections = out.parse(parser, **{**options, "warn_unknown_params": False, "warn_missing_types": False})
        for section in sections:
            if section.kind is griffe.DocstringSectionKind.parameters:
                section.value = [p for p in section.value if p.name.lstrip("*") in have]
        out.parsed = [s for s in sections if s.kind is not griffe.DocstringSectionKind.parameters or s.value]
    return out


def _fill(obj: griffe.Object, runtime: object, names: list, like: griffe.Object) -> None:
    for name in names:
        f = inspect.getattr_static(runtime, name, None)
        if isinstance(f, type) or not callable(f) or not f.__doc__:
            continue
        member = obj.members.get(name)
        target = member
        while isinstance(target, griffe.Alias):
            try:
                target = target.target
            except griffe.AliasResolutionError:
                target = None
                break
        if target is None or isinstance(target, griffe.Attribute):
            obj.set_member(name, as_function(name, f, like, isinstance(obj, griffe.Class)))
        elif isinstance(target, griffe.Function) and target.docstring is None:   # a typed declaration
            target.docstring = _docstring(f, target, like, isinstance(obj, griffe.Class))


class RuntimeFunctions(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.name != "tapegrad":
            return
        tg = importlib.import_module("tapegrad")
        public = list(getattr(tg, "__all__", [])) + ["sum", "max", "min", "abs"]
        _fill(pkg, tg, public, pkg)
        var = pkg.members["Var"]
        var = var.target if isinstance(var, griffe.Alias) else var
        _fill(var, tg.Var, [n for n in vars(tg.Var) if not n.startswith("_")], pkg)
