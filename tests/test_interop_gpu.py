"""The CUDA custom call of a training episode lowers on a CPU-only machine; one jitted step serves both platforms."""
import re

import numpy as np
import pytest

import tapegrad as tg
from interop import jax
from interop.xla.gpu_call import TARGET, platform_episode, program_episode_gpu, slots, target
from interop.xla.program import ProgramError, episode_state, program_episode, program_inputs
from tapegrad.gpu.source import CudaProgram

HANDLES = dict(graph=11, settab=22, table=33, ctl=44)


def program(ordered=True, backend="native"):
    t = tg.Tape(ordered=ordered)
    w, b = t.param(np.linspace(-1, 1, 6).reshape(3, 2)), t.param(np.array([0.1, -0.2]))
    x = t.const(np.arange(12.0).reshape(4, 3) / 10)
    prog = tg.capture(t, ((x @ w + b).relu() ** 2).mean(), backend=backend)
    opt = tg.Adam(1e-2)
    opt.add(t, w)
    opt.add(t, b)
    prog.attach(opt)
    return prog


def test_cuda_lowering_emits_the_custom_call_with_handles_slots_and_aliases():
    prog = program()
    step = program_episode_gpu(prog, handles=HANDLES)
    args = tuple(episode_state(prog)) + (program_inputs(prog),)
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "stablehlo.custom_call" in line)
    assert f"@{target()}(" in call and target().startswith(TARGET + "_")
    for k, v in HANDLES.items():
        assert f"{k} = {v} : i64" in call
    cp = CudaProgram(prog)
    want, loss_slot = slots(prog, cp)
    assert f"slots = dense<[{', '.join(map(str, want))}]> : tensor<{len(want)}xi64>" in call
    assert loss_slot == cp.index[("v", prog.loss_id)] and f"loss_slot = {loss_slot} : i64" in call
    # the table's size, the device, the entries' own addresses (none given here: zeros)
    assert f"table_len = {len(cp.buffers)} : i64" in call and "device = 0 : i64" in call
    assert f"home = dense<0> : tensor<{len(want)}xi64>" in call and "loss_home = 0 : i64" in call
    # the optimizer's step-scalar inputs: Adam (2), optax's eps form, lr, b1, b2 as f64
    assert "opt = 2 : i64" in call and "hat = 0 : i64" in call
    f64 = dict((k, float(v)) for k, v in re.findall(r"\b(lr|b1|b2) = ([-+.e0-9]+) : f64", call))
    assert f64 == {"lr": 1e-2, "b1": 0.9, "b2": 0.999}   # MLIR prints them exactly
    # params (2), Adam moments (4) and count alias outputs 1..7
    assert call.count("#stablehlo.output_operand_alias<") == 7
    # operand slots: the params' and moments' table entries, -1 for count, then the input
    assert want.tolist() == [cp.index[("v", k)] for k in prog.params] + \
        [cp.index[(m, j)] for j in range(2) for m in "MN"] + [-1] + [cp.index[("v", k)] for k in prog.consts]


def test_platform_dependent_step_runs_the_cpu_call_here():
    prog, twin = program(), program()
    args = tuple(episode_state(prog)) + (program_inputs(prog),)
    text = jax.jit(platform_episode(prog, handles=HANDLES)).trace(*args).lower(
        lowering_platforms=("cpu", "cuda")).as_text()
    assert target() in text and "tapegrad_episode" in text
    got = jax.jit(platform_episode(prog, handles=HANDLES))(*args)
    want = jax.jit(program_episode(twin))(*args)
    assert float(got[0]) == float(want[0])
    leaves = jax.tree_util.tree_leaves
    assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(leaves(got[1:]), leaves(want[1:])))


def test_home_addresses_come_from_the_table_entries():
    prog = program()
    cp = CudaProgram(prog)
    vt = np.arange(len(cp.buffers), dtype=np.int64) * 16 + 4096
    step = program_episode_gpu(prog, handles=dict(HANDLES, vt=vt, device=1))
    args = tuple(episode_state(prog)) + (program_inputs(prog),)
    call = next(line for line in jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text().splitlines()
                if "stablehlo.custom_call" in line)
    want, loss_slot = slots(prog, cp)
    home = [int(vt[s]) if s >= 0 else 0 for s in want]
    assert f"home = dense<[{', '.join(map(str, home))}]> : tensor<{len(want)}xi64>" in call
    assert f"loss_home = {int(vt[loss_slot])} : i64" in call and "device = 1 : i64" in call


def test_gpu_call_errors_name_the_problem():
    with pytest.raises(ProgramError, match="ordered mode"):
        program_episode_gpu(program(ordered=False), handles=HANDLES)
    with pytest.raises(ProgramError, match="backend='cupy' is needed .*'native'"):
        program_episode_gpu(program())


def _call_of(step, prog):
    args = tuple(episode_state(prog)) + (program_inputs(prog),)
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return next(line for line in text.splitlines() if "stablehlo.custom_call" in line), text


