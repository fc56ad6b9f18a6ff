"""Bad input to optimizers and captured programs: a named error, and parameters, state and program
buffers exactly as they were (including Vars and slots kept across ``reset_to``)."""
import math

import numpy as np
import pytest

import tapegrad as tg

from fault_util import opt_state, program_state, raises_cleanly, same, tape_state

CE, F, S, D, L, T = tg.ConfigError, tg.ForeignVarError, tg.ShapeError, tg.DTypeError, tg.LazyValueError, tg.TapeError

# ── optimizer settings ───────────────────────────────────────────────────────

SETTINGS = [
    ("Adam b1=1", lambda: tg.Adam(0.1, b1=1.0), r"Adam: b1 must be a finite number in \[0.0, 1.0\), got 1.0"),
    ("Adam b2=1", lambda: tg.Adam(0.1, b2=1.0), r"Adam: b2 must be a finite number in \[0.0, 1.0\), got 1.0"),
    ("Adam b1<0", lambda: tg.Adam(0.1, b1=-0.1), r"Adam: b1 must be .* got -0.1"),
    ("Adam b2 nan", lambda: tg.Adam(0.1, b2=math.nan), r"Adam: b2 must be .* got nan"),
    ("Adam eps=0", lambda: tg.Adam(0.1, eps=0.0), r"Adam: eps must be a finite number in \(0.0, inf\], got 0.0"),
    ("Adam eps=0 hat", lambda: tg.Adam(0.1, eps=0.0, eps_mode="hat"), r"Adam: eps must be .* got 0.0"),
    ("Adam eps inf", lambda: tg.Adam(0.1, eps=math.inf), r"Adam: eps must be finite, got inf"),
    ("Adam eps str", lambda: tg.Adam(0.1, eps="tiny"), r"Adam: eps must be a real number, got str 'tiny'"),
    ("Adam eps_mode", lambda: tg.Adam(0.1, eps_mode="torch"), r"Adam: eps_mode must be 'optax' or 'hat', got 'torch'"),
    ("Adam lr negative", lambda: tg.Adam(-0.1), r"Adam: lr \(the learning rate\) must be a finite number in \[0.0, inf\], got -0.1"),
    ("SGD lr nan", lambda: tg.SGD(math.nan), r"SGD: lr \(the learning rate\) must be .* got nan"),
    ("SGD lr inf", lambda: tg.SGD(math.inf), r"SGD: lr \(the learning rate\) must be finite, got inf"),
    ("SGD lr None", lambda: tg.SGD(None), r"SGD: lr \(the learning rate\) must be a real number, got NoneType"),
    ("SGD lr array", lambda: tg.SGD(np.ones(2)), r"SGD: lr \(the learning rate\) must be a real number, got ndarray"),
    ("clip 0", lambda: tg.SGD(0.1, clip=0.0), r"SGD: clip \(the max global norm\) must be a finite number in \(0.0, inf\], got 0.0"),
    ("clip negative", lambda: tg.Adam(0.1, clip=-1.0), r"Adam: clip \(the max global norm\) must be .* got -1.0"),
    ("clip nan", lambda: tg.Adam(0.1, clip=math.nan), r"Adam: clip .* got nan"),
    ("clip_mode", lambda: tg.SGD(0.1, clip=1.0, clip_mode="keras"), r"SGD: clip_mode must be one of \('optax', 'seed', 'torch'\), got 'keras'"),
]


@pytest.mark.parametrize("case", SETTINGS, ids=[c[0] for c in SETTINGS])
def test_out_of_range_settings_are_refused(case):
    _, make, match = case
    raises_cleanly(CE, match, make)


def test_config_errors_are_value_errors_and_tape_errors():
    assert issubclass(CE, ValueError) and issubclass(CE, T)


def model():
    rng = np.random.default_rng(0)
    tape = tg.Tape()
    w = tape.param(rng.standard_normal((3, 2)))
    b = tape.param(np.zeros(2))
    x = tape.const(rng.standard_normal((4, 3)))
    m = tape.mark()
    loss = ((x @ w + b).tanh() * 2.0).mean()
    opt = tg.Adam(0.1)
    opt.add(tape, w)
    opt.add(tape, b, l2=0.0)
    tape.backward(loss)
    opt.step()
    return tape, w, b, x, m, loss, opt


