"""clip_scaled: unscale and clip folded into one multiply, equal to unscale_ + clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch
from reference import LayerNormNet, batches, mse

import fasttorch
from fasttorch.steps import GradOut


def _grads(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(5, 3, generator=g) * 3 * scale for i in range(4)}


def _capture(max_norm):
    seen = {}

    def inner(state, g):
        seen["g"] = g
        return state, {}

    step = fasttorch.step(mse).with_phases("test", update=inner)
    return fasttorch.clip_scaled(step, max_norm).update, seen


@pytest.mark.parametrize("scale", [1.0, 2.0**16, 2.0**-3])
@pytest.mark.parametrize("max_norm", [1.0, 1e3])
def test_folded_clip_is_bit_identical_to_unscale_then_clip_grad_norm(scale, max_norm):
    true = _grads()
    scaled = {k: v * scale for k, v in true.items()}
    update, seen = _capture(max_norm)
    g = GradOut(
        grads=scaled,
        value=torch.tensor(0.0),
        weight=torch.tensor(1.0),
        scale=None if scale == 1.0 else torch.tensor(scale),
    )
    # The update phase owns the gradients it is given (it may scale them in place).
    update(None, g.replace(grads={k: v.clone() for k, v in scaled.items()}))
    out = seen["g"]
    # The reference: unscale_ (multiply by the float32 reciprocal), then clip_grad_norm_.
    params = [torch.nn.Parameter(torch.empty(5, 3)) for _ in true]
    for p, v in zip(params, scaled.values()):
        p.grad = v * torch.tensor(scale).double().reciprocal().float()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    assert out.scale is None
    assert torch.equal(out.norm, norm)
    for p, k in zip(params, true):
        assert torch.equal(out.grads[k], p.grad), k


def test_reports_the_unscaled_norm_before_clipping():
    def loss_fn(apply, batch):
        return mse(apply, batch) * 100.0

    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    plain = fasttorch.step(loss_fn, donate=False)
    clipped = fasttorch.clip_scaled(fasttorch.with_amp(plain, "fp16", init_scale=2.0**10), 1.0)
    b = batches(1, 16)[0]
    _, m0 = fasttorch.with_amp(plain, "fp16", init_scale=2.0**10)(state, b)
    _, m1 = clipped(state, b)
    assert not bool(m1["skipped"]) and not bool(m0["skipped"])
    torch.testing.assert_close(m1["grad_norm"], m0["grad_norm"])
    assert float(m1["grad_norm"]) > 1.0


def test_clipped_update_uses_norm_at_most_max_norm():
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(1.0))
    before = {k: v.clone() for k, v in state.params.items()}
    step = fasttorch.clip_scaled(fasttorch.step(lambda a, b: mse(a, b) * 1e4), 0.5)
    state, m = step(state, batches(1, 16)[0])
    delta = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(state.params[k] - before[k]) for k in before])
    )
    assert float(m["grad_norm"]) > 100 and abs(float(delta) - 0.5) < 1e-5


def test_disabled_and_bad_arguments():
    s = fasttorch.step(mse)
    assert fasttorch.clip_scaled(s, math.inf) is s
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm must be > 0"):
            fasttorch.clip_scaled(s, bad)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        fasttorch.clip_scaled(s, "1.0")
