"""What every experiment prints: a progress bar for long work and the machine it ran on."""
import sys


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
