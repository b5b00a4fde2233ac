"""grad_accumulate: the mean over every sample or token of the window, whatever the split."""

from __future__ import annotations

import pytest
import torch
from reference import LayerNormNet, batches, mse, reference_run
from tolerance import EXACT, fp32_reference_error, params_atol, split_mean_atol
from torch import nn

import fasttorch


def _model():
    torch.manual_seed(0)
    return LayerNormNet()


def _state(opt=None):
    # opaque=False: the tests here hold a donated step to the copying path's bits, which
    # the _foreach form gives both; a donated CPU step's default is torch's fused kernel
    # (docs/optimizers.md, "Opaque update"; tests/test_opaque_update.py).
    return fasttorch.TrainState.create(_model(), opt or fasttorch.optim.sgd(0.1, opaque=False))


def _one_step_atol(batch, loss_fn=mse):
    """Rule 2: a window's gradient summed per microbatch and over the whole batch are two
    orders of one sum; the bound is the fp32 loop's own error in that one SGD step."""
    errors = fp32_reference_error(
        _model(),
        [[batch]],
        make_opt=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=lambda apply, b: _value(loss_fn(apply, b)),
    )
    return params_atol(errors, _state().params)


def _value(loss):
    return loss.value if isinstance(loss, fasttorch.Loss) else loss


def _params(state):
    return {k: v.clone() for k, v in state.params.items()}


def _close(a, b, *, rtol, atol):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_unequal_microbatches_equal_one_full_batch_step(mode):
    batch = batches(1, 30)[0]  # tensor_split(4): 8, 8, 7, 7 rows
    full, _ = fasttorch.step(mse, donate=False)(_state(), batch)
    step = fasttorch.grad_accumulate(fasttorch.step(mse, donate=False), 4)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
    acc, m = step(_state(), batch)
    _close(_params(acc), _params(full), rtol=0, atol=_one_step_atol(batch))
    x, y = batch
    with torch.no_grad():
        terms = (_state().apply(x) - y).square() / y.numel()
    atol = split_mean_atol(terms)  # rule 3: one mean, summed whole and in 4 parts
    torch.testing.assert_close(m["loss"], mse(_state().apply, batch), rtol=0, atol=atol)


def test_unequal_microbatches_match_the_weighted_reference_loop():
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(5, 30)
    windows = [list(zip(x.tensor_split(4), y.tensor_split(4))) for x, y in data]
    ref, _ = reference_run(
        model,
        windows,
        weight=lambda mb: len(mb[0]),
        make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2),
        clip=1.0,
    )
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2, weight_decay=1e-2))
    step = fasttorch.clip_scaled(fasttorch.grad_accumulate(fasttorch.step(mse), 4), 1.0)
    for b in data:
        state, _ = step(state, b)
    # Weights of 8/30 and 7/30 are not powers of two, so the two sides round differently:
    # the bound is the fp32 reference loop's own error against float64 (tests/README.md).
    errors = fp32_reference_error(
        model,
        windows,
        weight=lambda mb: len(mb[0]),
        make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2),
        clip=1.0,
    )
    atol = params_atol(errors, dict(ref.named_parameters()))
    for k, p in ref.named_parameters():
        torch.testing.assert_close(state.params[k], p.detach(), rtol=0, atol=atol)


def _token_loss(apply, batch):
    x, y, mask = batch
    per_token = (apply(x) - y).pow(2).mean(-1)  # (rows,)
    count = mask.sum()
    return fasttorch.Loss((per_token * mask).sum() / count, weight=count)


def _token_batch(rows=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)
    mask = torch.zeros(rows)
    mask[:3] = 1  # the first microbatch has 3 tokens, the others 8 each
    mask[8:] = 1
    return x, y, mask


def test_token_weighted_loss_equals_the_global_token_mean():
    batch = _token_batch()
    full, _ = fasttorch.step(_token_loss, donate=False)(_state(), batch)
    acc, m = fasttorch.grad_accumulate(fasttorch.step(_token_loss, donate=False), 4)(
        _state(), batch
    )
    _close(_params(acc), _params(full), rtol=0, atol=_one_step_atol(batch, _token_loss))
    x, y, mask = batch
    with torch.no_grad():
        per_token = (_state().apply(x) - y).pow(2).mean(-1)
    expected = (per_token * mask).sum() / mask.sum()
    atol = split_mean_atol(per_token * mask / mask.sum())  # rule 3, as above
    torch.testing.assert_close(m["loss"], expected, rtol=0, atol=atol)


