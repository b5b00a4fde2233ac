"""clip_scaled: unscale and clip folded into one multiply, equal to unscale_ + clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch
from reference import LayerNormNet, batches, mse
from tolerance import EXACT, gamma, unit_roundoff

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
    # Rule 1: the same gradients, unscaled and reduced by the same operations.
    torch.testing.assert_close(m1["grad_norm"], m0["grad_norm"], **EXACT)
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
    # Rule 3: the norm (a sum of n squares), the clip coefficient and the scaled gradient
    # round gamma(n + 3) of 0.5; p - g and new - before round once each, at most u of
    # the new parameters' norm; clip_grad_norm_'s 1e-6 in the denominator is 1e-6/norm.
    n = sum(v.numel() for v in before.values())
    new_norm = float(
        torch.linalg.vector_norm(torch.cat([v.flatten() for v in state.params.values()]))
    )
    norm = float(m["grad_norm"])
    bound = 0.5 * (gamma(n + 3) + 1e-6 / norm) + 2 * unit_roundoff(torch.float32) * new_norm
    assert norm > 100 and abs(float(delta) - 0.5) <= bound, (float(delta), bound)


def test_disabled_and_bad_arguments():
    s = fasttorch.step(mse)
    assert fasttorch.clip_scaled(s, math.inf) is s
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm must be > 0"):
            fasttorch.clip_scaled(s, bad)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        fasttorch.clip_scaled(s, "1.0")


def _update_graph_writes(step_fn) -> tuple[int, int]:
    """(non-scalar input tensors the compiled update graph writes, parameters)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: list[torch.fx.GraphModule] = []

    def record(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, keep_inference_input_mutations=True)
    model = LayerNormNet()
    # opaque=False: the update traced into the graph, whose writes are counted here
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2, opaque=False))
    n_params = len(state.params)
    fast = fasttorch.compiled(step_fn, backend=backend)
    x, y = batches(1, 16)[0]
    fast(state, (x, y))
    (update,) = [g for g in graphs if "sqrt" in str(g.code)]  # AdamW's denominator
    placeholders = {n for n in update.graph.nodes if n.op == "placeholder"}
    writes = {
        n.args[0]
        for n in update.graph.nodes
        if n.target is torch.ops.aten.copy_.default
        and n.args[0] in placeholders
        and n.args[0].meta["val"].dim() > 0  # not the step count or the loss scale
    }
    return len(writes), n_params


def test_a_compiled_update_writes_only_the_donated_state_not_the_window():
    """Parameters and both moments are written back (donation); the window's gradients,
    which the next window zeroes, are not written with their mean or clipped values."""
    for scale_too in (False, True):
        s = fasttorch.grad_accumulate(fasttorch.step(mse), 2)
        if scale_too:
            s = fasttorch.with_amp(s, "fp16")
        writes, n = _update_graph_writes(fasttorch.clip_scaled(s, 1.0))
        assert writes == 3 * n, (writes, n)  # parameters, exp_avg, exp_avg_sq


def test_in_a_cpu_graph_the_global_norm_is_the_eager_norm_bit_for_bit():
    from fasttorch.steps import global_norm

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(37 * (i + 1), 5, generator=g) * 10**i for i in range(6)}
    eager = global_norm(tensors)
    traced = torch.compile(global_norm, backend="aot_eager", fullgraph=True)(tensors)
    assert torch.equal(eager, traced)


def test_scale_grads_is_in_place_in_eager_mode_and_out_of_place_in_a_graph():
    from fasttorch.steps import scale_grads

    grads = {"a": torch.ones(3), "b": torch.full((2,), 2.0)}
    out = scale_grads(grads, torch.tensor(0.5))
    assert out["a"] is grads["a"] and torch.equal(grads["b"], torch.ones(2))
    grads = {"a": torch.ones(3), "b": torch.full((2,), 2.0)}
    out = torch.compile(scale_grads, backend="aot_eager", fullgraph=True)(grads, torch.tensor(0.5))
    assert torch.equal(grads["a"], torch.ones(3)), "a graph input is left as it was"
    assert torch.equal(out["a"], torch.full((3,), 0.5)) and torch.equal(out["b"], torch.ones(2))
