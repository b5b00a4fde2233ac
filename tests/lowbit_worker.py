"""A 2-rank gloo group for tests/test_lowbit_optim.py: torchao's quantized optimizer
states in a state sharded with FSDP2, and the checkpoint's refusal to reshard them."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_kit import join, leave
from torch import nn
from torch.distributed.fsdp import fully_shard

import fasttorch
from fasttorch import checkpoint
from fasttorch.distributed import replicate


def sharded_state(cls: Any) -> fasttorch.TrainState:
    """A (128, 64) weight sharded by rows: 64 x 64 = 4096 values a rank, quantized."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))
    fully_shard(model)
    state = fasttorch.TrainState.create(model, fasttorch.optim.from_torchao(cls, 1e-2))
    return replicate(state)


def check_refusals(rank: int, out: Path) -> dict[str, Any]:
    import torchao.optim as ao

    state = sharded_state(ao.AdamW8bit)
    res: dict[str, Any] = {
        "kind": type(state.opt_state.slots["exp_avg"]["0.weight"]).__name__,
    }
    for api in ("save", "load"):
        try:
            if api == "save":
                checkpoint.save(out / "ck", state)
            else:
                checkpoint.load(out / "missing", state, inplace=True)
            res[api] = None
        except checkpoint.CheckpointError as e:
            res[api] = str(e)
    res["nothing_written"] = not any((out / "ck").glob("step_*"))
    return res


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    join(rank, world, port, "cpu")
    out = Path(out_dir)
    try:
        results = {"refusals": check_refusals(rank, out)}
    except Exception:
        results = {"refusals": {"exception": traceback.format_exc()}}
    dist.barrier()
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump(results, f)
    leave()
