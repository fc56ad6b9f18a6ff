"""Durable files: directory fsync, temporaries' names, and cleanup of those whose writing process died."""
import hashlib
import os
import shutil

# what a temporary's name adds to its stem: ".tmp-", a pid (at most 7 digits on Linux), "-", mkstemp's 8 characters
_TMP_TAIL = len(".tmp-") + 7 + 1 + 8


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


def temporary_stem(folder, base):
    """``.<base>``: the stem of the temporaries written beside ``folder/base`` (``<stem>.tmp-<pid>-XXXXXXXX``),
    one a file name can hold: where ``base`` is too long for that (a legal name of 252 bytes), its head and
    a hash of all of it, so each target still has its own stem."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    stem = "." + base
    if len(os.fsencode(stem)) + _TMP_TAIL <= limit:
        return stem
    digest = "~" + hashlib.sha256(os.fsencode(base)).hexdigest()[:16]
    keep = os.fsencode(stem)[:max(0, limit - _TMP_TAIL - len(digest))]
    return keep.decode(errors="ignore") + digest


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
