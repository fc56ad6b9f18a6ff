"""The documentation as tests read it: README.md and the pages under docs/, their code blocks."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def text(name):
    """The text of README.md (``name`` "README.md") or of the docs page ``name`` ("oracle.md")."""
    return ((ROOT if name == "README.md" else DOCS) / name).read_text(encoding="utf-8")


def section(name, heading):
    """The part of page ``name`` from the heading line ``heading`` (e.g. "## Ordered mode") to the next
    heading of the same or a higher level."""
    page = text(name)
    start = page.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    rest = re.search(rf"^#{{1,{len(level)}}} ", page[start + len(heading):], re.M)
    return page[start:start + len(heading) + rest.start()] if rest else page[start:]


def python_blocks(page_text):
    """The ```python blocks of a page's text, in order."""
    return re.findall(r"^```python\n(.*?)^```", page_text, re.S | re.M)


def block(name, heading=None, index=0):
    """The ``index``-th python block of page ``name`` (of its section ``heading`` when given)."""
    return python_blocks(section(name, heading) if heading else text(name))[index]


def generated(name, marker):
    """The body between ``<!-- marker:begin -->`` and ``<!-- marker:end -->`` on page ``name``."""
    return re.search(rf"<!-- {marker}:begin -->\n(.*?)\n<!-- {marker}:end -->", text(name), re.S).group(1)


def masked(report):
    """A printed report with its numbers masked, to compare with what a page shows: the last bits of a
    rounding (XLA's float32 above all) differ between CPUs."""
    return re.sub(r"[-+]?\d[\d.e+-]*", "#", str(report).strip())


# A python block may be preceded by one marker line, an HTML comment (invisible on the site):
#   <!-- docs-test: needs gpu -->                   runs only where that is available (NEEDS below), else skips
#   <!-- docs-test: tests/<file>.py::<test> -->     run, with assertions on its results, by that test instead
MARKER = re.compile(r"<!-- docs-test: (.+?) -->")


def fenced_blocks(page_text):
    """(language, code, marker or None) of every fenced block of a page's text, in order."""
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", page_text, re.S | re.M):
        before = page_text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(before.strip())
        out.append((m.group(1), m.group(2), marker.group(1) if marker else None))
    return out


def pages():
    """README.md and every page under docs/, as names ``text`` takes."""
    return ["README.md"] + sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
