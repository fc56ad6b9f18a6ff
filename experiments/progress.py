"""What every experiment shares: a progress bar, the machine it ran on, and its results written out."""
import argparse
import os
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def bar(done, total, note="", width=30):
    """One-line progress bar on stderr, redrawn in place; a newline once ``done == total``."""
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\r  [{'#' * fill}{' ' * (width - fill)}] {done}/{total} {note}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cpu_model():
    """The CPU's model name (Linux), for every table's header."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def save(out_dir, name, text, plot=None):
    """Write ``name``.md (the Markdown table) and, with ``plot(path)``, ``name``.png into ``out_dir``;
    print the table."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(text)
    if plot is not None:
        plot(os.path.join(out_dir, name + ".png"))
    print("\n" + text)


def parser(doc):
    """The arguments every experiment takes: ``--quick`` (seconds; the test suite's mode) and ``--out``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small, fast run (what the test suite runs)")
    ap.add_argument("--out", default=OUT, help="where tables and plots go (default experiments/out)")
    return ap
