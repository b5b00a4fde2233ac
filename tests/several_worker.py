"""Checks run inside each rank of a 2-process gloo group (tests/test_several_distributed.py):
the guide's GAN with sync_on_last on each member against the hand loop with two
``no_sync``-wrapped DDP models."""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
from dist_kit import join
from test_several import (
    DTYPES,
    LR,
    d_loss,
    d_objective,
    g_loss,
    g_objective,
    gan_calls,
    gan_models,
    loop_error,
)
from tolerance import params_atol

import fasttorch
from fasttorch.distributed import replicate, sync_on_last

N = 2  # microbatches per window: one per call
ROWS = 8  # per rank


def shard(batch: Any, rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * ROWS : (rank + 1) * ROWS] for t in batch)


def ddp_gan(d: Any, g: Any, calls: Any, rank: int, precision: str) -> tuple[Any, Any]:
    """The guide's loop on two DDP models: no_sync on every microbatch but the last; G's
    loss through D's own module with D's parameters switched off (toggle_model)."""
    d_ddp, g_ddp = DDP(copy.deepcopy(d)), DDP(copy.deepcopy(g))
    d_opt = torch.optim.Adam(d_ddp.parameters(), lr=LR)
    g_opt = torch.optim.Adam(g_ddp.parameters(), lr=LR)
    fp16 = precision == "fp16"
    scalers = [torch.amp.GradScaler("cpu", enabled=fp16) for _ in range(2)]
    half = DTYPES.get(precision, torch.float32)
    for i, b in enumerate(calls):
        real, z = shard(b, rank)
        last = (i + 1) % N == 0
        with d_ddp.no_sync() if not last else _nothing():
            with torch.autocast("cpu", dtype=half, enabled=precision != "fp32"):
                ld = d_objective(d_ddp, real, g_ddp.module(z).detach())
            scalers[0].scale(ld / N).backward()
        if last:
            _step(d_opt, scalers[0])
        for p in d_ddp.parameters():
            p.requires_grad_(False)
        with g_ddp.no_sync() if not last else _nothing():
            with torch.autocast("cpu", dtype=half, enabled=precision != "fp32"):
                lg = g_objective(d_ddp.module(g_ddp(z)), real.dtype)
            scalers[1].scale(lg / N).backward()
        for p in d_ddp.parameters():
            p.requires_grad_(True)
        if last:
            _step(g_opt, scalers[1])
    return d_ddp.module, g_ddp.module


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _step(opt: Any, scaler: Any) -> None:
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def fast_gan(d: Any, g: Any, calls: Any, rank: int, precision: str, compile: bool) -> Any:
    def member(loss_fn: Any) -> fasttorch.Step:
        s = fasttorch.model_step(loss_fn)
        if precision != "fp32":
            s = fasttorch.with_amp(s, precision)
        return sync_on_last(fasttorch.grad_accumulate(s, N, across_calls=True))

    step = fasttorch.several({"d": member(d_loss), "g": member(g_loss)})
    if compile:
        step = fasttorch.compiled(step, backend="aot_eager")
    state = fasttorch.Models.create(
        d=replicate(fasttorch.TrainState.create(copy.deepcopy(d), fasttorch.optim.adam(LR))),
        g=replicate(fasttorch.TrainState.create(copy.deepcopy(g), fasttorch.optim.adam(LR))),
    )
    collectives: list[int] = []
    original = dist.all_reduce

    def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        collectives.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    per_call = []
    dist.all_reduce = counting
    try:
        for b in calls:
            collectives.clear()
            state, _ = step(state, shard(b, rank))
            per_call.append(len(collectives))
    finally:
        dist.all_reduce = original
    return state, per_call


def check(rank: int, precision: str, compile: bool, save_to: str | None = None) -> dict[str, Any]:
    d, g = gan_models(batchnorm=False)
    calls = gan_calls(4, size=2 * ROWS)
    ref_d, ref_g = ddp_gan(d, g, calls, rank, precision)
    state, per_call = fast_gan(d, g, calls, rank, precision, compile)
    ours = {}
    for tag, ref in (("d", ref_d), ("g", ref_g)):
        for k, v in ref.named_parameters():
            ours[f"{tag}.{k}"] = (state[tag].params[k], v.detach())
    # Rule 2 from the single-process loop on the whole batch (the same mathematics).
    errors = loop_error(d, g, calls, n=N)
    errors.pop("loss")
    half = {"precision": precision, "steps": 2, "lr": LR, "half_roundings": 2}
    atol = params_atol(errors, {k: a for k, (a, _) in ours.items()}, **half)
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in ours.values())
    out = {"diff": diff, "atol": atol, "per_call": per_call, "steps": int(state["g"].step)}
    if save_to is not None:  # saved by 2 ranks, loaded by one process in the test
        out["saved"] = fasttorch.checkpoint.save_models(save_to, state, data={"rank": rank})
        out["params"] = {
            f"{t}.{k}": v.tolist() for t in ("d", "g") for k, v in state[t].params.items()
        }
    return out


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    join(rank, world, port, "cpu")
    results = {}
    runs = (("fp32", False), ("fp32", True), ("fp16", False), ("fp16", True), ("bf16", False))
    for precision, compile in runs:
        name = f"{precision}_{'compiled' if compile else 'eager'}"
        save_to = os.path.join(out_dir, "ckpt") if name == "fp32_eager" else None
        try:
            results[name] = check(rank, precision, compile, save_to)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    os._exit(0)
