"""What a Program asks of a device backend ("cupy"), checked without a GPU: a recording runner stands in
for ``tapegrad.gpu.runner.CupyRunner`` (the NumPy replay underneath, so the numbers are real) and the
test reads which slot and which buffer kind each Program call hands it. The device runner itself is
tested on a CUDA machine (tests/test_interop_gpu.py, tests/test_gpu.py); this is the host half of the
contract: device_array(slot, "v" or "g"), input_changed(slot) after each write, loss_value() for
episode, download() before sync_params writes the tape."""
import re

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.errors import ForeignVarError
from tapegrad.gpu import runner as gpu_runner
from tapegrad.replay import NumpyRunner


class Recording(NumpyRunner):
    """A device runner double: device arrays are tagged copies; every call is logged in order."""

    def __init__(self, prog):
        super().__init__(prog)
        self.p, self.log = prog, []

    def device_array(self, k, kind="v"):
        self.log.append(("device_array", k, kind))
        host = self.p.val[k] if kind == "v" else self.p.grad_buf(k)
        return ("on device", kind, k, np.array(host))

    def input_changed(self, k):
        self.log.append(("input_changed", k, np.array(self.p.val[k])))

    def loss_value(self):
        self.log.append(("loss_value",))
        return -123.5      # not the host loss: episode must return what the device says

    def download(self):
        tape = self.p._tape()
        self.log.append(("download", [np.array(tape._val[k]) for k in self.p.params]))


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setattr(gpu_runner, "CupyRunner", Recording)
    tape = tg.Tape()
    w = tape.param(np.array([1.0, -2.0]), name="W")
    x = tape.const(np.array([3.0, 0.5]))
    loss = ((w * x) ** 2).sum()
    prog = tg.capture(tape, loss, backend="cupy", verify=False)   # a double, not a device to verify
    assert type(prog.runner) is Recording
    return tape, prog, w, x, loss


def test_values_gradients_and_the_loss_come_from_the_device_by_slot_and_kind(device):
    tape, prog, w, x, loss = device
    prog.forward()
    prog.backward()
    prog.runner.log.clear()
    v, g, byname, lo = prog.value(w), prog.grad(w), prog.value("W"), prog.loss()
    assert prog.runner.log == [("device_array", w.id, "v"), ("device_array", w.id, "g"),
                               ("device_array", w.id, "v"), ("device_array", loss.id, "v")]
    assert v[:3] == ("on device", "v", w.id) and np.array_equal(v[3], [1.0, -2.0])
    assert g[:3] == ("on device", "g", w.id) and np.array_equal(g[3], [2 * 9.0, 2 * -2.0 * 0.25])
    assert byname[:3] == ("on device", "v", w.id) and lo[:3] == ("on device", "v", loss.id)
    assert float(lo[3]) == 9.0 + 1.0


def test_a_var_the_program_does_not_know_is_refused_before_the_device_is_asked(device):
    tape, prog, w, x, loss = device
    late = w * 2.0
    for what, call in (("value", prog.value), ("grad", prog.grad)):
        with pytest.raises(ForeignVarError, match="^" + re.escape(
                f"{what} (node {late.id}): this Var is not a node of the captured episode (another tape, or created "
                f"after the capture); pass the Vars the captured episode used") + "$"):
            call(late)
    assert prog.runner.log == []


def test_each_input_write_is_announced_after_it_lands(device):
    tape, prog, w, x, loss = device
    prog.set_input(x, np.array([1.0, 1.0]))
    prog.set_input("W", np.array([0.5, 0.5]))
    log = prog.runner.log
    assert [e[:2] for e in log] == [("input_changed", x.id), ("input_changed", w.id)]
    assert np.array_equal(log[0][2], [1.0, 1.0]) and np.array_equal(log[1][2], [0.5, 0.5])
    assert prog.episode({x: np.array([2.0, 2.0])}) == -123.5
    assert [e[:2] for e in prog.runner.log[2:]] == [("input_changed", x.id), ("loss_value",)]


def test_sync_params_downloads_before_writing_the_tape(device):
    tape, prog, w, x, loss = device
    opt = tg.SGD(0.25)
    opt.add(tape, w)
    prog.attach(opt)
    prog.episode()
    prog.runner.log.clear()
    prog.sync_params(tape)
    (call, tape_then), = prog.runner.log
    assert call == "download" and np.array_equal(tape_then[0], [1.0, -2.0])     # the tape not yet written
    assert np.array_equal(tape.value(w), np.array(prog.val[w.id])) and not np.array_equal(tape.value(w), [1.0, -2.0])
