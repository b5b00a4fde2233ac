"""The equivalence matrix: every composition equals the hand-written loop (docs/design.md).

{fp32, bf16, fp16} x {no accumulation, 4 within one call, 4 across calls} x
{no clip, clip at 1.0} x {eager, compiled}, each against ``reference_run`` on a deep
copy of the same model, parameters compared after 10 optimizer steps.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from reference import (
    BatchNormNet,
    LayerNormNet,
    adam_twin,
    assert_buffers_close,
    assert_params_close,
    batches,
    mse,
    reference_run,
)
from tolerance import grad_norm_rtol, loss_atol, params_atol, reference_error

import fasttorch

STEPS = 10
N = 4
# fp16 starts from a scale that overflows, so skipping, backoff and growth all happen.
FP16 = {"init_scale": 2.0**22, "growth_interval": 3}
LR = 1e-2


def build(precision, accum, clip, mode, *, donate=True, loss_fn=mse):
    s = fasttorch.step(loss_fn, donate=donate)
    if precision != "fp32":
        s = fasttorch.with_amp(s, precision, **(FP16 if precision == "fp16" else {}))
    if accum != "none":
        s = fasttorch.grad_accumulate(s, N, across_calls=accum == "across")
    if clip is not None:
        s = fasttorch.clip_scaled(s, clip)
    if mode == "compiled":
        s = fasttorch.compiled(s, backend="aot_eager")
    return s


def windows_for(accum, seed=0):
    """The data as the reference loop sees it (windows of microbatches) and as the step gets it."""
    if accum == "none":
        data = batches(STEPS, 16, seed=seed)
        return [[b] for b in data], data
    if accum == "within":
        data = batches(STEPS, 32, seed=seed)
        return [list(zip(x.tensor_split(N), y.tensor_split(N))) for x, y in data], data
    data = batches(STEPS * N, 8, seed=seed)
    return [data[i : i + N] for i in range(0, len(data), N)], data


# torch's AdamW in the form fasttorch's adamw equals bit for bit in a donated step on a
# CPU (fused=True, its bias corrections in float32): the default form's doubles differ by
# up to 3.3e-6 relative in the first steps, more than rule 2 allows at this lr
# (docs/optimizers.md).
adamw = adam_twin(torch.optim.AdamW, LR, weight_decay=0.1, fused=True)


@pytest.mark.parametrize(
    "precision, accum, clip, mode",
    list(
        itertools.product(
            ["fp32", "bf16", "fp16"],
            ["none", "within", "across"],
            [None, 1.0],
            ["eager", "compiled"],
        )
    ),
)
def test_matches_reference_loop(precision, accum, clip, mode):
    torch.manual_seed(0)
    model = LayerNormNet()
    windows, calls = windows_for(accum)
    ref, log = reference_run(
        model,
        windows,
        make_opt=adamw,
        precision=precision,
        clip=clip,
        scaler_kwargs=FP16 if precision == "fp16" else None,
    )
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), fasttorch.optim.adamw(LR, weight_decay=0.1)
    )
    step = build(precision, accum, clip, mode)
    updates = []
    for batch in calls:
        state, metrics = step(state, batch)
        if "lr" in metrics:
            updates.append(metrics)
    assert len(updates) == STEPS and int(state.step) == STEPS
    # Rule 2 (fp32 loop's own error) plus, in bf16/fp16, rule 4 (tests/README.md).
    error = reference_error(model, windows, make_opt=adamw, clip=clip)
    atol = params_atol(error.params, state.params, precision=precision, steps=STEPS, lr=LR)
    assert_params_close(state, ref, rtol=0, atol=atol)
    losses = torch.stack([m["loss"] for m in updates])
    ref_losses = torch.tensor([r["loss"] for r in log])
    atol = loss_atol(error, ref_losses, precision)  # rules 2 + 4
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=atol)
    if precision == "fp16":
        scales = [float(m["loss_scale"]) for m in updates]
        assert scales == [r["scale"] for r in log]
        assert len(set(scales)) > 2, "the fp16 cases must see both backoff and growth"
    if clip is not None:
        norms = torch.stack([m["grad_norm"] for m in updates])
        ref_norms = torch.tensor([r["grad_norm"] for r in log])
        finite = torch.isfinite(ref_norms)
        rtol = grad_norm_rtol(error, precision)  # rules 2 + 4
        torch.testing.assert_close(norms[finite], ref_norms[finite], rtol=rtol, atol=0)


@pytest.mark.parametrize("accum", ["none", "within", "across"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_batchnorm_buffers_match_reference(accum, mode):
    torch.manual_seed(1)
    model = BatchNormNet()
    windows, calls = windows_for(accum, seed=1)
    ref, _ = reference_run(model, windows, make_opt=adamw, clip=1.0)
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), fasttorch.optim.adamw(LR, weight_decay=0.1)
    )
    step = build("fp32", accum, 1.0, mode)
    for batch in calls:
        state, _ = step(state, batch)
    error = reference_error(model, windows, make_opt=adamw, clip=1.0)  # rule 2
    assert_params_close(state, ref, rtol=0, atol=params_atol(error.params, state.params))
    assert_buffers_close(state, ref, atol=params_atol(error.buffers, state.buffers))
    assert int(state.buffers["bn.num_batches_tracked"]) == STEPS * (1 if accum == "none" else N)


@pytest.mark.parametrize("accum", ["within", "across"])
def test_sgd_nesterov_with_accumulation(accum):
    torch.manual_seed(2)
    model = LayerNormNet()
    windows, calls = windows_for(accum, seed=2)

    def sgd(p):
        return torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)

    ref, _ = reference_run(model, windows, clip=0.5, make_opt=sgd)
    opt = fasttorch.optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    step = build("fp32", accum, 0.5, "eager")
    for batch in calls:
        state, _ = step(state, batch)
    error = reference_error(model, windows, make_opt=sgd, clip=0.5)  # rule 2
    assert_params_close(state, ref, rtol=0, atol=params_atol(error.params, state.params))
