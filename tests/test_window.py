"""The accumulation window: transforms declare it, one loop runs it, a reduction owns
only the last microbatch."""

from __future__ import annotations

import attrs
import pytest
import torch
from reference import LayerNormNet, batches, mse

import fasttorch
from fasttorch.phases import GradOut
from fasttorch.transforms.grad_accumulate import AccumState, accumulate
from fasttorch.window import Window


def _state():
    torch.manual_seed(0)
    return fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(1e-2))


def test_grad_accumulate_declares_its_window_and_nothing_else():
    step = fasttorch.step(mse)
    within = fasttorch.grad_accumulate(step, 4)
    across = fasttorch.grad_accumulate(step, 3, across_calls=True)
    assert within.window == Window(n=4)
    assert across.window == Window(n=3, across_calls=True)
    # The same loop runs every window: no runner or hook of the transform's own.
    assert within.runner is step.runner and across.runner is step.runner
    assert "finish" not in {f.name for f in attrs.fields(fasttorch.Step)}


def test_grad_accumulate_declares_the_sums_its_window_keeps():
    # The window's loop is generic: the record and its kernels come from the transform.
    step = fasttorch.step(mse)
    assert step.window.sums is None
    for s in (
        fasttorch.grad_accumulate(step, 4),
        fasttorch.grad_accumulate(step, 3, across_calls=True),
    ):
        assert s.window.sums is AccumState and AccumState.key == "grad_accumulate"


@pytest.mark.parametrize("across", [False, True])
def test_a_window_of_several_microbatches_without_sums_is_refused(across):
    # At wrap time, naming the transform that set the window.
    step = fasttorch.step(mse)
    with pytest.raises(TypeError, match=r"^bare: the step's window has n=2 .*declares no sums"):
        step.with_phases("bare", window=Window(n=2, across_calls=across))


def test_sync_on_last_installs_a_reduction_in_either_order():
    step = fasttorch.step(mse)
    a = fasttorch.sync_on_last(fasttorch.grad_accumulate(step, 4))
    b = fasttorch.grad_accumulate(fasttorch.sync_on_last(step), 4)
    for s in (a, b):
        assert s.window.n == 4 and not s.window.across_calls
        assert s.window.reduce is not None and s.runner is step.runner
    assert fasttorch.sync_on_last(step).window.n == 1


class _LocalReduction:
    """A reduction over one process: the window's mean, as the window's close computes
    it; records what the window handed it."""

    def __init__(self):
        self.seen = []

    def last(self, step, state, acc, batch, n):
        g = step.grad(step.loss, state, batch, 1.0 / n)
        self.seen.append((n, None if acc is None else acc.weight.item()))
        if acc is None:
            return g.replace(grads={}), g
        acc = accumulate(acc.replace(unused=None), g, n, False)
        total = acc.weight
        mean = GradOut(
            grads=dict(zip(acc.grads, torch._foreach_div(list(acc.grads.values()), total))),
            value=acc.value / total,
            weight=total,
            aux=g.aux,
            scale=g.scale,
            counted=g.counted,
        )
        return g.replace(grads={}), mean

    def sharded(self, step, state, n):
        raise AssertionError("no state here is sharded")


@pytest.mark.parametrize(("n", "across"), [(1, False), (4, False), (4, True)])
def test_a_reduction_runs_each_window_s_last_microbatch(n, across):
    """The window runs every microbatch but the last and hands the reduction its sums:
    with a reduction that computes the local mean, the same bits as no reduction."""
    plain = fasttorch.step(mse, donate=False)
    if n > 1:
        plain = fasttorch.grad_accumulate(plain, n, across_calls=across)
    reduction = _LocalReduction()
    reduced = plain.with_phases("local", window=attrs.evolve(plain.window, reduce=reduction))
    data = batches(3 * n if across else 3, 16)
    states = [_state(), _state()]
    for b in data:
        b = b if not across else tuple(t[:4] for t in b)
        states[0], m0 = plain(states[0], b)
        states[1], m1 = reduced(states[1], b)
        assert torch.equal(m0["loss"], m1["loss"])
    for k, p in states[0].params.items():
        assert torch.equal(p, states[1].params[k]), k
    windows = len(data) // n if across else len(data)
    assert len(reduction.seen) == windows
    rows = 4 if across else 16 // n
    expected_before = None if n == 1 else float(rows * (n - 1))
    assert all(s == (n, expected_before) for s in reduction.seen)
