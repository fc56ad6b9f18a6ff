"""``python -m tapegrad info``: the environment report, to paste into a bug report."""
import sys

USAGE = "usage: python -m tapegrad info    (prints the environment report for a bug report)"


def main(argv: list[str]) -> int:
    """Run the command line.

    Args:
        argv: The arguments after ``python -m tapegrad``: ``["info"]``, or ``["-h"]``/``["--help"]``.

    Returns:
        The exit status: 0, or 2 (with the usage on stderr) for anything else.
    """
    if argv != ["info"]:
        print(USAGE, file=sys.stderr)
        return 0 if argv in (["-h"], ["--help"]) else 2
    from .environment import info
    info()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