def test_the_refusals_are_whole_messages(monkeypatch):
    t = tg.Tape(ordered=True)
    w = t.param(np.ones(2))
    bare = tg.capture(t, (w * w).sum())
    with pytest.raises(ProgramError, match=r"^program_episode_gpu: attach an optimizer first \(program\.attach\("
                                           r"optimizer\)\)$"):
        program_episode_gpu(bare, handles=HANDLES)
    with pytest.raises(ProgramError, match=r"^program_episode_gpu: capture in ordered mode \(capture\(\.\.\., "
                                           r"ordered=True\)\): a CUDA graph cannot hold the default mode's cuBLAS "
                                           r"calls$"):
        program_episode_gpu(program(ordered=False), handles=HANDLES)
    with pytest.raises(ProgramError, match=r"^program_episode_gpu: a program captured with backend='cupy' is needed "
                                           r"\(this one is 'native'\); pass handles=\.\.\. only to inspect the "
                                           r"lowering$"):
        program_episode_gpu(program())
    from interop.xla import gpu_call
    monkeypatch.setattr(gpu_call, "native_library", lambda: None)
    monkeypatch.setitem(gpu_call._LIB, "why", "no C compiler")
    with pytest.raises(ProgramError, match=r"^program_episode_gpu: the FFI handlers cannot be built here "
                                           r"\(no C compiler\)$"):
        target()


def test_a_cupy_programs_handles_come_from_its_runner(monkeypatch):
    """With a stand-in cupy (tests/fake_cupy.py) the program's runner is a real CupyRunner: no handles
    given, the call names its graph (captured now), settab kernel, table, control buffer and entries."""
    import sys
    import fake_cupy
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make())
    prog = program(backend="cupy")
    call, _ = _call_of(program_episode_gpu(prog), prog)
    r = prog.runner
    cp = r.cp
    want, loss_slot = slots(prog, cp)
    assert f"graph = {0x6a11} : i64" in call and f"settab = {0x5e77ab} : i64" in call and r.graph is not None
    assert f"table = {r.vt.data.ptr} : i64" in call and f"ctl = {r.ctl.data.ptr} : i64" in call
    assert f"table_len = {len(cp.buffers)} : i64" in call and "device = 0 : i64" in call
    home = [r.dev[cp.buffers[s]].data.ptr if s >= 0 else 0 for s in want]
    assert f"home = dense<[{', '.join(map(str, home))}]> : tensor<{len(want)}xi64>" in call
    assert f"loss_home = {r.dev[('v', prog.loss_id)].data.ptr} : i64" in call


@pytest.mark.parametrize("fuse", [True, False])
def test_an_emulated_programs_slots_are_its_runners_table(fuse):
    """A program with a launch runner uses that runner's table layout (fused or per-node), not a new one."""
    from tapegrad.gpu.host import emulate
    prog = emulate(program(backend="numpy"), fuse)
    want, loss_slot = prog.runner.cp.operand_slots()
    got, got_loss = slots(prog)
    assert got.tolist() == list(want) and got_loss == loss_slot and got.dtype == np.int64
    call, _ = _call_of(program_episode_gpu(prog, handles=HANDLES), prog)
    assert f"slots = dense<[{', '.join(map(str, want))}]>" in call and f"loss_slot = {loss_slot} : i64" in call
    nat = program()
    assert slots(nat)[0].tolist() == list(CudaProgram(nat, fuse=True).operand_slots()[0])


@pytest.mark.parametrize("make,opt,hat,b1,b2", [(lambda: tg.SGD(0.05), 1, 0, 0.0, 0.0),
                                                (lambda: tg.Adam(3e-3, b1=0.8, b2=0.99, eps_mode="hat"), 2, 1, 0.8, 0.99)])
def test_the_optimizer_attributes(make, opt, hat, b1, b2):
    t = tg.Tape(ordered=True)
    w = t.param(np.linspace(-1, 1, 6).reshape(3, 2))
    prog = tg.capture(t, (w * w).sum())
    o = make()
    o.add(t, w)
    prog.attach(o)
    step = program_episode_gpu(prog, handles=HANDLES)
    call, _ = _call_of(step, prog)
    assert f"opt = {opt} : i64" in call and f"hat = {hat} : i64" in call
    f64 = dict((k, float(v)) for k, v in re.findall(r"\b(lr|b1|b2) = ([-+.e0-9]+) : f64", call))
    assert f64 == {"lr": prog.opt.conf.lr, "b1": b1, "b2": b2}
    n = 1 + (2 if opt == 2 else 0)   # the param, its moments, the count
    assert call.count("#stablehlo.output_operand_alias<") == n + 1
    assert step.program is prog


def test_the_positional_form_lowers_to_the_same_call_and_checks_its_operands():
    prog = program()
    step = program_episode_gpu(prog, handles=HANDLES)
    params, state = episode_state(prog)
    inputs = program_inputs(prog)
    flat_p = tuple(params[n] for n in prog.param_names)
    flat_s = tuple(a for n in prog.param_names for a in (state.mu[n], state.nu[n]))
    text = jax.jit(step.positional).trace(flat_p, flat_s, 0, inputs).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "stablehlo.custom_call" in line)
    named = _call_of(step, prog)[0]
    assert call[call.index(") {"):] == named[named.index(") {"):]   # the same attributes, aliases and types
    bad = (flat_p[0], np.zeros(3))
    with pytest.raises(ProgramError, match=r"^program_episode_gpu: params\[1\] \('" + re.escape(prog.param_names[1])
                       + r"'\) must have shape \(2,\) \(the captured shape\), got \(3,\)$"):
        step.positional(bad, flat_s, 0, inputs)
    with pytest.raises(ProgramError, match=r"^program_episode_gpu: expected 1 inputs arrays"):
        step.positional(flat_p, flat_s, 0, inputs + inputs)
    with pytest.raises(ProgramError, match=r"^program_episode_gpu: expected 4 opt_state arrays"):
        step.positional(flat_p, flat_s[:3], 0, inputs)
