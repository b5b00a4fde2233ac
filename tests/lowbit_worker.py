"""A 2-rank gloo group for tests/test_lowbit_optim.py: torchao's quantized optimizer
states in a state sharded with FSDP2, checkpointed: resumed on the same 2 ranks, and
loaded from one-process checkpoints (1 -> 2, resharded and requantized)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from dist_kit import join, leave
from torch import nn
from torch.distributed.fsdp import fully_shard

import fasttorch
from fasttorch import checkpoint
from fasttorch.distributed import replicate

K, M = 2, 2  # steps before the save, steps after it


def model() -> nn.Module:
    """A (128, 64) weight: 64 x 64 = 4096 values a rank on 2 ranks, quantized there and
    whole; the rest (4 x 128, the biases) stays float32."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))


def new_state(cls: Any, sharded: bool) -> fasttorch.TrainState:
    m = model()
    if sharded:
        fully_shard(m)
    state = fasttorch.TrainState.create(m, fasttorch.optim.from_torchao(cls, 1e-2))
    return replicate(state) if sharded else state


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 64, generator=g), torch.randn(4, 4, generator=g)) for _ in range(K + M)]


def loss(apply: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(apply(x), y)


def inner(state: fasttorch.TrainState) -> dict[str, torch.Tensor]:
    """Every leaf by path, a quantized state by its inner tensors (codes, scales), copied."""
    out = {}
    for path, t in pytree.tree_flatten_with_path(state)[0]:
        key = pytree.keystr(path)
        if hasattr(type(t), "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                out[f"{key}.{name}"] = getattr(t, name).clone()
        else:
            out[key] = t.detach().clone()
    return out


def values(state: fasttorch.TrainState) -> dict[str, torch.Tensor]:
    """Every leaf by path, a quantized state dequantized, with its type's name."""
    out = {}
    for path, t in pytree.tree_flatten_with_path(state)[0]:
        deq = t.dequantize() if hasattr(type(t), "__tensor_flatten__") else t.detach()
        out[pytree.keystr(path)] = deq.clone()
    return out


def check_resume(rank: int, out: Path) -> dict[str, Any]:
    """K steps, a save, M more; a fresh template loaded from the save, the same M steps:
    every leaf (codes and scales included) the same, bitwise."""
    import torchao.optim as ao

    step = fasttorch.sync_on_last(fasttorch.step(loss))
    data = batches(rank)
    with torch.compiler.set_stance("force_eager"):
        state = new_state(ao.AdamW8bit, True)
        for b in data[:K]:
            state, _ = step(state, b)
        path = checkpoint.save(out / "ck", state)
        torch.save(values(state), out / f"saved_values{rank}.pt")
        for b in data[K:]:
            state, _ = step(state, b)
        loaded, _ = checkpoint.load(path, new_state(ao.AdamW8bit, True), inplace=True)
        for b in data[K:]:
            loaded, _ = step(loaded, b)
    ours, theirs = inner(loaded), inner(state)
    return {
        "kind": type(state.opt_state.slots["exp_avg"]["0.weight"]).__name__,
        "keys_equal": ours.keys() == theirs.keys(),
        "compared": len(ours),
        "mismatched": [k for k in ours if not torch.equal(ours[k], theirs.get(k))],
        "path": str(path),
    }


def check_one_to_two(rank: int, out: Path, singles: dict[str, str]) -> dict[str, Any]:
    """One-process checkpoints (of torchao's class name -> path) loaded into 2 sharded
    ranks: this rank's values and inner tensors saved for the test to compare with its
    rows of the saved whole ones."""
    import torchao.optim as ao

    kinds = {}
    for name, single in singles.items():
        state, _ = checkpoint.load(single, new_state(getattr(ao, name), True), inplace=True)
        torch.save(values(state), out / f"one_to_two_{name}{rank}.pt")
        torch.save(inner(state), out / f"one_to_two_inner_{name}{rank}.pt")
        kinds[name] = type(state.opt_state.slots["exp_avg"]["0.weight"]).__name__
    return kinds


def run(rank: int, world: int, port: int, out_dir: str, singles: dict[str, str]) -> None:
    join(rank, world, port, "cpu")
    out = Path(out_dir)
    results: dict[str, Any] = {}
    for name, fn in (
        ("resume", lambda: check_resume(rank, out)),
        ("one_to_two", lambda: check_one_to_two(rank, out, singles)),
    ):
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump(results, f)
    leave()
