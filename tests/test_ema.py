"""ema: equals a hand-written lerp_ loop, timm ModelEmaV3 and torchvision's EMA (BatchNorm
buffers included), skips fp16 overflows and optim.every's idle calls, compiles."""

from __future__ import annotations

import copy
import io
import math

import pytest
import tolerance
import torch
import torch.utils._pytree as pytree
from reference import LayerNormNet, batches, mse
from tolerance import EXACT, fp32_reference_error, params_atol

import fasttorch
from fasttorch.evaluation import eval_step

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


# --------------------------------------------------------------------------- the oracles
#
# Neither timm nor torchvision is installed here. The two classes below are ports of
# theirs, written to run the same tensor operations in the same order (so the
# comparisons can be exact where fasttorch runs those operations too):
#
# * timm ``ModelEmaV3``: huggingface/pytorch-image-models, timm/utils/model_ema.py at
#   commit 7479d451a6dfd8af27f941b8e82a7402461fae80 (``get_decay``, ``apply_update_``
#   on the foreach path, ``apply_update_no_buffers_``); its train.py calls
#   ``model_ema.update(model, step=num_updates)`` after ``num_updates += 1``.
# * torchvision ``ExponentialMovingAverage``: pytorch/vision,
#   references/classification/utils.py (an ``AveragedModel`` with
#   ``avg_fn = decay * avg + (1 - decay) * model`` and ``use_buffers=True``), driven as
#   references/classification/train.py does (``--model-ema-steps``, the ``n_averaged``
#   reset during the warm-up epochs). It subclasses torch's own
#   ``torch.optim.swa_utils.AveragedModel``, used here as it is.


class TimmModelEmaV3(torch.nn.Module):
    """timm.utils.ModelEmaV3 (foreach path, same device): a deep copy in eval mode."""

    def __init__(
        self,
        model,
        decay=0.9999,
        min_decay=0.0,
        update_after_step=0,
        use_warmup=False,
        warmup_gamma=1.0,
        warmup_power=2 / 3,
        exclude_buffers=False,
    ):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_warmup, self.warmup_gamma = use_warmup, warmup_gamma
        self.warmup_power, self.exclude_buffers = warmup_power, exclude_buffers

    def get_decay(self, step=None):
        if step is None:
            return self.decay
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if not self.use_warmup:
            return self.decay
        decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
        return max(min(decay, self.decay), self.min_decay)

    @torch.no_grad()
    def update(self, model, step=None):
        decay = self.get_decay(step)
        if self.exclude_buffers:
            ema = tuple(self.module.parameters())
            torch._foreach_lerp_(ema, tuple(model.parameters()), weight=1.0 - decay)
            for ema_b, model_b in zip(self.module.buffers(), model.buffers()):
                ema_b.copy_(model_b)
            return
        ema_lerp, model_lerp = [], []
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_lerp.append(ema_v)
                model_lerp.append(model_v)
            else:
                ema_v.copy_(model_v)
        torch._foreach_lerp_(ema_lerp, model_lerp, weight=1.0 - decay)


class TorchvisionEMA(torch.optim.swa_utils.AveragedModel):
    """torchvision's references/classification ExponentialMovingAverage."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


class SmallCNN(torch.nn.Module):
    """Conv, BatchNorm (running statistics as buffers), pooling and a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean((2, 3)))


def _images(n, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, 6, 6, generator=g), torch.randn(size, 4, generator=g))
        for _ in range(n)
    ]


SGD = {"lr": 0.05, "momentum": 0.9}
EPOCH, EMA_STEPS, WARMUP_EPOCHS = 4, 2, 1  # torchvision's recipe: 4 steps per epoch


