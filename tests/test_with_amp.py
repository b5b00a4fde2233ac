"""with_amp: autocast, the fp16 dynamic loss scale, skipping non-finite steps."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
from reference import LayerNormNet, batches, mse, reference_run

import fasttorch

# The module, not the function of the same name that the package re-exports.
amp_mod = importlib.import_module("fasttorch.transforms.with_amp")


def _state(model=None, lr=1e-2):
    torch.manual_seed(0)
    return fasttorch.TrainState.create(model or LayerNormNet(), fasttorch.optim.adamw(lr))


def _leaves(tree):
    return [t.clone() for t in torch.utils._pytree.tree_leaves(tree)]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_overflow_skips_update_and_halves_scale(mode):
    state = fasttorch.with_amp(fasttorch.step(mse), "fp16").init(_state())
    step = fasttorch.with_amp(fasttorch.step(mse), "fp16")
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    x, y = batches(1, 16)[0]
    state, m = step(state, (x, y))  # one good step, so the optimizer state is not zeros
    before = _leaves((state.params, state.opt_state))
    bad = x.clone()
    bad[3, 2] = float("inf")
    state, m = step(state, (bad, y))
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**16
    for old, new in zip(before, torch.utils._pytree.tree_leaves((state.params, state.opt_state))):
        assert torch.equal(old, new)
    ls = state.substates["amp"]
    assert float(ls.scale) == 2.0**15
    assert (
        int(ls.skipped_total) == 1 and int(ls.skipped_in_a_row) == 1 and int(ls.growth_tracker) == 0
    )
    assert int(state.step) == 2  # the step counter (and schedules) advance; Adam's count does not
    assert int(state.opt_state.count) == 1
    state, m = step(state, (x, y))
    assert not bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**15
    assert int(state.substates["amp"].skipped_in_a_row) == 0
    assert int(state.substates["amp"].skipped_total) == 1


def test_nan_loss_is_skipped_too():
    step = fasttorch.with_amp(fasttorch.step(mse, donate=False), "fp16")
    state = step.init(_state())
    x, y = batches(1, 8)[0]
    y = y.clone()
    y[0, 0] = float("nan")
    new, m = step(state, (x, y))
    assert bool(m["skipped"])
    assert all(torch.equal(a, b) for a, b in zip(state.params.values(), new.params.values()))


def test_scale_grows_after_growth_interval():
    step = fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=8.0, growth_interval=3)
    state = _state()
    scales = []
    for b in batches(7, 8):
        state, m = step(state, b)
        scales.append(float(m["loss_scale"]))
    assert scales == [8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0]


def test_scale_options_match_gradscaler():
    opts = {
        "init_scale": 2.0**24,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 2,
    }
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(8, 16)
    ref, log = reference_run(
        model,
        [[b] for b in data],
        precision="fp16",
        scaler_kwargs=opts,
        make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    step = fasttorch.with_amp(fasttorch.step(mse), "fp16", **opts)
    state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(1e-2))
    scales = []
    for b in data:
        state, m = step(state, b)
        scales.append(float(m["loss_scale"]))
    assert scales == [r["scale"] for r in log]
    assert scales[1] < scales[0] and max(scales[1:]) > min(scales), "backoff and growth both seen"


def test_bf16_autocasts_the_forward_and_keeps_no_scale():
    seen = {}

    def loss_fn(apply, batch):
        x, y = batch
        out = apply(x)
        seen["dtype"] = out.dtype
        return torch.nn.functional.mse_loss(out.float(), y)

    step = fasttorch.with_amp(fasttorch.step(loss_fn), "bf16")
    state, m = step(_state(), batches(1, 8)[0])
    assert seen["dtype"] == torch.bfloat16
    assert "amp" not in state.substates and "loss_scale" not in m
    assert state.params["inp.weight"].dtype == torch.float32  # master weights stay fp32


def test_auto_warns_once_with_its_reason(monkeypatch):
    amp_mod.warn_once.cache_clear()
    monkeypatch.setattr(amp_mod, "_native_bf16", lambda dev: (False, "no native bf16 here"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s1 = fasttorch.with_amp(fasttorch.step(mse), "auto", device_type="cpu")
        fasttorch.with_amp(fasttorch.step(mse), "auto", device_type="cpu")
    msgs = [str(w.message) for w in caught if "with_amp('auto')" in str(w.message)]
    assert msgs == [
        "with_amp('auto') chose fp16 on cpu: no native bf16 here; fp16 adds a dynamic loss scale"
    ]
    assert "amp" in s1.init(_state()).substates
    amp_mod.warn_once.cache_clear()
    monkeypatch.setattr(amp_mod, "_native_bf16", lambda dev: (True, "native"))
    with pytest.warns(UserWarning, match="chose bf16 on cpu: native"):
        s2 = fasttorch.with_amp(fasttorch.step(mse), "auto", device_type="cpu")
    assert "amp" not in s2.init(_state()).substates
    amp_mod.warn_once.cache_clear()


def test_auto_refuses_a_state_on_another_device():
    amp_mod.warn_once.cache_clear()
    with pytest.warns(UserWarning):
        step = fasttorch.with_amp(fasttorch.step(mse), "auto", device_type="meta")
    with pytest.raises(ValueError, match="pass device_type='cpu'"):
        step(_state(), batches(1, 8)[0])
    amp_mod.warn_once.cache_clear()


def test_bad_arguments():
    with pytest.raises(ValueError, match="'bf16', 'fp16' or 'auto'"):
        fasttorch.with_amp(fasttorch.step(mse), "float16")
    with pytest.raises(ValueError, match="backoff_factor"):
        fasttorch.with_amp(fasttorch.step(mse), "fp16", backoff_factor=2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        fasttorch.with_amp(fasttorch.step(mse), "fp16", growth_interval=0)
    with pytest.raises(ValueError, match="min_scale"):
        fasttorch.with_amp(fasttorch.step(mse), "fp16", min_scale=0.0)
    with pytest.raises(ValueError, match=r"min_scale=4.0 is above init_scale=2.0"):
        fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=2.0, min_scale=4.0)


def _nan_batch():
    x, y = batches(1, 8)[0]
    return x, torch.full_like(y, float("nan"))


def test_the_default_floor_keeps_the_scale_above_zero_and_warns_once():
    # GradScaler's rule alone halves 2**16 to 0 after about 165 non-finite steps, and
    # every later step is skipped silently.
    step = fasttorch.with_amp(fasttorch.step(mse), "fp16")
    state = _state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(180):
            state, _ = step(state, _nan_batch())
    assert float(state.substates["amp"].scale) == 2.0**-24
    said = [str(w.message) for w in caught if "floor" in str(w.message)]
    assert len(said) == 1, said
    assert "min_scale=5.96046e-08" in said[0] and "skip_nonfinite" in said[0]
    state, m = step(state, batches(1, 8)[0])  # a finite batch still trains from the floor
    assert not bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**-24


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_the_scale_stops_at_min_scale_and_the_warning_comes_one_call_late(mode):
    step = fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=1.0, min_scale=0.25)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    state = _state()
    scales, warned = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            state, m = step(state, _nan_batch())
            scales.append(float(m["loss_scale"]))
            warned.append(len([w for w in caught if "floor" in str(w.message)]))
    assert scales == [1.0, 0.5, 0.25, 0.25, 0.25]
    assert float(state.substates["amp"].scale) == 0.25
    # Call 2 sets the floor; call 3 reads it before it runs and says so, once.
    assert warned == [0, 0, 1, 1, 1]
    assert "fell to its floor min_scale=0.25" in str(caught[-1].message)
