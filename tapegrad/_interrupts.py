"""Signals held back across a step that must happen completely or not at all."""
import _signal   # signal's own functions without its enum wrapping: 60 handler reads cost 3 us, not 48
import signal
import threading

# every signal a handler can be installed for (SIGKILL and SIGSTOP cannot be caught), as plain ints
_CATCHABLE = tuple(int(s) for s in signal.valid_signals() if s not in (getattr(signal, "SIGKILL", None),
                                                                        getattr(signal, "SIGSTOP", None)))


def signals_held(fn, *args):
    """``fn(*args)`` with every Python-level signal handler's signal noted instead of handled meanwhile, then
    delivered in the order they came: Ctrl-C's ``KeyboardInterrupt``, or whatever another handler raises
    (a timeout's alarm, a notebook's), arrives after ``fn`` has finished, never part-way through it.

    Only the main thread runs Python's signal handlers; elsewhere ``fn`` runs as it is (a handler's
    exception then rises in the main thread, not in ``fn``). Signals whose handler was not installed from
    Python (default or ignored) are left alone: their effect is the operating system's. One frame installs
    and restores the handlers inside one ``try`` (a context manager would leave a gap between installing
    and its ``__exit__``); left installed anyway, by a restore that was itself cut short, a holding handler
    hands its next signal to the old one and reinstalls it. When several held handlers raise, each runs
    and the first exception propagates.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    olds = {}
    for sig in _CATCHABLE:
        h = _signal.getsignal(sig)
        if callable(h):
            olds[sig] = h
    if not olds:
        return fn(*args)
    active, noted = [True], []

    def hold(signum, frame):
        if active:
            noted.append(signum)
        else:
            _signal.signal(signum, olds[signum])
            signal.raise_signal(signum)
    try:
        for sig in olds:
            _signal.signal(sig, hold)
        return fn(*args)
    finally:
        active.clear()   # from here a signal reaches its old handler, even if the next lines are cut short
        for sig, h in olds.items():
            _signal.signal(sig, h)
        first = None
        for sig in dict.fromkeys(noted):
            try:
                signal.raise_signal(sig)   # delivered now: KeyboardInterrupt for Ctrl-C, by default
            except BaseException as e:   # noqa: BLE001 - every held handler runs; the first exception rises
                first = first or e
        if first is not None:
            raise first

