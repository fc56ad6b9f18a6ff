"""Checkpoints are atomic: a save that fails midway leaves the previous checkpoint loadable and no debris."""
import os

import numpy as np
import pytest

import tapegrad as tg


def trained(seed):
    rng = np.random.default_rng(seed)
    tape = tg.Tape()
    w = tape.param(rng.standard_normal((3, 2)))
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    tape.backward((w * w).sum())
    opt.step()
    return tape, w, opt


class Interrupted(Exception):
    pass


def test_a_save_that_fails_midway_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.npz")
    tape, w, opt = trained(0)
    tg.save(path, tape, opt)
    old = np.array(tape.value(w))

    tape2, w2, opt2 = trained(1)
    real_fsync = os.fsync

    def dies(fd):                                # every byte was written; the flush to disk fails
        raise Interrupted("power lost")

    monkeypatch.setattr(os, "fsync", dies)
    with pytest.raises(Interrupted):
        tg.save(path, tape2, opt2)
    monkeypatch.setattr(os, "fsync", real_fsync)

    assert os.listdir(tmp_path) == ["ck.npz"]      # the temporary file is gone too
    tape3, w3, opt3 = trained(2)
    tg.load(path, tape3, opt3)
    assert np.array_equal(tape3.value(w3), old)
    assert opt3.count == 1 and np.array_equal(opt3.mu[0], opt.mu[0])


def test_a_failed_save_into_a_new_path_leaves_nothing(tmp_path, monkeypatch):
    tape, _, opt = trained(0)

    def broken(fd):
        raise Interrupted("no space")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(Interrupted):
        tg.save(str(tmp_path / "new.npz"), tape, opt)
    assert os.listdir(tmp_path) == []
