"""Every checkpoint mismatch has its own message and changes nothing; files never unpickle; temp files stay local."""
import json
import os
import re

import numpy as np
import pytest

import tapegrad as tg


def full_path(message):
    return "^" + re.escape(message) + "$"


def saved(tmp_path, opt_factory=lambda: tg.Adam(0.1), dtype=np.float64, shapes=((3, 2), (2,))):
    tape = tg.Tape(dtype)
    ps = [tape.param(np.arange(float(np.prod(s))).reshape(s)) for s in shapes]
    opt = opt_factory() if opt_factory else None
    if opt is not None:
        for p in ps:
            opt.add(tape, p)
    path = str(tmp_path / "ck.npz")
    tg.save(path, tape, opt)
    return path


def fresh(dtype=np.float64, shapes=((3, 2), (2,)), opt=None, register=None):
    tape = tg.Tape(dtype)
    ps = [tape.param(np.full(s, 7.0)) for s in shapes]
    if opt is not None:
        for k in (range(len(ps)) if register is None else register):
            opt.add(tape, ps[k])
    return tape, ps


def unchanged(tape, ps):
    return all(np.array_equal(tape.value(p), np.full(p.shape, 7.0)) for p in ps)


def test_a_file_of_another_format_is_named(tmp_path):
    path = str(tmp_path / "other.npz")
    np.savez(path, meta=np.array(json.dumps({"format": "not-ours-2"})))
    tape, ps = fresh()
    with pytest.raises(tg.CheckpointError, match=rf"load: {path} is not a valid tapegrad checkpoint: an unreadable npz "
                                                 rf"\(ValueError: format 'not-ours-2'\)$"):
        tg.load(path, tape)
    assert unchanged(tape, ps)


def test_a_parameter_count_mismatch_is_named(tmp_path):
    path = saved(tmp_path)
    tape, ps = fresh(shapes=((3, 2),))
    with pytest.raises(tg.TapeError, match=r"^load: the checkpoint holds 2 parameters, the tape has 1$"):
        tg.load(path, tape)
    assert unchanged(tape, ps)


def test_a_dtype_mismatch_is_named(tmp_path):
    path = saved(tmp_path)
    tape, ps = fresh(np.float32)
    with pytest.raises(tg.TapeError, match=r"^load: the checkpoint is float64, the tape float32$"):
        tg.load(path, tape)
    assert unchanged(tape, ps)


def test_missing_optimizer_state_is_named(tmp_path):
    path = saved(tmp_path, opt_factory=None)
    opt = tg.Adam(0.1)
    tape, ps = fresh(opt=opt)
    with pytest.raises(tg.TapeError, match=r"^load: expected Adam state in the checkpoint, got None$"):
        tg.load(path, tape, opt)
    assert unchanged(tape, ps) and opt.count == 0


def test_an_optimizer_over_other_parameters_is_named(tmp_path):
    path = saved(tmp_path)
    opt = tg.Adam(0.1)
    tape, ps = fresh(opt=opt, register=[1])
    with pytest.raises(tg.TapeError, match=r"^load: the optimizer's parameters are nodes \[1\], the checkpoint's "
                                           r"\[0, 1\]$"):
        tg.load(path, tape, opt)
    assert unchanged(tape, ps) and opt.count == 0


def test_a_checkpoint_holding_pickled_objects_is_refused(tmp_path):
    path = str(tmp_path / "evil.npz")
    meta = {"format": "tapegrad-checkpoint-1", "dtype": "float64", "params": [[2]]}
    np.savez(path, meta=np.array(json.dumps(meta)), param_0=np.array([object(), object()], dtype=object))
    tape, ps = fresh(shapes=((2,),))
    with pytest.raises(ValueError, match="allow_pickle=False"):
        tg.load(path, tape)
    assert unchanged(tape, ps)


def test_the_temporary_file_is_written_next_to_the_checkpoint(tmp_path, monkeypatch):
    """os.replace is atomic only within one file system: the temporary file must share the target's folder."""
    moves = []
    real = os.replace

    def spy(src, dst):
        moves.append((src, dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    path = saved(tmp_path)
    [(src, dst)] = moves
    assert dst == path and os.path.dirname(src) == str(tmp_path)
