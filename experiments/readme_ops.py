"""Rewrite the README's op table from the registry (tests/test_readme.py checks they agree)."""
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
    README.write_text(text)


if __name__ == "__main__":
    main()
