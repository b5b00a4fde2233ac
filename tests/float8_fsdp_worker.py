"""Checks run inside each rank of a 2-process gloo group: float8 layers sharded with FSDP2
and gathered in float8 (tests/test_float8.py), against torchao's and FSDP2's own loop
on the same ranks."""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from dist_kit import join, leave
from reference import adam_twin, mse
from tolerance import fp32_reference_error, params_atol

import fasttorch
from fasttorch import float8
from fasttorch.distributed import replicate, sync_on_last

STEPS = 3
LR = 1e-2
CLIP = 0.5
N = 2
ROWS = 16  # per rank


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.hidden = torch.nn.Linear(32, 48)
        self.output = torch.nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.hidden(torch.relu(self.inp(x)))))


def batches(rank):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(2 * ROWS, 16, generator=g), torch.randn(2 * ROWS, 4, generator=g)
        out.append((x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]))
    return out


def shard(model):
    fully_shard(model.inp)
    fully_shard(model.hidden)
    fully_shard(model)  # the root: the output head
    return model


def plain():
    torch.manual_seed(0)
    return Net()


class Spy:
    """Each float8 all-gather: the dtype FSDP2 sent and whether a precomputed scale cast it."""

    def __init__(self):
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as cls

        self.cls, self.orig, self.seen = cls, cls.fsdp_pre_all_gather, []

        @functools.wraps(self.orig)
        def spy(tensor, *args, **kwargs):
            out = self.orig(tensor, *args, **kwargs)
            self.seen.append((str(out[0][0].dtype), tensor._precomputed_scale is not None))
            return out

        cls.fsdp_pre_all_gather = spy

    def close(self):
        self.cls.fsdp_pre_all_gather = self.orig


def torchao_loop(rank, clip):
    """torchao's FSDP2 recipe, by hand: convert_to_float8_training with float8
    all-gather, fully_shard, torch's AdamW, the scales precomputed after each
    optimizer step (and once before the first forward)."""
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    model = plain()
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: fqn != "output"
    )
    model = shard(model)
    opt = adam_twin(torch.optim.AdamW, LR, weight_decay=1e-2, fused=True)(model.parameters())
    precompute_float8_dynamic_scale_for_fsdp(model)
    for x, y in batches(rank):
        for i, mb in enumerate(zip(x.tensor_split(N), y.tensor_split(N))):
            model.set_requires_gradient_sync(i == N - 1)
            (mse(model, mb) / N).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute_float8_dynamic_scale_for_fsdp(model)
    return {k: p.detach().full_tensor() for k, p in model.named_parameters()}


def fasttorch_run(rank, mode, clip, precompute=True):
    model = float8.convert(plain(), "tensorwise", emulate=True, enable_fsdp_float8_all_gather=True)
    model = shard(model)
    step = sync_on_last(
        fasttorch.grad_accumulate(fasttorch.step(mse), N),
        timeout=datetime.timedelta(seconds=60),
    )
    if clip:
        step = fasttorch.clip_scaled(step, CLIP)
    step = float8.with_float8(step, precompute_fsdp_scales=precompute)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
    state = replicate(fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR)))
    kinds = {k: type(t).__name__ for k, t in state.params.items()}
    for b in batches(rank):
        state, _ = step(state, b)
    full = {k: p.detach().full_tensor() for k, p in state.module.named_parameters()}
    return full, kinds, int(state.step)


def check_equals_torchao(rank, mode, clip):
    spy = Spy()
    try:
        mine, kinds, steps = fasttorch_run(rank, mode, clip)
        ours = list(spy.seen)
        spy.seen.clear()
        theirs = torchao_loop(rank, clip)
        hand = list(spy.seen)
    finally:
        spy.close()
    # Rule 2 for the clipped runs: FSDP2's clip_grad_norm_ sums the DTensor norms in
    # another order than fasttorch's one all-reduce of the shards' squares. Measured on
    # the unconverted model over the same global windows (4 microbatches of 8 rows).
    g = [
        (torch.cat([a[0] for a in w]), torch.cat([a[1] for a in w]))
        for w in zip(*[batches(r) for r in (0, 1)])
    ]
    windows = [list(zip(x.tensor_split(2 * N), y.tensor_split(2 * N))) for x, y in g]
    errors = fp32_reference_error(
        plain(), windows, make_opt=adam_twin(torch.optim.AdamW, LR, weight_decay=1e-2), clip=CLIP
    )
    return {
        "diff": max(float((mine[k] - theirs[k]).abs().max()) for k in theirs),
        "bound": params_atol(errors, theirs),
        "moved": max(float((mine[k] - p).abs().max()) for k, p in plain().named_parameters()),
        "steps": steps,
        "kinds": kinds,
        "gathers": ours,
        "hand_gathers": hand,
    }


def check_without_precompute(rank):
    spy = Spy()
    try:
        fasttorch_run(rank, "eager", False, precompute=False)
    finally:
        spy.close()
    return {"gathers": spy.seen}


def check_checkpoint_resume(rank, out_dir):
    """Save the sharded float8 state after 2 of 3 windows (DCP, each rank its shards),
    load it into a freshly converted and sharded model's state, run the last window:
    every parameter and optimizer tensor equals the uninterrupted run bit for bit."""
    from fasttorch import checkpoint

    def fresh():
        model = float8.convert(
            plain(), "tensorwise", emulate=True, enable_fsdp_float8_all_gather=True
        )
        return replicate(fasttorch.TrainState.create(shard(model), fasttorch.optim.adamw(LR)))

    step = float8.with_float8(
        fasttorch.clip_scaled(sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), N)), CLIP)
    )
    data = batches(rank)
    state = fresh()
    for b in data[:2]:
        state, _ = step(state, b)
    path = checkpoint.save(os.path.join(out_dir, "ckpt"), state)
    state, _ = step(state, data[2])
    resumed, _ = checkpoint.load(path, fresh(), inplace=True)
    resumed, _ = step(resumed, data[2])

    def whole(s):
        like = dict(s.module.named_parameters())
        out = {f"params/{k}": v.detach().full_tensor() for k, v in like.items()}
        for k, v in s.opt_state.slots["exp_avg"].items():
            out[f"exp_avg/{k}"] = v
        return out

    a, b = whole(state), whole(resumed)
    return {
        "equal": sorted(k for k in a if torch.equal(a[k], b[k])),
        "keys": sorted(a),
        "kinds": sorted({type(t).__name__ for t in resumed.params.values()}),
    }


CHECKS = {
    "eager": lambda r: check_equals_torchao(r, "eager", False),
    "eager_clip": lambda r: check_equals_torchao(r, "eager", True),
    "compiled_clip": lambda r: check_equals_torchao(r, "compiled", True),
    "no_precompute": check_without_precompute,
}
RUN_WITH_DIR = {"checkpoint": check_checkpoint_resume}


def run(rank, world, port, out_dir):
    join(rank, world, port, "cpu")
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(rank)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    for name, check in RUN_WITH_DIR.items():
        try:
            results[name] = check(rank, out_dir)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    leave()
