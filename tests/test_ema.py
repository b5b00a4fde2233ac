"""ema: the moving average equals a hand-written lerp_ loop, skips fp16 overflows, compiles."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.utils._pytree as pytree
from reference import LayerNormNet, batches, mse
from tolerance import EXACT, fp32_reference_error, params_atol

import fasttorch

counters = torch._dynamo.utils.counters


LR = 1e-2


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _atol(model, data, state, **half):
    """Rule 2 (+ rule 4 with ``half``): the fp32 loop's own error on the finite batches.

    The average is a convex combination of parameters, so the parameters' bound holds
    for it too; the floor of ``params_atol`` (one rounding) covers the lerp itself."""
    finite = [[b] for b in data if bool(torch.isfinite(b[0]).all())]
    return params_atol(fp32_reference_error(model, finite, make_opt=_adamw), state.params, **half)


def _reference(model, data, decay, *, warmup=None, fp16=False, init_scale=2.0**16):
    """torch.optim + GradScaler on a deep copy, and ema_p.lerp_(p, 1 - decay) per update."""
    model = copy.deepcopy(model)
    ema_model = copy.deepcopy(model)
    opt = _adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=fp16, init_scale=init_scale)
    t = 0
    for b in data:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = mse(model, b)
        scaler.scale(loss).backward()
        before = scaler.get_scale() if fp16 else None
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if fp16 and scaler.get_scale() < before:
            continue  # GradScaler skipped opt.step(): the average stays
        d = decay if warmup is None else min(decay, (1 + t) / (warmup + t))
        with torch.no_grad():
            for ema_p, p in zip(ema_model.parameters(), model.parameters()):
                ema_p.lerp_(p, 1 - d)
        t += 1
    return model, ema_model, t


def _run(step, model, data):
    state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(LR))
    for b in data:
        state, _ = step(state, b)
    return state


def _assert_close(params, module, **tol):
    for name, p in module.named_parameters():
        torch.testing.assert_close(
            params[name], p.detach(), **tol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("warmup", [None, 10.0])
def test_matches_the_reference_lerp_loop(warmup):
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(10, 16)
    state = _run(fasttorch.ema(fasttorch.step(mse), 0.9, warmup=warmup), model, data)
    ref, ref_ema, t = _reference(model, data, 0.9, warmup=warmup)
    atol = _atol(model, data, state)  # rule 2
    _assert_close(state.params, ref, rtol=0, atol=atol)
    _assert_close(state.substates["ema"].params, ref_ema, rtol=0, atol=atol)
    assert int(state.substates["ema"].count) == t == 10
    # The average really lags the parameters: by more than the bound above.
    lag = state.substates["ema"].params["out.weight"] - state.params["out.weight"]
    assert float(lag.abs().max()) > atol


def test_init_is_a_copy_of_the_params_not_a_view():
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    s = fasttorch.ema(fasttorch.step(mse), 0.5)
    state = s.init(state)
    sub = state.substates["ema"]
    for k, p in state.params.items():
        assert torch.equal(sub.params[k], p) and sub.params[k].data_ptr() != p.data_ptr()
    assert int(sub.count) == 0


def _with_overflow(n=8, at=(2, 5)):
    data = batches(n, 16)
    for i in at:
        data[i] = (data[i][0] * float("inf"), data[i][1])
    return data


@pytest.mark.parametrize("warmup", [None, 10.0])
def test_skipped_fp16_steps_do_not_advance_the_average_in_either_order(warmup):
    torch.manual_seed(0)
    model = LayerNormNet()
    data = _with_overflow()
    outer = fasttorch.ema(fasttorch.with_amp(fasttorch.step(mse), "fp16"), 0.8, warmup=warmup)
    inner = fasttorch.with_amp(fasttorch.ema(fasttorch.step(mse), 0.8, warmup=warmup), "fp16")
    a, b = _run(outer, model, data), _run(inner, model, data)
    assert int(a.substates["amp"].skipped_total) == 2
    assert int(a.substates["ema"].count) == int(b.substates["ema"].count) == 6
    for k in a.params:
        assert torch.equal(a.substates["ema"].params[k], b.substates["ema"].params[k]), k
        assert torch.equal(a.params[k], b.params[k]), k
    ref, ref_ema, t = _reference(model, data, 0.8, warmup=warmup, fp16=True)
    assert t == 6
    atol = _atol(model, data, a, precision="fp16", steps=t, lr=LR)  # rules 2 + 4
    _assert_close(a.params, ref, rtol=0, atol=atol)
    _assert_close(a.substates["ema"].params, ref_ema, rtol=0, atol=atol)


def test_compiles_whole_no_breaks_no_recompiles_over_20_steps():
    torch.manual_seed(0)
    model = LayerNormNet()
    data = _with_overflow(20, at=(7,))
    s = fasttorch.clip_scaled(
        fasttorch.ema(fasttorch.with_amp(fasttorch.step(mse), "fp16"), 0.9, warmup=10.0), 1.0
    )
    fast = _run(fasttorch.compiled(s, backend="aot_eager"), model, data)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    eager = _run(s, model, data)
    assert int(fast.substates["ema"].count) == 19
    for k in eager.params:
        # Rule 1: aot_eager runs the eager step's operations, in the same order.
        torch.testing.assert_close(
            fast.substates["ema"].params[k], eager.substates["ema"].params[k], **EXACT
        )


def test_the_average_is_a_checkpointable_pytree_leaf():
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(6, 16)
    s = fasttorch.ema(fasttorch.step(mse), 0.9, warmup=10.0)
    state = _run(s, model, data[:3])
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(state)[0]]
    assert ".substates['ema'].params['out.weight']" in paths
    assert ".substates['ema'].count" in paths
    # Save the leaves, load them into a fresh state of the same structure, continue.
    buf = io.BytesIO()
    torch.save(pytree.tree_leaves(state), buf)
    buf.seek(0)
    fresh = s.init(fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(1e-2)))
    _, spec = pytree.tree_flatten(fresh)
    restored = pytree.tree_unflatten(torch.load(buf), spec)
    for b in data[3:]:
        state, _ = s(state, b)
        restored, _ = s(restored, b)
    for k in state.params:
        assert torch.equal(state.substates["ema"].params[k], restored.substates["ema"].params[k])


def test_wrap_time_errors():
    plain = fasttorch.step(mse)
    with pytest.raises(ValueError, match=r"ema: decay must be in \[0, 1\).*got decay=1.0"):
        fasttorch.ema(plain, 1.0)
    with pytest.raises(TypeError, match="decay must be a number"):
        fasttorch.ema(plain, "0.9")
    with pytest.raises(ValueError, match="warmup must be None or a finite number > 1"):
        fasttorch.ema(plain, 0.9, warmup=1)
    with pytest.raises(ValueError, match="ema is already applied"):
        fasttorch.ema(fasttorch.ema(plain, 0.9), 0.9)
    with pytest.raises(ValueError, match=r"compiled must be the outermost.*compiled\(ema\("):
        fasttorch.ema(fasttorch.compiled(plain), 0.9)
    with pytest.raises(TypeError, match="ema wraps the phases"):
        fasttorch.ema(lambda state, batch: (state, {}), 0.9)
