"""Rewrite the op table of docs/ops.md from the registry and the oracle's primitive table of docs/oracle.md
from its rules (tests/test_docs.py and tests/test_oracle_readme.py check they agree)."""
import pathlib
import re

import tapegrad.ops as O

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def block(name, body):
    return f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"


def rewrite(page, name, body):
    """Replace the generated block ``name`` of docs/``page`` with ``body``."""
    path = DOCS / page
    text, n = re.subn(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", lambda m: block(name, body),
                      path.read_text(), flags=re.S)
    if n != 1:
        raise SystemExit(f"docs/{page}: expected one <!-- {name}:begin --> … <!-- {name}:end --> block, found {n}")
    path.write_text(text)


def main():
    rewrite("ops.md", "ops", O.markdown_table())
    try:
        from interop.oracle import primitive_table
    except ImportError:   # no jax here: leave the oracle's table as it is
        return
    rewrite("oracle.md", "oracle", primitive_table())


if __name__ == "__main__":
    main()
