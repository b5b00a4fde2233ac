"""profiled: traces with the step's operators, a schedule that ends, compiled(profiled) refused."""

from __future__ import annotations

import json

import pytest
import torch
from reference import LayerNormNet, batches, mse

import fasttorch


def _state():
    torch.manual_seed(0)
    return fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(1e-2))


def _trace_names(path):
    events = json.loads(path.read_text())["traceEvents"]
    return {e.get("name", "") for e in events}


@pytest.mark.parametrize("compile_it", [False, True])
def test_trace_holds_the_steps_operators(tmp_path, compile_it):
    step = fasttorch.step(mse)
    if compile_it:
        step = fasttorch.compiled(step, backend="aot_eager")
    prof = fasttorch.profiled(step, dir=tmp_path, wait=1, warmup=1, active=2)
    assert prof.__name__ == "mse" and prof.transforms[-1] == "profiled"
    state = _state()
    for b in batches(6, 16):
        state, m = prof(state, b)
    # The schedule is 4 calls long: the profiler stopped by itself and wrote one trace.
    assert prof.calls == 4 and int(state.step) == 6
    (trace,) = tmp_path.glob("*.pt.trace.json")
    names = _trace_names(trace)
    assert "aten::addmm" in names or "aten::mm" in names
    assert any(n.startswith("aten::_foreach_") for n in names), sorted(names)[:50]
    assert any(n.startswith("ProfilerStep#") for n in names)


def test_stop_writes_the_window_being_recorded(tmp_path):
    prof = fasttorch.profiled(fasttorch.step(mse), dir=tmp_path, wait=0, warmup=1, active=5)
    state = _state()
    data = batches(3, 16)
    for b in data:
        state, _ = prof(state, b)
    assert not list(tmp_path.glob("*.json"))
    prof.stop()
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 1
    prof.stop()  # harmless twice
    state, _ = prof(state, data[0])  # and the step still runs, unprofiled
    assert prof.calls == 3


def test_repeat_zero_profiles_until_stop(tmp_path):
    prof = fasttorch.profiled(
        fasttorch.step(mse), dir=tmp_path, wait=0, warmup=1, active=1, repeat=0
    )
    state = _state()
    for b in batches(6, 8):
        state, _ = prof(state, b)
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 3  # one per 2-call cycle
    assert prof.profiler is not None and prof.calls == 6
    prof.stop()


def test_order_profiled_outside_compiled_only(tmp_path):
    step = fasttorch.step(mse)
    assert callable(fasttorch.profiled(fasttorch.compiled(step), dir=tmp_path))
    with pytest.raises(
        ValueError, match=r"compiled cannot wrap a profiled step.*profiled\(compiled"
    ):
        fasttorch.compiled(fasttorch.profiled(step, dir=tmp_path))
    with pytest.raises(ValueError, match="already profiled"):
        fasttorch.profiled(fasttorch.profiled(step, dir=tmp_path), dir=tmp_path)
    with pytest.raises(TypeError, match="with_amp wraps the phases"):
        fasttorch.with_amp(fasttorch.profiled(step, dir=tmp_path), "bf16")


def test_argument_errors(tmp_path):
    step = fasttorch.step(mse)
    with pytest.raises(ValueError, match="active must be an integer >= 1, got 0"):
        fasttorch.profiled(step, dir=tmp_path, active=0)
    with pytest.raises(ValueError, match="repeat must be an integer >= 0"):
        fasttorch.profiled(step, dir=tmp_path, repeat=-1)
    with pytest.raises(TypeError, match="expects a step or a"):
        fasttorch.profiled(3, dir=tmp_path)
    with pytest.raises(TypeError, match="dir must be a path"):
        fasttorch.profiled(step, dir=None)
