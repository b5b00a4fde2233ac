"""skip_nonfinite: skip inf/NaN updates in every precision, count them, stop after N."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import fasttorch
from fasttorch import checkpoint
from fasttorch.transforms.skip_nonfinite import NonFiniteError, SkipBuffers

NAN = float("nan")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def loss_fn(apply, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(apply(x).float(), y)


def make():
    torch.manual_seed(0)
    return fasttorch.TrainState.create(torch.nn.Linear(4, 2), fasttorch.optim.adam(0.1))


def good(i=0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def bad():
    x, y = good()
    return x, y.clone().fill_(NAN)


def counts(state):
    s = state.substates["nonfinite"]
    return int(s.skipped_in_a_row), int(s.skipped_total)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("compile_it", [False, True])
def test_skips_counts_and_raises_one_call_late(precision, compile_it):
    step = fasttorch.step(loss_fn)
    if precision != "fp32":
        step = fasttorch.with_amp(step, precision)
    step = fasttorch.skip_nonfinite(fasttorch.clip_scaled(step, 1.0), max_consecutive=2)
    if compile_it:
        step = fasttorch.compiled(step, backend="aot_eager")
    state, _ = step(make(), good())
    before = {k: v.clone() for k, v in state.params.items()}
    opt_before = [t.clone() for t in pytree.tree_leaves(state.opt_state)]
    state, m = step(state, bad())
    assert bool(m["skipped"]) and counts(state) == (1, 1)
    assert all(torch.equal(before[k], state.params[k]) for k in before)  # not applied
    assert all(torch.equal(a, b) for a, b in zip(opt_before, pytree.tree_leaves(state.opt_state)))
    assert int(state.step) == 2  # the step counter still advances
    state, m = step(state, good(1))
    assert not bool(m["skipped"]) and counts(state) == (0, 1)  # a good update resets the run
    state, _ = step(state, bad())
    state, _ = step(state, bad())
    assert counts(state) == (2, 3)
    kept = {k: v.clone() for k, v in state.params.items()}
    with pytest.raises(NonFiniteError, match=r"the last 2 updates in a row had non-finite") as e:
        step(state, good(2))  # raises before running: the state is still usable
    assert "max_consecutive=2" in str(e.value) and "3 skipped in all" in str(e.value)
    assert isinstance(e.value, FloatingPointError)
    assert all(torch.equal(kept[k], state.params[k]) for k in kept)
    if precision == "fp16":
        amp = state.substates["amp"]
        assert (int(amp.skipped_in_a_row), int(amp.skipped_total)) == counts(state)


def test_order_with_other_transforms_does_not_matter():
    results = []
    for order in range(3):
        s = fasttorch.step(loss_fn)
        if order == 0:
            s = fasttorch.skip_nonfinite(fasttorch.with_amp(s, "fp16"), max_consecutive=None)
        elif order == 1:
            s = fasttorch.with_amp(fasttorch.skip_nonfinite(s, max_consecutive=None), "fp16")
        else:
            s = fasttorch.grad_accumulate(fasttorch.skip_nonfinite(s, max_consecutive=None), 2)
            s = fasttorch.with_amp(s, "fp16")
        state = make()
        for b in (good(), bad(), bad(), good(1), bad()):
            state, _ = s(state, b)
        results.append((counts(state), {k: v.clone() for k, v in state.params.items()}))
    assert results[0][0] == results[1][0] == results[2][0] == (1, 3)
    first, second, _ = (params for _, params in results)  # (fp16 microbatches round apart)
    assert all(torch.equal(first[k], second[k]) for k in first)  # bit for bit


def test_none_never_raises_and_bad_arguments_are_explained():
    step = fasttorch.skip_nonfinite(fasttorch.step(loss_fn), max_consecutive=None)
    state = make()
    for _ in range(5):
        state, _ = step(state, bad())
    assert counts(state) == (5, 5)
    with pytest.raises(ValueError, match="max_consecutive must be an integer >= 1, or None"):
        fasttorch.skip_nonfinite(fasttorch.step(loss_fn), max_consecutive=0)
    with pytest.raises(ValueError, match="compiled must be the outermost"):
        fasttorch.skip_nonfinite(fasttorch.compiled(fasttorch.step(loss_fn), backend="eager"))
    with pytest.raises(ValueError, match="already applied"):
        fasttorch.skip_nonfinite(fasttorch.skip_nonfinite(fasttorch.step(loss_fn)))


def test_counters_survive_a_checkpoint(tmp_path):
    step = fasttorch.skip_nonfinite(fasttorch.step(loss_fn), max_consecutive=3)
    state = make()
    for b in (bad(), good(), bad(), bad()):
        state, _ = step(state, b)
    path = checkpoint.save(tmp_path, state)
    fresh = fasttorch.skip_nonfinite(fasttorch.step(loss_fn), max_consecutive=3)
    state, _ = checkpoint.load(path, fresh.init(make()))
    assert counts(state) == (2, 3)
    state, _ = fresh(state, bad())  # the third in a row, counted across the resume
    with pytest.raises(NonFiniteError, match="the last 3 updates in a row"):
        fresh(state, good())


def _bn_state():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    return fasttorch.TrainState.create(net, fasttorch.optim.adam(0.1))


def _bn_step(guard, mode, accumulate=None, donate=True):
    step = fasttorch.step(loss_fn, donate=donate)
    if guard == "fp16":
        step = fasttorch.with_amp(step, "fp16")
    elif guard == "skip_nonfinite":
        step = fasttorch.skip_nonfinite(step)
    if accumulate is not None:
        step = fasttorch.grad_accumulate(step, 2, across_calls=accumulate == "across")
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    return step


def _nan_rows():
    x, y = good(5)
    x = x.clone()
    x[3] = NAN  # reaches the running statistics through the forward
    return x, y


@pytest.mark.parametrize("accumulate", [None, "within", "across"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("guard", ["fp16", "skip_nonfinite"])
def test_a_skipped_update_leaves_the_buffers_as_they_were(guard, mode, accumulate):
    step = _bn_step(guard, mode, accumulate)
    calls = 2 if accumulate == "across" else 1
    state = _bn_state()
    for i in range(calls):
        state, _ = step(state, good(i))
    before = {k: v.clone() for k, v in state.buffers.items()}
    # Across calls the window's first microbatch is finite and its second is not: the
    # buffers go back to their values when the window began.
    for batch in [good(7), _nan_rows()][-calls:]:
        state, m = step(state, batch)
    assert bool(m["skipped"])
    for k, b in before.items():
        assert torch.equal(state.buffers[k], b), k
    for i in range(calls):  # the next finite window updates them again
        state, m = step(state, good(10 + i))
    assert not bool(m["skipped"]) and bool(torch.isfinite(state.buffers["1.running_mean"]).all())
    assert not torch.equal(state.buffers["1.running_mean"], before["1.running_mean"])


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_buffers_of_applied_updates_are_the_plain_steps_bits(mode):
    guarded, plain = _bn_step("skip_nonfinite", mode), _bn_step(None, mode)
    a, b = _bn_state(), _bn_state()
    for i in range(3):
        a, _ = guarded(a, good(i))
        b, _ = plain(b, good(i))
    for k in b.buffers:
        assert torch.equal(a.buffers[k], b.buffers[k]), k
    for k in b.params:
        assert torch.equal(a.params[k], b.params[k]), k


def test_without_donation_a_skip_keeps_the_input_and_the_output_buffers():
    step = _bn_step("skip_nonfinite", "eager", donate=False)
    state, _ = step(_bn_state(), good())
    before = {k: v.clone() for k, v in state.buffers.items()}
    new, _ = step(state, _nan_rows())
    for k, b in before.items():
        assert torch.equal(state.buffers[k], b) and torch.equal(new.buffers[k], b), k


def test_the_skip_buffers_are_a_record_saved_under_the_plain_dict_s_keys(tmp_path):
    step = _bn_step("skip_nonfinite", "eager")
    state, _ = step(_bn_state(), good())
    kept = state.substates["skip_buffers"]
    assert isinstance(kept, SkipBuffers) and type(kept).restores_buffers
    names = sorted(n for n, _ in _bn_state().module.named_buffers())
    assert sorted(kept.buffers) == names
    # The record flattens as the dict it replaces: its entries under their own keys.
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(kept)[0]]
    assert paths == [pytree.keystr((pytree.MappingKey(n),)) for n in kept.buffers]
    keys = set(checkpoint.verify(checkpoint.save(tmp_path / "new", state))["entries"])
    assert {k for k in keys if k.startswith("substates/skip_buffers/")} == {
        f"substates/skip_buffers/{n}" for n in names
    }


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_checkpoint_of_the_old_plain_dict_skip_buffers_loads(tmp_path, mode):
    # Before SkipBuffers the sub-state was a plain dict of tensors: a checkpoint written
    # then (substates/skip_buffers/<name>) loads into today's record, and training from
    # it gives the bits of training on without the save (EXACT: the same ops).
    step = _bn_step("skip_nonfinite", mode)
    state = _bn_state()
    for i in range(2):
        state, _ = step(state, good(i))
    kept = state.substates["skip_buffers"]
    old_form = state.with_substate("skip_buffers", {k: v.clone() for k, v in kept.buffers.items()})
    path = checkpoint.save(tmp_path, old_form)
    keys = set(checkpoint.verify(path)["entries"])
    assert "substates/skip_buffers/1.running_mean" in keys
    assert not any(k.startswith("substates/skip_buffers/buffers/") for k in keys)
    loaded, _ = checkpoint.load(path, _bn_step("skip_nonfinite", mode).init(_bn_state()))
    got = loaded.substates["skip_buffers"]
    assert isinstance(got, SkipBuffers)
    for k, v in kept.buffers.items():
        assert torch.equal(got.buffers[k], v), k
    for batch in (_nan_rows(), good(3)):  # a skip restores the loaded buffers, then on
        state, m1 = step(state, batch)
        loaded, m2 = step(loaded, batch)
        assert bool(m1["skipped"]) == bool(m2["skipped"])
    for k in state.buffers:
        assert torch.equal(state.buffers[k], loaded.buffers[k]), k
    for k in state.params:
        assert torch.equal(state.params[k], loaded.params[k]), k
