"""Durable files: directory fsync, and cleanup of temporaries whose writing process died."""
import os
import shutil


def fsync_dir(folder):
    """Make a rename in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sweep_temporaries(folder, prefix, marker=None):
    """Remove ``<prefix><pid>-*`` files and folders in ``folder`` whose writing process no longer exists
    (with ``marker``: every ``*<marker><pid>-*`` entry, whatever comes before the marker)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if marker is not None:
            if marker not in name:
                continue
            pid = name.split(marker, 1)[1].split("-", 1)[0]
        elif name.startswith(prefix):
            pid = name[len(prefix):].split("-", 1)[0]
        else:
            continue
        if pid.isdigit() and not _alive(int(pid)):
            path = os.path.join(folder, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                os.unlink(path)
            except OSError:
                pass


def _alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
