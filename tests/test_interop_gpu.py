"""The CUDA custom call of a training episode lowers on a CPU-only machine; one jitted step serves both platforms."""
import re

import numpy as np
import pytest

import tapegrad as tg
from interop import jax
from interop.gpu_call import TARGET, platform_episode, program_episode_gpu, slots, target
from interop.program import ProgramError, episode_state, program_episode, program_inputs
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