def test_the_naive_loss_over_n_differs_so_the_check_has_teeth():
    batch = _token_batch()

    def naive(apply, b):  # the 2024 bug: each microbatch's mean, divided by n
        return fasttorch.Loss(_token_loss(apply, b).value, weight=1.0)

    full, _ = fasttorch.step(_token_loss, donate=False)(_state(), batch)
    bad, _ = fasttorch.grad_accumulate(fasttorch.step(naive, donate=False), 4)(_state(), batch)
    diff = max((bad.params[k] - full.params[k]).abs().max().item() for k in full.params)
    assert diff > _one_step_atol(batch, _token_loss)  # the bound the tests above use


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_across_calls_updates_on_the_nth_call_only(mode):
    step = fasttorch.grad_accumulate(fasttorch.step(_token_loss), 4, across_calls=True)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
    state = _state()
    start = _params(state)
    full = _token_batch(seed=3)
    micro = [tuple(t[i * 8 : (i + 1) * 8] for t in full) for i in range(4)]
    for i, mb in enumerate(micro[:3]):
        state, m = step(state, mb)
        assert set(m) == {"loss"} and int(state.step) == 0
        assert state.substates["grad_accumulate"].micro == i + 1
        _close(_params(state), start, **EXACT)
    state, m = step(state, micro[3])
    assert int(state.step) == 1 and state.substates["grad_accumulate"].micro == 0
    assert all(float(g.abs().sum()) == 0 for g in state.substates["grad_accumulate"].grads.values())
    ref, _ = fasttorch.step(_token_loss, donate=False)(_state(), full)
    _close(_params(state), _params(ref), rtol=0, atol=_one_step_atol(full, _token_loss))
    if mode == "compiled":
        stats = torch._dynamo.utils.counters["stats"]
        assert stats["unique_graphs"] <= 2


def test_across_calls_compiles_two_graphs_and_never_recompiles():
    step = fasttorch.compiled(
        fasttorch.grad_accumulate(
            fasttorch.with_amp(fasttorch.step(mse), "fp16"), 3, across_calls=True
        ),
        backend="aot_eager",
    )
    schedule = fasttorch.schedules.cosine(1e-2, 10)
    state = _state(fasttorch.optim.adamw(schedule, opaque=False))  # the update traced
    for b in batches(12, 8):
        state, _ = step(state, b)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 2
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    assert int(state.step) == 4


def test_within_call_compiles_two_graphs():
    step = fasttorch.compiled(
        fasttorch.grad_accumulate(fasttorch.step(mse), 4), backend="aot_eager"
    )
    state = _state()
    for b in batches(5, 32):
        state, _ = step(state, b)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_the_model_is_compiled_once_with_accumulation():
    """One graph runs the microbatch (every one of them); the other only updates."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(gm)
        return gm.forward

    step = fasttorch.compiled(
        fasttorch.clip_scaled(fasttorch.grad_accumulate(fasttorch.step(mse), 4), 1.0),
        backend=backend,
    )
    state = _state(fasttorch.optim.adamw(1e-2, opaque=False))  # the update traced
    for b in batches(3, 32):
        state, _ = step(state, b)

    def count(gm: torch.fx.GraphModule, targets: tuple[object, ...]) -> int:
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)

    model_ops = (torch._C._nn.linear, torch.nn.functional.linear, torch.nn.functional.layer_norm)
    assert len(graphs) == 2
    micro, close = graphs
    assert count(micro, model_ops) > 0 and count(close, model_ops) == 0

    def methods(gm: torch.fx.GraphModule, name: str) -> int:
        return sum(1 for n in gm.graph.nodes if n.op == "call_method" and n.target == name)

    # On CPU Adam's graph is one _foreach call per operation (its factors computed
    # once): the denominators in one _foreach_sqrt, and lerp per tensor (inductor lowers
    # it; _foreach_lerp with tensor weights would be an ATen call needing the clipped
    # gradients materialized)
    n = len(state.params)
    assert methods(close, "sqrt") == 1 and methods(micro, "sqrt") == 0  # bias correction
    assert count(close, (torch._foreach_sqrt,)) == 1
    assert methods(close, "lerp") == n
    assert count(close, (torch._foreach_lerp_, torch._foreach_lerp)) == 0


def test_disabled_and_bad_arguments():
    s = fasttorch.step(mse)
    assert fasttorch.grad_accumulate(s, 1) is s
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="integer >= 1"):
            fasttorch.grad_accumulate(s, bad)
    with pytest.raises(TypeError, match="across_calls must be a bool"):
        fasttorch.grad_accumulate(s, 2, across_calls="yes")


def test_batchnorm_sees_each_microbatch():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8), nn.Linear(8, 4))
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    state, _ = fasttorch.grad_accumulate(fasttorch.step(mse), 4)(state, batches(1, 32)[0])
    assert int(state.buffers["1.num_batches_tracked"]) == 4


def test_eager_window_accumulates_in_grad_and_hands_it_back():
    """Donated and eager, the window lives in the module's .grad during the call only."""
    state = _state()
    model = state.module
    sentinel = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = sentinel[n]
    step = fasttorch.grad_accumulate(fasttorch.step(mse), 4)
    copy_state = _state()
    ref_step = fasttorch.grad_accumulate(fasttorch.step(mse, donate=False), 4)
    for b in batches(3, 32):
        state, m = step(state, b)
        copy_state, m_ref = ref_step(copy_state, b)
        assert torch.equal(m["loss"], m_ref["loss"])
        assert torch.equal(m["grad_norm"], m_ref["grad_norm"])
    # The copying path (autograd.grad into a window) gives the same bits.
    for k, v in state.params.items():
        assert torch.equal(v, copy_state.params[k]), k
    for n, p in model.named_parameters():
        assert p.grad is sentinel[n] and bool((p.grad == 7.0).all()), "the user's .grad kept"
    assert "scratch" not in step.memo("grad_accumulate"), "no window kept between calls"