def snaps(tape, opt):
    return (lambda: tape_state(tape)), (lambda: opt_state(opt))


def test_add_rejects_bad_l2_and_bad_parameters():
    tape, w, b, x, m, loss, opt = model()
    other = tg.Tape()
    ow = other.param(np.ones(2))
    raises_cleanly(CE, r"Adam.add \(node 0\): l2 must be a finite number in \[0.0, inf\], got -1.0",
                   lambda: opt.add(tape, w, l2=-1.0), *snaps(tape, opt))
    raises_cleanly(T, r"Adam.add: this optimizer already serves another tape", lambda: opt.add(other, ow), *snaps(tape, opt))
    raises_cleanly(T, r"Adam.add \(node 2\): expected a param, got a const node", lambda: opt.add(tape, x), *snaps(tape, opt))
    raises_cleanly(T, r"Adam.add \(node 0\): parameter already registered", lambda: opt.add(tape, w), *snaps(tape, opt))
    raises_cleanly(tg.ArgumentError, r"Adam.add \(node \d+\): argument var must be a Var, got ndarray",
                   lambda: opt.add(tape, np.ones(2)), *snaps(tape, opt))
    raises_cleanly(CE, r"SGD.add \(node 0\): l2 must be a real number, got str",
                   lambda: tg.SGD(0.1).add(tape, w, l2="x"), *snaps(tape, opt))


def test_step_refuses_parameters_that_reset_to_dropped():
    tape = tg.Tape()
    keep = tape.param(np.ones(2))
    m = tape.mark()
    late = tape.param(np.full(3, 5.0))      # registered inside the episode: dropped by the reset
    opt = tg.SGD(0.5)
    opt.add(tape, keep)
    opt.add(tape, late)
    tape.backward((late * keep.sum()).sum())
    tape.reset_to(m)
    newcomer = tape.param(np.full(3, 7.0))   # now sits in late's slot
    tape.backward((newcomer * newcomer).sum())
    raises_cleanly(F, r"SGD.step: parameter 1 \(node 1\) was dropped by reset_to; register parameters before tape.mark\(\)",
                   opt.step, *snaps(tape, opt))
    assert np.array_equal(tape.value(newcomer), np.full(3, 7.0))


def test_load_state_dict_validates_before_writing():
    tape, w, b, x, m, loss, opt = model()
    st = opt.state_dict()
    for bad, match in [({**st, "count": -1}, r"count must be a non-negative int, got -1"),
                       ({**st, "count": 1.5}, r"count must be a non-negative int, got 1.5"),
                       ({**st, "count": None}, r"count must be a non-negative int, got None"),
                       ({**st, "mu": st["mu"][:1]}, r"expected 2 'mu' arrays, got 1"),
                       ({**st, "nu": None}, r"expected 2 'nu' arrays, got None"),
                       ({**st, "nu": [st["nu"][0], np.zeros(3)]}, r"nu\[1\] must have shape \(2,\), got \(3,\)"),
                       ({**st, "mu": [np.zeros((2, 3)), st["mu"][1]]}, r"mu\[0\] must have shape \(3, 2\), got \(2, 3\)")]:
        raises_cleanly(T, r"Adam.load_state_dict: " + match, lambda: opt.load_state_dict(bad), *snaps(tape, opt))


# ── programs ─────────────────────────────────────────────────────────────────

@pytest.fixture
def prog():
    tape, w, b, x, m, loss, opt = model()
    p = tg.capture(tape, loss)
    p.attach(opt)
    p.episode()
    return tape, w, b, x, m, loss, opt, p


def pstate(p):
    return lambda: program_state(p)