def _timm_recipe():
    """ModelEmaV3 with its warm-up, one update per optimizer step (timm's train.py)."""
    kwargs = {
        "decay": 0.99,
        "use_warmup": True,
        "warmup_power": 0.75,
        "warmup_gamma": 2.0,
        "min_decay": 0.3,
        "update_after_step": 2,
    }

    def update(oracle, model, i):
        oracle.update(model, step=i + 1)  # num_updates, counted after the update

    wrap = lambda s: fasttorch.ema(  # noqa: E731
        s, 0.99, warmup_power=0.75, warmup_gamma=2.0, min_decay=0.3, copy_first=3
    )
    return (lambda m: TimmModelEmaV3(m, **kwargs)), update, wrap


def _torchvision_recipe():
    """ExponentialMovingAverage every EMA_STEPS steps, copying in the warm-up epochs."""
    adjust = 1 * 8 * EMA_STEPS / 6  # world_size * batch_size * model_ema_steps / epochs
    alpha = min(1.0, (1.0 - 0.99) * adjust)

    def update(oracle, model, i):
        epoch, step_in_epoch = divmod(i, EPOCH)
        if step_in_epoch % EMA_STEPS == 0:
            oracle.update_parameters(model)
            if epoch < WARMUP_EPOCHS:
                oracle.n_averaged.fill_(0)

    copies = WARMUP_EPOCHS * math.ceil(EPOCH / EMA_STEPS) + 1
    wrap = lambda s: fasttorch.ema(s, 1.0 - alpha, every=EMA_STEPS, copy_first=copies)  # noqa: E731
    return (lambda m: TorchvisionEMA(m, 1.0 - alpha)), update, wrap


RECIPES = {"timm": _timm_recipe, "torchvision": _torchvision_recipe}