def test_eager_window_in_grad_restores_grad_on_error():
    state = _state()

    def failing(apply, batch):
        if batch[0].shape[0] < 8:
            raise RuntimeError("boom")
        return mse(apply, batch)

    step = fasttorch.grad_accumulate(fasttorch.step(failing), 4)
    x, y = batches(1, 31)[0]  # 8, 8, 8, 7 rows: the last microbatch raises
    module = state.module  # the donated state is dead after the failed call
    with pytest.raises(RuntimeError, match="boom"):
        step(state, (x, y))
    assert all(p.grad is None for p in module.parameters())


def _backward_inputs_seen(monkeypatch):
    seen = []
    real = torch.autograd.backward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("inputs"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", spy)
    return seen


def test_eager_window_backward_is_the_plain_loops_where_only_parameters_need_grads(
    monkeypatch,
):
    """No inputs= (the engine's marking pass costs the small MLP 2-4% of a step) when the
    backward can reach nothing but the state's parameters; the same bits as the
    copying path either way (test above)."""
    seen = _backward_inputs_seen(monkeypatch)
    state = _state()
    step = fasttorch.grad_accumulate(fasttorch.step(mse), 4)
    for b in batches(2, 32):
        state, _ = step(state, b)
    assert len(seen) == 8 and all(s is None for s in seen), seen


@pytest.mark.parametrize("other", ["closure", "batch", "unfrozen"])
def test_eager_window_gives_no_grad_to_tensors_outside_the_state(monkeypatch, other):
    """A tensor that requires grad but is not one of the state's parameters (read by the
    loss, passed in the batch, or a module parameter unfrozen after the state was made)
    gets no .grad, and the parameters get the copying path's bits."""
    seen = _backward_inputs_seen(monkeypatch)
    x, y = batches(1, 32)[0]
    extra = torch.ones((), requires_grad=True)

    def loss_fn(apply, batch):
        loss = mse(apply, batch)
        return loss * extra if other == "closure" else loss

    def make(donate):
        torch.manual_seed(0)
        model = LayerNormNet()
        last = list(model.parameters())[-1]
        if other == "unfrozen":
            last.requires_grad_(False)
        state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1, opaque=False))
        if other == "unfrozen":
            last.requires_grad_(True)
        return state, last

    state, unfrozen = make(donate=True)
    ref_state, _ = make(donate=False)
    batch = (x.clone().requires_grad_(), y) if other == "batch" else (x, y)
    state, _ = fasttorch.grad_accumulate(fasttorch.step(loss_fn), 4)(state, batch)
    ref_step = fasttorch.grad_accumulate(fasttorch.step(loss_fn, donate=False), 4)
    ref_state, _ = ref_step(ref_state, (x, y))
    assert seen and all(s is not None for s in seen), "the parameters were passed as inputs"
    outside = {"closure": extra, "batch": batch[0], "unfrozen": unfrozen}[other]
    assert outside.grad is None
    for k, v in state.params.items():
        assert torch.equal(v, ref_state.params[k]), k
