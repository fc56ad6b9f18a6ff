"""Atomic checkpoints of tape parameters and optimizer state (npz + JSON, never pickle)."""
import json
import os
import tempfile

import numpy as np

from .errors import TapeError

FORMAT = "tapegrad-checkpoint-1"


def _params(tape):
    return [i for i, n in enumerate(tape._nodes) if n.op.name == "param"]


def save(path, tape, opt=None):
    """Write every parameter of ``tape`` and ``opt``'s state to ``path`` atomically.

    The file appears complete or not at all (a temporary file in the same folder, fsync, rename).

    >>> import numpy as np, tapegrad as tg, tempfile, os
    >>> tape = tg.Tape(); w = tape.param(np.arange(3.0))
    >>> path = os.path.join(tempfile.mkdtemp(), "ck.npz")
    >>> tg.save(path, tape)
    >>> tape2 = tg.Tape(); w2 = tape2.param(np.zeros(3)); tg.load(path, tape2); tape2.value(w2)
    array([0., 1., 2.])
    """
    ids = _params(tape)
    arrays = {f"param_{k}": tape._val[i] for k, i in enumerate(ids)}
    meta = {"format": FORMAT, "dtype": tape.dtype.name, "params": [list(tape._nodes[i].shape) for i in ids]}
    if opt is not None:
        state = opt.state_dict()
        meta["optimizer"] = {**opt.config(), "count": state["count"], "param_nodes": [v.id for v in opt.params]}
        for key in ("mu", "nu"):
            for k, a in enumerate(state.get(key, [])):
                arrays[f"{key}_{k}"] = a
    arrays["meta"] = np.array(json.dumps(meta))
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load(path, tape, opt=None):
    """Restore a ``save``d checkpoint into ``tape`` (and ``opt``); checks everything before writing.

    A checkpoint that does not fit the tape (count, shapes or dtype of parameters, optimizer kind)
    raises ``TapeError`` naming the mismatch; the tape and optimizer are then left untouched.
    """
    with np.load(path, allow_pickle=False) as f:
        data = {k: f[k] for k in f.files}
    meta = json.loads(str(data["meta"]))
    if meta.get("format") != FORMAT:
        raise TapeError(f"load: {path} is not a {FORMAT} file (format {meta.get('format')!r})")
    ids = _params(tape)
    if len(ids) != len(meta["params"]):
        raise TapeError(f"load: the checkpoint holds {len(meta['params'])} parameters, the tape has {len(ids)}")
    for k, (i, shape) in enumerate(zip(ids, meta["params"])):
        if tuple(shape) != tape._nodes[i].shape:
            raise TapeError(f"load: parameter {k} (node {i}) has shape {tape._nodes[i].shape}, the checkpoint {tuple(shape)}")
    if meta["dtype"] != tape.dtype.name:
        raise TapeError(f"load: the checkpoint is {meta['dtype']}, the tape {tape.dtype.name}")
    if opt is not None:
        saved = meta.get("optimizer")
        if saved is None or saved["kind"] != opt.kind:
            raise TapeError(f"load: expected {opt.kind} state in the checkpoint, got "
                            f"{None if saved is None else saved['kind']}")
        if saved["param_nodes"] != [v.id for v in opt.params]:
            raise TapeError(f"load: the optimizer's parameters are nodes {[v.id for v in opt.params]}, the "
                            f"checkpoint's {saved['param_nodes']}")
        state = {"count": saved["count"]}
        for key in ("mu", "nu")[:opt.moments]:
            state[key] = [data[f"{key}_{k}"] for k in range(len(opt.params)) if f"{key}_{k}" in data]
        opt.load_state_dict(state)  # validates everything before it writes anything
    for k, i in enumerate(ids):
        np.copyto(tape._val[i], data[f"param_{k}"])
