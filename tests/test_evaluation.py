"""eval_step and Mean: no autograd, eval mode, training precision, EMA weights and
buffers, compilable."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree
from reference import BatchNormNet, LayerNormNet, batches, mse
from tolerance import EXACT, gamma, split_mean_atol

import fasttorch
from fasttorch.evaluation import Mean, eval_step, evaluate

counters = torch._dynamo.utils.counters


class DropoutBNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = BatchNormNet()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.net(x))


def _trained(model, step, n=3):
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-2))
    for b in batches(n, 16):
        state, _ = step(state, b)
    return state


def test_eval_mode_no_grad_state_untouched_mode_restored():
    torch.manual_seed(0)
    state = _trained(DropoutBNNet(), fasttorch.step(mse, donate=False))
    leaves = [t.clone() for t in pytree.tree_leaves(state)]
    x, y = batches(1, 16, seed=1)[0]
    m = eval_step(mse)(state, (x, y))
    assert not m["loss"].requires_grad and m["loss"].device == x.device
    assert float(m["weight"]) == 16.0
    assert state.module.training  # restored
    assert all(torch.equal(a, b) for a, b in zip(leaves, pytree.tree_leaves(state)))
    ref = copy.deepcopy(state.module)
    ref.load_state_dict(state.state_dict())
    ref.eval()
    with torch.no_grad():  # dropout off, BatchNorm on running statistics
        # Rule 1: the same module's forward on the same input, the same operations.
        torch.testing.assert_close(m["loss"], mse(ref, (x, y)), **EXACT)
    state.module.eval()
    eval_step(mse)(state, (x, y))
    assert not state.module.training  # a module left in eval mode stays there


def test_reuses_the_training_precision():
    torch.manual_seed(0)
    model = LayerNormNet()
    bf16 = fasttorch.with_amp(fasttorch.step(mse, donate=False), "bf16")
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    x, y = batches(1, 16)[0]
    low, full = eval_step(bf16)(state, (x, y)), eval_step(mse)(state, (x, y))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = mse(model.eval(), (x, y))
    model.train()
    torch.testing.assert_close(low["loss"], ref, rtol=0, atol=0)
    assert not torch.equal(low["loss"], full["loss"])


def test_use_ema_evaluates_the_averaged_weights():
    torch.manual_seed(0)
    step = fasttorch.ema(fasttorch.step(mse), 0.5)
    state = _trained(LayerNormNet(), step)
    b = batches(1, 16, seed=3)[0]
    on_ema = eval_step(step, use_ema=True)(state, b)
    ref = copy.deepcopy(state.module)
    ref.load_state_dict(state.substates["ema"].params, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(on_ema["loss"], mse(ref.eval(), b), **EXACT)  # rule 1
    assert not torch.equal(on_ema["loss"], eval_step(step)(state, b)["loss"])
    # A loss function works too, once the state holds an average.
    on_ema_fn = eval_step(mse, use_ema=True)(state, b)["loss"]
    torch.testing.assert_close(on_ema_fn, on_ema["loss"], **EXACT)  # rule 1


@pytest.mark.parametrize("buffers", ["average", "copy"])
def test_use_ema_evaluates_the_averaged_buffers_too(buffers):
    """BatchNorm's running statistics come from the average (averaged, or copied at
    its updates), not from the live model: evaluating the averaged parameters with
    the live statistics would mix two models."""
    torch.manual_seed(0)
    step = fasttorch.ema(fasttorch.step(mse), 0.5, every=2, buffers=buffers)
    state = _trained(BatchNormNet(), step, n=4)
    sub = state.substates["ema"]
    assert set(sub.buffers) == {k for k, _ in state.module.named_buffers()}
    b = batches(1, 16, seed=3)[0]
    on_ema = eval_step(step, use_ema=True)(state, b)["loss"]
    ref = copy.deepcopy(state.module)
    ref.load_state_dict({**sub.params, **sub.buffers})
    with torch.no_grad():
        torch.testing.assert_close(on_ema, mse(ref.eval(), b), **EXACT)  # rule 1
    # every=2: the last update of the average was after the third batch, so its
    # statistics (copied, or averaged from there) are not the live ones.
    assert not torch.equal(sub.buffers["bn.running_mean"], state.buffers["bn.running_mean"])
    assert int(sub.buffers["bn.num_batches_tracked"]) == 3  # integer buffers: copied
    ref.load_state_dict({**sub.params, **state.buffers})
    with torch.no_grad():
        assert not torch.equal(on_ema, mse(ref.eval(), b))


def test_a_record_of_ones_own_declares_its_buffers():
    """eval_buffers names the field whose buffers evaluation reads (substates.py)."""
    from typing import ClassVar

    from fasttorch import struct

    class Frozen(struct.Record):
        params: dict[str, torch.Tensor]
        stats: dict[str, torch.Tensor]

        eval_params: ClassVar[str] = "params"
        eval_buffers: ClassVar[str] = "stats"

    torch.manual_seed(0)
    state = _trained(BatchNormNet(), fasttorch.step(mse))
    stats = {k: v + 1.0 if v.is_floating_point() else v for k, v in state.buffers.items()}
    state = state.with_substate("frozen", Frozen(dict(state.params), stats))
    b = batches(1, 16, seed=4)[0]
    got = eval_step(mse, use_ema=True)(state, b)["loss"]
    ref = copy.deepcopy(state.module)
    ref.load_state_dict({**state.params, **stats})
    with torch.no_grad():
        torch.testing.assert_close(got, mse(ref.eval(), b), **EXACT)  # rule 1


def test_wrap_time_and_call_time_errors():
    plain = fasttorch.step(mse)
    with pytest.raises(ValueError, match=r"use_ema=True but step 'mse' has no ema.*fasttorch.ema"):
        eval_step(plain, use_ema=True)
    with pytest.raises(ValueError, match=r"is compiled.*compiled\(eval_step\(step\)\)"):
        eval_step(fasttorch.compiled(plain))
    with pytest.raises(TypeError, match=r"expects a fasttorch.Step or a loss function .*, got int"):
        eval_step(3)
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"no 'ema' sub-state \(it has \[\]\)"):
        eval_step(mse, use_ema=True)(state, batches(1, 4)[0])


def test_compiles_one_graph_no_breaks_and_equals_eager():
    torch.manual_seed(0)
    step = fasttorch.ema(fasttorch.with_amp(fasttorch.step(mse), "bf16"), 0.9)
    state = _trained(DropoutBNNet(), step)
    ev = eval_step(step, use_ema=True)
    fast = fasttorch.compiled(ev, backend="aot_eager")
    for b in batches(4, 16, seed=5):
        # Rule 1: aot_eager runs the eager forward's operations, in the same order.
        torch.testing.assert_close(fast(state, b)["loss"], ev(state, b)["loss"], **EXACT)
    assert state.module.training
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0


def test_mean_is_a_weighted_running_mean_on_the_device():
    m = Mean.zeros()
    assert torch.isnan(m.compute())
    m1 = m.update(torch.tensor(1.0), weight=torch.tensor(3.0))
    assert float(m.count) == 0.0  # update returns a new record
    m2 = m1.update(torch.tensor([2.0, 4.0]))  # several values, weight 1 each
    # Rule 3: integer sums are exact in float32; the one division rounds once.
    assert float(m2.compute()) == pytest.approx((3 + 2 + 4) / 5, rel=gamma(1), abs=0)
    merged = m2.merge(Mean.zeros().update(torch.tensor(10.0), 5))
    assert float(merged.compute()) == pytest.approx((9 + 50) / 10, rel=gamma(1), abs=0)
    assert pytree.tree_leaves(merged)[0] is merged.total  # a pytree record


def test_evaluate_weights_batches_by_their_size():
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    ((x, y),) = batches(1, 20)
    parts = [(x[:4], y[:4]), (x[4:], y[4:])]
    out = evaluate(eval_step(mse), state, parts)
    whole = eval_step(mse)(state, (x, y))["loss"]
    with torch.no_grad():
        terms = (state.apply(x) - y).square() / y.numel()
    atol = split_mean_atol(terms)  # rule 3: one mean, summed in two orders
    torch.testing.assert_close(out["loss"], whole, rtol=0, atol=atol)