def _oracle_run(name, model, data, held, dtype=torch.float32):
    """torch.optim.SGD on a deep copy, and the oracle updated as its training script does;
    returns the oracle's averaged module (float entries) and its evaluated loss."""
    make, update, _ = RECIPES[name]()
    model = copy.deepcopy(model).to(dtype)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    oracle = make(model)
    for i, (x, y) in enumerate(data):
        mse(model, (x.to(dtype), y.to(dtype))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update(oracle, model, i)
    module = oracle.module.eval()
    with torch.no_grad():
        loss = mse(module, (held[0].to(dtype), held[1].to(dtype)))
    return module, loss


def _ema_tensors(state):
    sub = state.substates["ema"]
    return {**sub.params, **sub.buffers}


@pytest.mark.parametrize("how", ["eager", "compiled"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_equals_the_timm_and_torchvision_averages_with_batchnorm(name, how):
    """A CNN with BatchNorm trained 12 steps by torch.optim.SGD with timm's ModelEmaV3
    (warm-up, update_after_step) or torchvision's recipe (every 2 steps, copies during
    the first epoch) beside it: fasttorch's average holds the same parameters and
    running statistics, and eval_step(use_ema=True) gives the oracle module's loss."""
    torch.manual_seed(0)
    model = SmallCNN()
    data, held = _images(12), _images(1, size=16, seed=7)[0]
    _, _, wrap = RECIPES[name]()
    step = wrap(fasttorch.step(mse))
    run = fasttorch.compiled(step, backend="aot_eager") if how == "compiled" else step
    state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.sgd(**SGD))
    for b in data:
        state, _ = run(state, b)
    evaluate = eval_step(step, use_ema=True)
    if how == "compiled":
        evaluate = fasttorch.compiled(evaluate, backend="aot_eager")
        assert not counters["graph_break"]
        assert sum(counters["recompiles"].values()) == 0
    loss = evaluate(state, held)["loss"]

    ref, ref_loss = _oracle_run(name, model, data, held)
    ref64, ref_loss64 = _oracle_run(name, model, data, held, torch.float64)
    expected = {k: v for k, v in ref.state_dict().items() if v.is_floating_point()}
    # Rule 2: the oracle loop's own fp32 error against its float64 run, on every averaged
    # parameter and buffer (fasttorch's SGD, backward and average compute the same
    # mathematics in another order; torchvision's average is d * a + (1 - d) * m where
    # fasttorch's is a lerp).
    errors = {
        k: float((v.double() - ref64.state_dict()[k]).abs().max()) for k, v in expected.items()
    }
    atol = params_atol(errors, expected)
    ours = _ema_tensors(state)
    assert set(ours) >= set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(ours[k], v, rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    # num_batches_tracked: timm copies it; torchvision averages it as a float and
    # truncates it into the integer buffer. fasttorch copies it, the model's own count.
    # The model's count at the average's last update (after batch 11, or 10 every 2).
    last = max(i for i in range(len(data)) if name == "timm" or i % EMA_STEPS == 0) + 1
    assert int(ours["bn.num_batches_tracked"]) == last
    assert int(state.buffers["bn.num_batches_tracked"]) == len(data)
    if name == "timm":
        assert int(ref.state_dict()["bn.num_batches_tracked"]) == last
    u = tolerance.unit_roundoff(torch.float32)
    loss_bound = tolerance.FACTOR * max(
        abs(float(ref_loss) - float(ref_loss64)), u * float(ref_loss)
    )
    assert abs(float(loss) - float(ref_loss)) <= loss_bound, (
        float(loss),
        float(ref_loss),
        loss_bound,
    )
    # The average is not the live model, and its statistics are not the live ones.
    gap = (ours["bn.running_var"] - state.buffers["bn.running_var"]).abs().max()
    assert float(gap) > atol
    live = eval_step(step)(state, held)["loss"]
    assert abs(float(live) - float(loss)) > loss_bound


@pytest.mark.parametrize("buffers", ["average", "copy"])
def test_each_update_is_timm_model_ema_v3_bit_for_bit(buffers):
    """Fed the step's own model after every call, ModelEmaV3 (update_after_step=1,
    use_warmup, exclude_buffers for "copy") and the step's average agree bit for bit,
    parameters and buffers, and so does the loss evaluated on each."""
    torch.manual_seed(0)
    model = SmallCNN()
    step = fasttorch.ema(
        fasttorch.step(mse), 0.95, warmup_power=2 / 3, min_decay=0.2, copy_first=2, buffers=buffers
    )
    state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(1e-2))
    oracle = TimmModelEmaV3(
        model,
        decay=0.95,
        min_decay=0.2,
        update_after_step=1,
        use_warmup=True,
        exclude_buffers=buffers == "copy",
    )
    live = copy.deepcopy(model)
    held = _images(1, size=16, seed=3)[0]
    evaluate = eval_step(step, use_ema=True)
    for i, b in enumerate(_images(8)):
        state, _ = step(state, b)
        live.load_state_dict(state.state_dict())
        oracle.update(live, step=i + 1)
        ours = _ema_tensors(state)
        for k, v in oracle.module.state_dict().items():
            # Rule 1: the same lerp (weight 1 - d, d in float64 rounded once) on the
            # same tensors; copies are copies.
            torch.testing.assert_close(ours[k], v, **EXACT, msg=lambda m, k=k, i=i: f"{i} {k}: {m}")
        with torch.no_grad():
            expected = mse(oracle.module, held)
        # Rule 1: the same module forward on the same tensors (test_evaluation.py).
        torch.testing.assert_close(evaluate(state, held)["loss"], expected, **EXACT)
    assert int(state.substates["ema"].count) == 8


def test_no_average_while_optim_every_does_not_step():
    """Under fasttorch.optim.every(sgd, 2) the optimizer steps on every second call; the
    average moves only then, as ModelEmaV3.update after each opt.step() does."""
    torch.manual_seed(0)
    model = SmallCNN()
    step = fasttorch.ema(fasttorch.step(mse), 0.8)
    opt = fasttorch.optim.every(fasttorch.optim.sgd(**SGD), 2)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    oracle, live = TimmModelEmaV3(model, decay=0.8), copy.deepcopy(model)
    for i, b in enumerate(_images(6)):
        state, _ = step(state, b)
        if i % 2 == 1:  # the optimizer stepped
            live.load_state_dict(state.state_dict())
            oracle.update(live)  # no step=: the constant decay, as fasttorch.ema(step, d)
    assert int(state.substates["ema"].count) == 3
    ours = _ema_tensors(state)
    for k, v in oracle.module.state_dict().items():
        torch.testing.assert_close(ours[k], v, **EXACT, msg=lambda m, k=k: f"{k}: {m}")  # rule 1


def test_without_buffers_evaluation_says_it_uses_the_live_ones():
    torch.manual_seed(0)
    step = fasttorch.ema(fasttorch.step(mse), 0.9, buffers=None)
    state = fasttorch.TrainState.create(SmallCNN(), fasttorch.optim.sgd(**SGD))
    with pytest.warns(UserWarning, match=r"ema\(buffers=None\): the model has buffers \(bn"):
        state = step.init(state)
    assert state.substates["ema"].buffers == {}
    for b in _images(3):
        state, _ = step(state, b)
    held = _images(1, seed=5)[0]
    with pytest.warns(
        UserWarning,
        match=r"keeps no average of the buffers bn.running_mean.*"
        r"buffers='average'",
    ):
        loss = eval_step(step, use_ema=True)(state, held)["loss"]
    ref = copy.deepcopy(state.module)
    ref.load_state_dict({**state.state_dict(), **state.substates["ema"].params})
    with torch.no_grad():
        torch.testing.assert_close(loss, mse(ref.eval(), held), **EXACT)  # rule 1


def test_an_average_with_buffers_round_trips_through_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN()
    step = fasttorch.ema(fasttorch.step(mse), 0.9, every=2, copy_first=1)
    data = _images(6)
    state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.sgd(**SGD))
    for b in data[:3]:
        state, _ = step(state, b)
    path = fasttorch.checkpoint.save(tmp_path, state)
    template = step.init(fasttorch.TrainState.create(SmallCNN(), fasttorch.optim.sgd(**SGD)))
    restored, _ = fasttorch.checkpoint.load(path, template)
    for b in data[3:]:
        state, _ = step(state, b)
        restored, _ = step(restored, b)
    a, b = _ema_tensors(state), _ema_tensors(restored)
    assert "bn.running_mean" in a and set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # rule 1: the same run, resumed
    assert int(state.substates["ema"].count) == int(restored.substates["ema"].count) == 3


def test_new_options_are_checked_at_wrap_time():
    plain = fasttorch.step(mse)
    with pytest.raises(ValueError, match=r"buffers must be 'average' .*got buffers='mean'"):
        fasttorch.ema(plain, 0.9, buffers="mean")
    with pytest.raises(ValueError, match=r"two warm-up rules; give one"):
        fasttorch.ema(plain, 0.9, warmup=10.0, warmup_power=0.75)
    with pytest.raises(ValueError, match=r"warmup_gamma=2.0 scales timm's warm-up.*warmup_power"):
        fasttorch.ema(plain, 0.9, warmup_gamma=2.0)
    with pytest.raises(
        ValueError, match=r"min_decay must be in \[0, decay=0.9\], got min_decay=0.95"
    ):
        fasttorch.ema(plain, 0.9, warmup_power=0.75, min_decay=0.95)
    with pytest.raises(ValueError, match=r"min_decay=0.5 bounds a warm-up's decay.*no warm-up"):
        fasttorch.ema(plain, 0.9, min_decay=0.5)
    with pytest.raises(ValueError, match=r"every must be an integer >= 1, got 0"):
        fasttorch.ema(plain, 0.9, every=0)
    with pytest.raises(ValueError, match=r"copy_first must be an integer >= 0, got -1"):
        fasttorch.ema(plain, 0.9, copy_first=-1)
    with pytest.raises(ValueError, match=r"warmup_power must be finite and > 0"):
        fasttorch.ema(plain, 0.9, warmup_power=0)
