"""Rewrite the README's op table from the registry and the oracle's primitive table from its rules
(tests/test_readme.py and tests/test_oracle_readme.py check they agree)."""
import pathlib
import re

import tapegrad.ops as O

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def block(name, body):
    return f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"


def main():
    text = README.read_text()
    text = re.sub(r"<!-- ops:begin -->.*?<!-- ops:end -->", lambda m: block("ops", O.markdown_table()), text,
                  flags=re.S)
    try:
        from interop.oracle_rules import primitive_table
    except ImportError:   # no jax here: leave the oracle's table as it is
        primitive_table = None
    if primitive_table is not None:
        text = re.sub(r"<!-- oracle:begin -->.*?<!-- oracle:end -->", lambda m: block("oracle", primitive_table()),
                      text, flags=re.S)
    README.write_text(text)


if __name__ == "__main__":
    main()
