"""Composition: commuting transforms give identical results; bad orders fail at wrap time."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from reference import LayerNormNet, batches, mse

import fasttorch

WRAP = {
    "with_amp": lambda s: fasttorch.with_amp(s, "fp16", init_scale=2.0**22, growth_interval=2),
    "grad_accumulate": lambda s: fasttorch.grad_accumulate(s, 4),
    "clip_scaled": lambda s: fasttorch.clip_scaled(s, 0.5),
}


def _train(order, data, model):
    s = fasttorch.step(mse)
    for name in order:
        s = WRAP[name](s)
    state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(1e-2))
    log = []
    for b in data:
        state, m = s(state, b)
        log.append((m["loss"], m["grad_norm"], m["loss_scale"], m["skipped"]))
    return state, log


def test_every_order_of_amp_accumulate_and_clip_gives_identical_results():
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(6, 32)
    orders = list(itertools.permutations(WRAP))
    results = [_train(order, data, model) for order in orders]
    base_state, base_log = results[0]
    assert any(bool(m[3]) for m in base_log), "a skipped step is part of what commutes"
    for order, (state, log) in zip(orders[1:], results[1:]):
        for k in base_state.params:
            assert torch.equal(state.params[k], base_state.params[k]), (order, k)
        for a, b in zip(log, base_log):
            for x, y in zip(a, b):  # bitwise; a skipped step's grad norm is NaN on both
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=str(order))


def test_a_transform_over_a_compiled_step_is_refused_naming_the_fix():
    c = fasttorch.compiled(fasttorch.step(mse))
    for name, wrap in WRAP.items():
        with pytest.raises(
            ValueError, match=rf"compiled must be the outermost.*compiled\({name}\("
        ):
            wrap(c)


@pytest.mark.parametrize("name", [*WRAP, "compiled"])
def test_a_transform_applied_twice_is_refused(name):
    wrap = WRAP.get(name, fasttorch.compiled)
    with pytest.raises(ValueError, match=rf"{name} is already applied"):
        wrap(wrap(fasttorch.step(mse)))


@pytest.mark.parametrize("name", list(WRAP))
def test_phase_transforms_need_a_step(name):
    def custom(state, batch):
        return state, {}

    with pytest.raises(TypeError, match=rf"{name} wraps the phases.*got 'custom'"):
        WRAP[name](custom)


def test_disabled_transforms_return_the_step_itself():
    s = fasttorch.step(mse)
    assert fasttorch.grad_accumulate(s, 1) is s
    assert fasttorch.clip_scaled(s, float("inf")) is s
