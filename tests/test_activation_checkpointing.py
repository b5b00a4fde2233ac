"""Activation checkpointing (torch.utils.checkpoint, non-reentrant) inside a step.

A model whose blocks are checkpointed, and a loss function that checkpoints the whole
forward, composed with with_amp, grad_accumulate and clip_scaled, eager and compiled
(aot_eager): the same parameters as the hand-written loop, and (eager) bit for bit the
same as the step without checkpointing, since recomputing runs the same operations.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from reference import assert_params_close, reference_run
from reference import mse as reference_mse
from test_equivalence import FP16, LR, STEPS, N, adamw, windows_for
from tolerance import loss_atol, params_atol, reference_error
from torch import nn
from torch.utils.checkpoint import checkpoint

import fasttorch


def _needs_autograd_in_graph():
    """Checkpointing needs saved-tensor hooks, which torch.func.grad (the compiled
    gradient path on torch 2.10/2.11) does not support."""
    from fasttorch import _compat

    if not _compat.AUTOGRAD_GRAD_IN_GRAPH:
        pytest.skip("activation checkpointing in a compiled step needs torch >= 2.12")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Deep(nn.Module):
    """Residual MLP blocks, each checkpointed when ``ckpt`` (non-reentrant)."""

    def __init__(self, ckpt: bool, d_in: int = 8, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.ckpt else block(h)
        return self.out(h)


def mse(apply, batch):
    x, y = batch
    return nn.functional.mse_loss(apply(x).float(), y)


def mse_checkpointed(apply, batch):
    """The whole forward recomputed in the backward: only the input is kept."""
    x, y = batch
    return nn.functional.mse_loss(checkpoint(apply, x, use_reentrant=False).float(), y)


def build(loss_fn, precision, mode):
    s = fasttorch.step(loss_fn)
    if precision != "fp32":
        s = fasttorch.with_amp(s, precision, **(FP16 if precision == "fp16" else {}))
    s = fasttorch.clip_scaled(fasttorch.grad_accumulate(s, N), 1.0)
    if mode == "compiled":
        _needs_autograd_in_graph()
        return fasttorch.compiled(s, backend="aot_eager")
    return s


def train(model, loss_fn, precision, mode, calls):
    state = fasttorch.TrainState.create(
        copy.deepcopy(model), fasttorch.optim.adamw(1e-2, weight_decay=0.1)
    )
    step = build(loss_fn, precision, mode)
    losses = []
    for batch in calls:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return state, torch.stack(losses)


@pytest.mark.parametrize(
    ("where", "precision", "mode"),
    list(itertools.product(["blocks", "loss_fn"], ["fp32", "bf16", "fp16"], ["eager", "compiled"])),
)
def test_checkpointed_step_matches_the_reference_loop(where, precision, mode):
    torch.manual_seed(0)
    model = Deep(ckpt=where == "blocks")
    loss_fn = mse_checkpointed if where == "loss_fn" else mse
    windows, calls = windows_for("within")
    ref, log = reference_run(
        model,
        windows,
        loss_fn=loss_fn,
        make_opt=adamw,
        precision=precision,
        clip=1.0,
        scaler_kwargs=FP16 if precision == "fp16" else None,
    )
    state, losses = train(model, loss_fn, precision, mode, calls)
    assert int(state.step) == STEPS
    if mode == "eager":
        # Recomputation runs the same operations: bit for bit the step without it.
        plain = Deep(ckpt=False)
        plain.load_state_dict(model.state_dict())
        state0, losses0 = train(plain, mse, precision, mode, calls)
        assert torch.equal(losses, losses0)
        assert all(torch.equal(state.params[k], state0.params[k]) for k in state.params)
    # Rule 2 (the fp32 loop's own error against float64; checkpointing changes no
    # arithmetic, so the plain reference.mse measures it) plus rule 4 for half
    # precision. Two half roundings: in fp16 a float32-rounding difference in the loss
    # scaling flips an fp16 rounding in the backward, and AdamW turns that into up to
    # lr * eps (two unit roundoffs) per step on a parameter whose gradient is near zero.
    error = reference_error(model, windows, make_opt=adamw, loss_fn=reference_mse, clip=1.0)
    atol = params_atol(
        error.params, state.params, precision=precision, steps=STEPS, lr=LR, half_roundings=2
    )
    assert_params_close(state, ref, rtol=0, atol=atol)
    ref_losses = torch.tensor([r["loss"] for r in log])
    torch.testing.assert_close(
        losses, ref_losses, rtol=0, atol=loss_atol(error, ref_losses, precision)
    )


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_with_every_single_process_transform(mode):
    """ema and skip_nonfinite as well, accumulating across calls, fp16 from a scale that
    overflows: checkpointed blocks give bit for bit the parameters, EMA and skipped
    steps of the plain model, eager and compiled (aot_eager runs the same operations)."""
    torch.manual_seed(0)
    model = Deep(ckpt=True)
    plain = Deep(ckpt=False)
    plain.load_state_dict(model.state_dict())
    _, calls = windows_for("across")

    def run(m):
        s = fasttorch.with_amp(fasttorch.step(mse), "fp16", **FP16)
        s = fasttorch.grad_accumulate(s, N, across_calls=True)
        s = fasttorch.ema(fasttorch.skip_nonfinite(fasttorch.clip_scaled(s, 1.0)), 0.9)
        if mode == "compiled":
            _needs_autograd_in_graph()
            s = fasttorch.compiled(s, backend="aot_eager")
        state = s.init(fasttorch.TrainState.create(copy.deepcopy(m), fasttorch.optim.adamw(1e-2)))
        skipped = []
        for batch in calls:
            state, metrics = s(state, batch)
            if "skipped" in metrics:
                skipped.append(metrics["skipped"])
        return state, torch.stack(skipped)

    a, skipped_a = run(model)
    b, skipped_b = run(plain)
    assert torch.equal(skipped_a, skipped_b) and int(skipped_a.sum()) > 0  # fp16 overflowed
    leaves = {**a.params, **{f"ema/{k}": v for k, v in a.substates["ema"].params.items()}}
    other = {**b.params, **{f"ema/{k}": v for k, v in b.substates["ema"].params.items()}}
    for k in leaves:
        assert torch.equal(leaves[k], other[k]), k