PROGRAM_CASES = [
    ("set_input shape", lambda e: e.p.set_input(e.x, np.ones((1, 3))), S,
     r"set_input \(node 2\): expected shape \(4, 3\) for const node 2, got \(1, 3\); a program is static"),
    ("set_input broadcastable", lambda e: e.p.set_input(e.b, np.array([7.0])), S,
     r"set_input \(node 1\): expected shape \(2,\) for param 'param_1' node 1, got \(1,\)"),
    ("set_input int", lambda e: e.p.set_input(e.x, np.ones((4, 3), np.int64)), D,
     r"set_input \(node 2\): expected float64 or float32 data for const node 2 .* got int64"),
    ("set_input complex", lambda e: e.p.set_input(e.x, np.ones((4, 3), complex)), D, r"set_input \(node 2\): .*got complex128"),
    ("set_input object", lambda e: e.p.set_input(e.x, [[None] * 3] * 4), D, r"set_input \(node 2\): .*got object"),
    ("set_input computed node", lambda e: e.p.set_input(e.loss, np.ones(())), T,
     r"set_input \(node \d+\): expected a const or param slot, got a mean node"),
    ("set_input foreign", lambda e: e.p.set_input(tg.Tape().param(np.ones(2)), np.ones(2)), F,
     r"set_input \(node 0\): this Var is not a node of the captured episode"),
    ("set_input array key", lambda e: e.p.set_input(np.ones(2), np.ones(2)), TypeError,
     r"set_input: expected a Var of the captured tape or a parameter name, got ndarray"),
    ("episode second input bad", lambda e: e.p.episode({e.x: np.full((4, 3), 9.0), e.b: np.ones(3)}), S,
     r"set_input \(node 1\): expected shape \(2,\) for param 'param_1' node 1, got \(3,\)"),
    ("episode foreign input", lambda e: e.p.episode({e.late: np.ones(2)}), F,
     r"set_input \(node \d+\): this Var is not a node of the captured episode"),
    ("value after capture", lambda e: e.p.value(e.late), F, r"value \(node \d+\): this Var is not a node of the captured episode"),
    ("grad foreign", lambda e: e.p.grad(e.other), F, r"grad \(node 0\): this Var is not a node"),
    ("native_abi of numpy", lambda e: e.p.native_abi(), T, r"native_abi: only a native program has one"),
    ("load_optimizer_state count", lambda e: e.p.load_optimizer_state({"count": -3}), T,
     r"load_optimizer_state: count must be a non-negative int, got -3"),
    ("load_optimizer_state shapes", lambda e: e.p.load_optimizer_state({"count": 1, "mu": [np.zeros(2), np.zeros(2)],
                                                                       "nu": [np.zeros((3, 2)), np.zeros(2)]}), S,
     r"load_optimizer_state: mu\[0\] \(param 'param_0' node 0\) must have shape \(3, 2\), got \(2,\)"),
    ("load_optimizer_state missing", lambda e: e.p.load_optimizer_state({"count": 1}), T,
     r"load_optimizer_state: expected 2 'mu' arrays"),
    ("attach foreign optimizer", lambda e: e.p.attach(e.other_opt), F, r"attach: the optimizer serves another tape"),
    ("attach late parameter", lambda e: e.p.attach(e.late_opt), F, r"attach \(node \d+\): this Var is not a node of the captured"),
    ("sync_params other tape", lambda e: e.p.sync_params(tg.Tape()), F, r"sync_params: not the tape this program was captured from"),
    ("sync_params other optimizer", lambda e: e.p.sync_params(e.tape, e.sgd), T,
     r"sync_params: the optimizer \(SGD, parameters \[0\]\) is not the one attached to the program \(\('Adam', \[0, 1\]\)\)"),
]


class Env:
    pass


@pytest.mark.parametrize("case", PROGRAM_CASES, ids=[c[0] for c in PROGRAM_CASES])
def test_bad_program_input_raises_and_changes_nothing(prog, case):
    _, fn, exc, match = case
    e = Env()
    e.tape, e.w, e.b, e.x, e.m, e.loss, e.opt, e.p = prog
    e.late = e.tape.param(np.ones(2))
    e.late_opt = tg.SGD(0.1)
    e.late_opt.add(e.tape, e.late)
    e.other = tg.Tape().param(np.ones(2))
    e.other_opt = tg.SGD(0.1)
    e.other_opt.add(e.other.tape, e.other)
    e.sgd = tg.SGD(0.1)
    e.sgd.add(e.tape, e.w)
    raises_cleanly(exc, match, lambda: fn(e), pstate(e.p), lambda: tape_state(e.tape), lambda: opt_state(e.opt))
    assert math.isfinite(e.p.episode())


