"""fasttorch.step: purity, donation, RNG, metrics and clear errors for bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import BatchNormNet, LayerNormNet, assert_params_close, batches, mse, reference_run
from tolerance import EXACT, fp32_reference_error, params_atol, split_mean_atol
from torch import nn

import fasttorch
from fasttorch.state import DonatedStateError


def _state(model=None, seed=0):
    torch.manual_seed(0)
    return fasttorch.TrainState.create(
        model or LayerNormNet(), fasttorch.optim.adamw(1e-2), seed=seed
    )


def _snapshot(state):
    return [t.clone() for t in torch.utils._pytree.tree_leaves(state)]


def _all_transforms(donate, mode="eager"):
    s = fasttorch.step(mse, donate=donate)
    s = fasttorch.clip_scaled(fasttorch.with_amp(s, "fp16"), 1.0)
    s = fasttorch.grad_accumulate(s, 2, across_calls=True)
    return fasttorch.compiled(s, backend="aot_eager") if mode == "compiled" else s


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_no_donation_leaves_the_input_state_bit_identical(mode):
    step = _all_transforms(donate=False, mode=mode)
    state = step.init(_state(BatchNormNet()))
    for b in batches(3, 8):
        before = _snapshot(state)
        new, metrics = step(state, b)
        after = torch.utils._pytree.tree_leaves(state)
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        if "lr" in metrics:  # an updating call: copying semantics give new parameter tensors
            assert all(
                a.data_ptr() != c.data_ptr()
                for a, c in zip(state.params.values(), new.params.values())
            )
        state = new
    assert int(state.step) == 1


def test_same_state_and_batch_give_the_same_result_with_dropout():
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    step = fasttorch.step(mse, donate=False)
    state = _state(model, seed=7)
    b = batches(1, 16)[0]
    torch.manual_seed(123)
    outside = torch.get_rng_state()
    a, ma = step(state, b)
    torch.manual_seed(999)  # the caller's generator does not matter ...
    c, mc = step(state, b)
    assert torch.equal(ma["loss"], mc["loss"])
    assert all(torch.equal(x, y) for x, y in zip(a.params.values(), c.params.values()))
    assert not torch.equal(a.rng, state.rng)  # ... the state's generator advanced
    d, md = step(a, b)
    assert not torch.equal(md["loss"], ma["loss"])  # next step draws a new mask
    other = _state(model, seed=8)
    _, mo = step(other, b)
    assert not torch.equal(mo["loss"], ma["loss"])  # another seed, another mask
    torch.manual_seed(123)
    step(state, b)
    assert torch.equal(torch.get_rng_state(), outside)  # the caller's stream is untouched


def test_donation_updates_in_place_and_kills_the_input():
    step = fasttorch.step(mse)
    state = _state()
    ptrs = [p.data_ptr() for p in state.params.values()]
    new, _ = step(state, batches(1, 8)[0])
    assert [p.data_ptr() for p in new.params.values()] == ptrs
    with pytest.raises(DonatedStateError, match=r"donated to step 'mse'.*donate=False"):
        _ = state.params
    with pytest.raises(DonatedStateError):
        step(state, batches(1, 8)[0])
    assert repr(state) == "TrainState(<donated>)"
    new, _ = step(new, batches(1, 8)[0])  # the returned state is alive
    assert int(new.step) == 2


def test_donation_keeps_the_module_in_sync():
    model = LayerNormNet()
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    state, _ = fasttorch.step(mse)(state, batches(1, 8)[0])
    assert torch.equal(model.inp.weight, state.params["inp.weight"])


def test_metrics_are_tensors_and_aux_is_returned():
    def loss_fn(apply, batch):
        x, y = batch
        out = apply(x)
        return nn.functional.mse_loss(out, y), {"mean_out": out.mean()}

    state, m = fasttorch.step(loss_fn)(_state(), batches(1, 8)[0])
    assert set(m) == {"loss", "grad_norm", "lr", "aux"}
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 for k, v in m.items() if k != "aux")
    assert isinstance(m["aux"]["mean_out"], torch.Tensor)


def test_aux_is_averaged_over_microbatches_like_the_loss():
    def loss_fn(apply, batch):
        x, y = batch
        return nn.functional.mse_loss(apply(x), y), {"x_mean": x.mean()}

    b = batches(1, 32)[0]
    step = fasttorch.grad_accumulate(fasttorch.step(loss_fn), 4)
    _, m = step(_state(), b)
    # Rule 3: the mean of 4 microbatch means against the whole batch's: one mean, two orders.
    atol = split_mean_atol(b[0] / b[0].numel())
    torch.testing.assert_close(m["aux"]["x_mean"], b[0].mean(), rtol=0, atol=atol)


def test_step_keeps_the_loss_functions_name_and_doc():
    def my_loss(apply, batch):
        """My loss."""
        return mse(apply, batch)

    s = fasttorch.clip_scaled(fasttorch.with_amp(fasttorch.step(my_loss), "bf16"), 1.0)
    assert s.__name__ == "my_loss" and s.__doc__ == "My loss."
    assert s.transforms == ("with_amp", "clip_scaled")


def test_init_adds_substates_once_and_the_first_call_does_it_too():
    step = fasttorch.grad_accumulate(
        fasttorch.with_amp(fasttorch.step(mse), "fp16"), 2, across_calls=True
    )
    s0 = _state()
    s1 = step.init(s0)
    assert set(s1.substates) == {"amp", "grad_accumulate", "skip_buffers"} and s0.substates == {}
    assert step.init(s1) is s1
    s2, _ = step(_state(), batches(1, 8)[0])
    assert set(s2.substates) == {"amp", "grad_accumulate", "skip_buffers"}


def test_errors_for_bad_batches():
    step = fasttorch.step(mse)
    state = _state()
    x, y = batches(1, 8)[0]
    with pytest.raises(TypeError, match=r"batch\[1\]\[0\] is a float.*torch.as_tensor"):
        step(state, (x, [1.0, 2.0]))
    with pytest.raises(TypeError, match="expects a fasttorch.TrainState as its first argument"):
        step((x, y), state)
    with pytest.raises(ValueError, match=r"batch\[0\] is on meta but the state is on cpu"):
        step(state, (x.to("meta"), y))
    with pytest.raises(TypeError, match="holds no tensors"):
        step(state, ())
    with pytest.raises(ValueError, match="(?s)same leading.*Tensor"):
        fasttorch.grad_accumulate(step, 2)(state, (x, y[:6]))
    with pytest.raises(ValueError, match="batch of 8 cannot be split into 16"):
        fasttorch.grad_accumulate(step, 16)(state, (x, y))


def test_wrong_batch_structure_names_the_loss_function_and_the_batch():
    step = fasttorch.step(mse, donate=False)
    x, y = batches(1, 8)[0]
    with pytest.raises(ValueError) as info:
        step(_state(), (x, y, y))  # mse unpacks two items
    assert "raised inside loss function 'mse'" in "\n".join(info.value.__notes__)
    assert "Tensor(8, 8):float32@cpu" in "\n".join(info.value.__notes__)


def test_a_loss_that_is_not_a_scalar_is_refused():
    def per_sample(apply, batch):
        x, y = batch
        return (apply(x) - y).pow(2).mean(1)

    with pytest.raises(ValueError, match=r"0-d floating tensor.*shape \(8,\).*\.mean\(\)"):
        fasttorch.step(per_sample)(_state(), batches(1, 8)[0])
    with pytest.raises(ValueError, match="got int"):
        fasttorch.step(lambda apply, batch: 3)(_state(), batches(1, 8)[0])


def test_create_refuses_non_floating_params_mixed_devices_and_torch_optimizers():
    m = nn.Linear(2, 2)
    m.idx = nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)
    with pytest.raises(TypeError, match=r"'idx' has dtype torch.int64.*register_buffer"):
        fasttorch.TrainState.create(m, fasttorch.optim.sgd(0.1))
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    with pytest.raises(ValueError, match="more than one device"):
        fasttorch.TrainState.create(m, fasttorch.optim.sgd(0.1))
    with pytest.raises(TypeError, match="torch.optim optimizers keep hidden mutable state"):
        fasttorch.TrainState.create(
            nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1)
        )
    with pytest.raises(ValueError, match="nothing to train"):
        fasttorch.TrainState.create(nn.Linear(2, 2).requires_grad_(False), fasttorch.optim.sgd(0.1))
    with pytest.raises(TypeError, match="expects a loss function"):
        fasttorch.step(3)


def test_frozen_parameters_are_carried_not_trained():
    m = LayerNormNet()
    m.inp.requires_grad_(False)
    state = fasttorch.TrainState.create(m, fasttorch.optim.sgd(0.1))
    assert "inp.weight" in state.buffers and "inp.weight" not in state.params
    w = state.buffers["inp.weight"].clone()
    state, _ = fasttorch.step(mse)(state, batches(1, 8)[0])
    assert torch.equal(state.buffers["inp.weight"], w)


def test_state_is_a_pytree_and_exports_a_state_dict():
    state = _state(BatchNormNet())
    paths = [
        torch.utils._pytree.keystr(p)
        for p, _ in torch.utils._pytree.tree_flatten_with_path(state)[0]
    ]
    assert ".params['inp.weight']" in paths and ".buffers['bn.running_mean']" in paths
    fresh = BatchNormNet()
    fresh.load_state_dict(state.state_dict())
    x = torch.randn(4, 8)
    fresh.eval()
    before = {k: b.clone() for k, b in state.buffers.items()}
    torch.testing.assert_close(fresh(x), state.apply(x), **EXACT)  # rule 1: same forward
    assert state.module.training  # apply evaluates in eval mode and restores the mode
    assert all(torch.equal(before[k], b) for k, b in state.buffers.items())


def test_module_left_in_eval_mode_is_trained_in_train_mode():
    model = BatchNormNet()
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    model.eval()
    state, _ = fasttorch.step(mse)(state, batches(1, 8)[0])
    assert int(state.buffers["bn.num_batches_tracked"]) == 1


def test_calling_the_module_directly_gives_the_same_bits_as_functional_call():
    """A donated state shares storage with its module, so eager steps call the module
    as is; copying semantics (and any state whose tensors are not the module's) go
    through functional_call. Both must give identical results."""
    from fasttorch._core import phases as _engine
    from fasttorch._core import state as _scope

    calls = []
    real = _engine.module_tensors

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    for model in (LayerNormNet(), BatchNormNet()):
        torch.manual_seed(0)
        states = [
            # opaque=False: the _foreach form in both, whose bits donation does not
            # change (a donated CPU step's default is torch's fused kernel)
            fasttorch.TrainState.create(
                copy.deepcopy(model), fasttorch.optim.adamw(1e-2, opaque=False)
            )
            for _ in range(2)
        ]
        donating = fasttorch.clip_scaled(fasttorch.grad_accumulate(fasttorch.step(mse), 2), 1.0)
        copying = fasttorch.clip_scaled(
            fasttorch.grad_accumulate(fasttorch.step(mse, donate=False), 2), 1.0
        )
        _engine.module_tensors = spy
        try:
            for b in batches(4, 16):
                calls.clear()
                states[0], _ = donating(states[0], b)
                assert calls and all(calls)  # the module's own tensors were used
                calls.clear()
                states[1], _ = copying(states[1], b)
                assert calls and not any(calls)  # functional_call
        finally:
            _engine.module_tensors = real
        for a, c in zip(
            torch.utils._pytree.tree_leaves(
                (states[0].params, states[0].buffers, states[0].opt_state)
            ),
            torch.utils._pytree.tree_leaves(
                (states[1].params, states[1].buffers, states[1].opt_state)
            ),
        ):
            assert torch.equal(a, c)
    # Tensors that are no longer the module's (here: copies) fall back to functional_call.
    with _scope.scope(in_place=True):
        s = states[0]
        assert _engine.module_tensors(s.module, s.params, s.buffers) is not None
        moved = s.replace(params={k: v.clone() for k, v in s.params.items()})
        assert _engine.module_tensors(moved.module, moved.params, moved.buffers) is None


REPR_TRANSFORMS = {
    "with_amp(bf16)": lambda s: fasttorch.with_amp(s, "bf16"),
    "with_amp(fp16)": lambda s: fasttorch.with_amp(s, "fp16"),
    "grad_accumulate": lambda s: fasttorch.grad_accumulate(s, 2),
    "clip_scaled": lambda s: fasttorch.clip_scaled(s, 1.0),
    "scale_loss": lambda s: fasttorch.scale_loss(s, 2.0),
    "skip_nonfinite": lambda s: fasttorch.skip_nonfinite(s, max_consecutive=3),
    "ema": lambda s: fasttorch.ema(s, 0.9),
    "sync_on_last": fasttorch.sync_on_last,
    "compiled": lambda s: fasttorch.compiled(s, backend="aot_eager"),
}


@pytest.mark.parametrize("name", list(REPR_TRANSFORMS))
def test_every_transformed_step_has_a_short_readable_repr(name):
    step = REPR_TRANSFORMS[name](fasttorch.step(mse))
    text = repr(step)
    assert text.startswith("Step('mse', transforms=[") and str(step) == text
    assert name.split("(")[0] in text and "<function" not in text and len(text) < 200
    if name == "with_amp(fp16)":
        assert "substates=['amp'" in text


def test_a_profiled_step_has_a_readable_repr(tmp_path):
    prof = fasttorch.profiled(fasttorch.step(mse), dir=tmp_path)
    assert (
        repr(prof)
        == "Profiled(Step('mse', transforms=[], substates=[], donate=True), calls=0, stopped=False)"
    )


def test_transform_configs_and_states_have_working_reprs():
    from fasttorch.distributed.reducer import SyncConfig
    from fasttorch.transforms.compiled import Compiler
    from fasttorch.transforms.with_amp import DynamicLossScale

    rule = DynamicLossScale(2.0**16, 2.0, 0.5, 2000)
    assert repr(rule).startswith("DynamicLossScale(init_scale=65536.0")
    assert repr(Compiler({"backend": "aot_eager"})) == (
        "Compiler(options={'backend': 'aot_eager'}, static_state=False)"
    )
    assert repr(SyncConfig()).startswith("SyncConfig(")
    step = fasttorch.with_amp(fasttorch.ema(fasttorch.step(mse), 0.9), "fp16")
    state = step.init(_state())
    assert repr(state).startswith("TrainState(params=")
    records = [s for s in state.substates.values() if isinstance(s, fasttorch.struct.Record)]
    assert len(records) == 3  # the loss scale, the EMA and the skip buffers (SkipBuffers)
    for sub in records:
        assert repr(sub).startswith(type(sub).__name__ + "(")


class _TiedHead(nn.Module):
    """An embedding and a head sharing one weight (GPT-2's tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _ce(apply, batch):
    x, y = batch
    return nn.functional.cross_entropy(apply(x).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_tied_weight_trains_as_one_tensor_without_walking_the_module(mode, monkeypatch):
    # create records the module's tied names once; each forward adds the aliases itself
    # instead of torch's per-call walk over every submodule (which dynamo traced in
    # every compiled step). Same bits as the walk, and as the hand loop's updates.
    torch.manual_seed(0)
    model = _TiedHead()
    state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(1e-2))
    assert state.ties == (("head.weight", "emb.weight"),)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 11, (4, 5), generator=g),) * 2 for _ in range(3)]

    def run(state):
        step = fasttorch.step(_ce, donate=False)
        if mode == "compiled":
            step = fasttorch.compiled(step, backend="aot_eager")
        for b in data:
            state, _ = step(state, b)
        return state

    from torch.nn.utils import stateless

    def no_walk(*args):
        raise AssertionError("functional_call walked the module for its tied names")

    with monkeypatch.context() as patch:
        patch.setattr(stateless, "_untie_named_tensors_map", no_walk)
        lean = run(state)
        with pytest.raises(Exception, match="walked the module"):  # dynamo wraps it
            run(state.replace(ties=None))  # ties not known: torch's walk
    walked = run(state.replace(ties=None))
    for k in lean.params:
        torch.testing.assert_close(lean.params[k], walked.params[k], **EXACT)

    # Rule 2 against the hand-written loop (one update per tied tensor, as torch's).
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    windows = [[b] for b in data]
    ref, _ = reference_run(model, windows, loss_fn=_ce, make_opt=adamw)
    error = fp32_reference_error(model, windows, loss_fn=_ce, make_opt=adamw)
    assert_params_close(lean, ref, rtol=0, atol=params_atol(error, lean.params))
