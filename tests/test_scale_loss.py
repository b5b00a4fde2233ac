"""scale_loss against the hand-written loop that backpropagates ``loss * factor``."""

import copy

import pytest
import torch
from reference import LayerNormNet, assert_params_close, batches, mse
from tolerance import fp32_reference_error, params_atol

import fasttorch


def _hand_loop(model, data, factor, n=1):
    # SGD, not Adam: Adam's update hardly depends on the gradients' scale.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        for xm, ym in zip(x.tensor_split(n), y.tensor_split(n)):
            (mse(model, (xm, ym)) * factor / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("n", [1, 2])
def test_matches_the_loop_that_backpropagates_the_weighted_loss(compile_it, n):
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(3, 16)
    ref0 = copy.deepcopy(model)
    ref = _hand_loop(copy.deepcopy(model), data, 0.25, n)
    step = fasttorch.grad_accumulate(fasttorch.scale_loss(fasttorch.step(mse), 0.25), n)
    if compile_it:
        step = fasttorch.compiled(step, backend="aot_eager")
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1, momentum=0.9))
    for b in data:
        state, metrics = step(state, b)
    # Rule 2: the fp32 loop's own error against float64 (tests/README.md).
    errors = fp32_reference_error(
        ref0,
        [list(zip(x.tensor_split(n), y.tensor_split(n))) for x, y in data],
        make_opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        loss_fn=lambda apply, b: mse(apply, b) * 0.25,
    )
    assert_params_close(state, ref, rtol=0, atol=params_atol(errors, state.params))
    assert metrics["loss"].ndim == 0


@pytest.mark.parametrize("n", [1, 2])
def test_bitwise_equal_to_weighting_inside_the_loss_function(n):
    """The same optimizer on both sides: weighting the loss in the loss function, or
    with scale_loss, is the same multiplication by a power of two, so the same bits."""
    torch.manual_seed(0)
    model = LayerNormNet()

    def weighted(apply, batch):
        return mse(apply, batch) * 0.25

    states = [
        fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.sgd(0.1))
        for _ in range(2)
    ]
    steps = [
        fasttorch.grad_accumulate(fasttorch.scale_loss(fasttorch.step(mse), 0.25), n),
        fasttorch.grad_accumulate(fasttorch.step(weighted), n),
    ]
    for b in batches(3, 16):
        for i in range(2):
            states[i], _ = steps[i](states[i], b)
    for k, v in states[0].params.items():
        assert torch.equal(v, states[1].params[k]), k


def test_the_reported_loss_is_the_loss_functions_own():
    torch.manual_seed(0)
    model = LayerNormNet()
    b = batches(1, 8)[0]
    expected = mse(copy.deepcopy(model), b)
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.0))
    _, metrics = fasttorch.scale_loss(fasttorch.step(mse), 8.0)(state, b)
    assert torch.equal(metrics["loss"], expected.detach())


def test_bad_factors_are_refused_at_wrap_time_and_one_is_no_op():
    step = fasttorch.step(mse)
    assert fasttorch.scale_loss(step, 1) is step
    for bad, kind in (
        (0, ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("2", TypeError),
    ):
        with pytest.raises(kind, match="scale_loss: factor"):
            fasttorch.scale_loss(step, bad)
    with pytest.raises(ValueError, match="already applied"):
        fasttorch.scale_loss(fasttorch.scale_loss(step, 2.0), 2.0)