def test_capture_errors():
    tape, w, b, x, m, loss, opt = model()
    raises_cleanly(CE, r"capture: backend must be one of \('numpy', 'native', 'cupy'\), got 'cuda'",
                   lambda: tg.capture(tape, loss, backend="cuda"), lambda: tape_state(tape))
    raises_cleanly(D, r"capture: dtype must be float64 or float32, got int32", lambda: tg.capture(tape, loss, dtype="int32"),
                   lambda: tape_state(tape))
    raises_cleanly(S, r"capture \(node 0\): expected a scalar loss \(one element\), got shape \(3, 2\)",
                   lambda: tg.capture(tape, w), lambda: tape_state(tape))
    raises_cleanly(F, r"capture \(node \d+\): argument loss \(node 0\) belongs to another tape",
                   lambda: tg.capture(tape, tg.Tape().param(np.ones(1))), lambda: tape_state(tape))
    tape.reset_to(m)
    raises_cleanly(F, r"capture \(node \d+\): argument loss \(node \d+\) was dropped by reset_to",
                   lambda: tg.capture(tape, loss), lambda: tape_state(tape))


def test_lazy_constants_without_values():
    tape = tg.Tape()
    w = tape.param(np.ones(3))
    c = tape.const_lazy((3,))
    p = tg.capture(tape, (w * c).sum())
    raises_cleanly(L, r"forward \(node 1\): lazy constant node\(s\) \[1\] have no values yet; give each one with "
                      r"program.set_input", p.forward, pstate(p))
    raises_cleanly(L, r"episode \(node 1\)", p.episode, pstate(p))
    p.set_input(c, np.full(3, 2.0))
    assert float(p.forward()) == 6.0


def test_step_and_state_without_an_optimizer():
    tape, w, b, x, m, loss, opt = model()
    p = tg.capture(tape, loss)
    raises_cleanly(T, r"step: no optimizer attached; call program.attach\(optimizer\) first", p.step, pstate(p))
    raises_cleanly(T, r"optimizer_state: no optimizer attached", p.optimizer_state, pstate(p))
    raises_cleanly(T, r"load_optimizer_state: no optimizer attached", lambda: p.load_optimizer_state({"count": 0}),
                   pstate(p))


def test_sync_params_refuses_slots_that_reset_to_reused():
    tape = tg.Tape()
    keep = tape.param(np.ones(2))
    m = tape.mark()
    late = tape.param(np.full(2, 3.0))
    loss = (keep * late).sum()
    p = tg.capture(tape, loss)
    p.set_input(keep, np.full(2, 9.0))
    tape.reset_to(m)
    intruder = tape.param(np.full(2, 4.0))     # a new parameter in the dropped one's node id and slot
    raises_cleanly(F, r"sync_params \(node 1\): the captured parameter node 1 \(2,\) is no longer on the tape "
                      r"\(reset_to dropped it; node 1 is now a param \(2,\)\)", lambda: p.sync_params(tape),
                   lambda: tape_state(tape), pstate(p))
    assert np.array_equal(tape.value(intruder), [4.0, 4.0]) and np.array_equal(tape.value(keep), [1.0, 1.0])
    tape.reset_to(m)
    tape.param(np.zeros((3, 3)))               # another shape in that slot: never broadcast into
    raises_cleanly(F, r"node 1 is now a param \(3, 3\)", lambda: p.sync_params(tape), lambda: tape_state(tape))


def test_sync_params_with_the_attached_optimizer_round_trips(prog):
    tape, w, b, x, m, loss, opt, p = prog
    for _ in range(3):
        p.episode()
    p.sync_params(tape, opt)
    assert opt.count == p.optimizer_state()["count"] == 5
    assert same(np.array(tape.value(w)), np.array(p.value(w)))
