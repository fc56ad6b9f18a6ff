"""Ctrl-C held back across a step that must happen completely or not at all."""
import contextlib
import signal
import threading


@contextlib.contextmanager
def sigint_held():
    """Run the block with SIGINT noted instead of raised, then deliver it (``KeyboardInterrupt``).

    Only the main thread runs Python's signal handlers; elsewhere, or when the current handler was not
    installed from Python, the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGINT)
    if old is None:
        yield
        return
    noted = []
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if noted:
            signal.raise_signal(signal.SIGINT)
