"""What the experiments' plots share: measurements kept as JSON so ``--plot-only`` can redraw them, and axes
labelled in readable units."""
import json
import os


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def add_plot_only(ap):
    """Give an experiment's argument parser ``--plot-only``: redraw the plot from the saved measurements."""
    ap.add_argument("--plot-only", action="store_true",
                    help="measure nothing: redraw the plot from the measurements a run saved as JSON in --out")


def dump(out_dir, name, data):
    """Write the measurements ``data`` (JSON-able) as ``name``.json into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(data, f, indent=1)


def script(name):
    """The experiment ``name`` as it is run from the repository root: ``experiments/<group>/<name>.py``."""
    here = os.path.dirname(os.path.abspath(__file__))
    groups = [g for g in sorted(os.listdir(here)) if os.path.isfile(os.path.join(here, g, name + ".py"))]
    return "/".join(["experiments", *groups[:1], name + ".py"])


def load(out_dir, name):
    """The measurements a run saved as ``name``.json in ``out_dir``; a clear error when there are none."""
    path = os.path.join(out_dir, name + ".json")
    if not os.path.exists(path):
        raise SystemExit(f"--plot-only: no saved measurements at {path}; run `python {script(name)}` "
                         f"(with the same --out) once first")
    with open(path) as f:
        return json.load(f)


def duration(us, _pos=None):
    """A time given in µs as a short label in the unit that suits it: ``18 µs``, ``1.3 ms``, ``0.41 s``."""
    if us < 1e3:
        return f"{us:.3g} µs"
    if us < 1e6:
        return f"{us / 1e3:.3g} ms"
    return f"{us / 1e6:.3g} s"
