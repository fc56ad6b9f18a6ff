"""Ctrl-C held back across a step that must happen completely or not at all."""
import signal
import threading


def sigint_held(fn, *args):
    """``fn(*args)`` with SIGINT noted instead of raised meanwhile, then delivered (``KeyboardInterrupt``).

    Only the main thread runs Python's signal handlers; elsewhere, or when the current handler was not
    installed from Python, ``fn`` runs as it is. One frame installs and restores the handler inside one
    ``try`` (a context manager would leave a gap between installing and its ``__exit__``); left
    installed anyway, by a restore that was itself cut short, the holding handler hands the next SIGINT
    to the old one and reinstalls it.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    old = signal.getsignal(signal.SIGINT)
    if old is None:
        return fn(*args)
    active, noted = [True], []

    def hold(signum, frame):
        if active:
            noted.append(signum)
        else:
            signal.signal(signal.SIGINT, old)
            signal.raise_signal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, hold)
        return fn(*args)
    finally:
        active.clear()   # from here a SIGINT reaches the old handler, even if the next lines are cut short
        signal.signal(signal.SIGINT, old)
        if noted:
            signal.raise_signal(signal.SIGINT)   # delivered now: KeyboardInterrupt, by default
