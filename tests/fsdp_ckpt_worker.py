"""Checks run inside each rank of a 2-process gloo group over checkpoints of states
sharded with FSDP2 (tests/test_fsdp_checkpoint.py). The model has parameters whose
rows do not split evenly over 2 ranks (15 of them) and one whose single row leaves
rank 1 an empty shard.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from dist_kit import join, leave
from fsdp_worker import compose, global_batches, shard
from reference import LayerNormNet

import fasttorch
from fasttorch import checkpoint
from fasttorch.distributed import replicate
from fasttorch.distributed.fsdp import as_dtensor, sharded_leaves
from fasttorch.evaluation import eval_step
from fasttorch.state import local_tensor

LR = 1e-2
WIDTH = 15  # rows split 8 + 7 over 2 ranks
K, M = 2, 2  # steps before the save, steps after it


class GatedNet(LayerNormNet):
    """LayerNormNet with a one-element gate: FSDP2 gives rank 1 an empty shard of it."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__(width=width)
        self.gate = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gate


def plain_model(width: int = WIDTH) -> GatedNet:
    torch.manual_seed(0)
    return GatedNet(width)


def sharded_model(width: int = WIDTH) -> GatedNet:
    m = plain_model(width)
    fully_shard(m.inp)
    fully_shard(m.hidden)
    fully_shard(m)
    return m


def new_state(step: Any, sharded: bool, width: int = WIDTH) -> fasttorch.TrainState:
    """A fresh state of the composition ``step`` (EMA, AdamW, clip, accumulation)."""
    model = sharded_model(width) if sharded else plain_model(width)
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR))
    if sharded:
        state = replicate(state)
    return step.init(state)


def leaves(state: fasttorch.TrainState) -> dict[str, torch.Tensor]:
    """Every leaf by path, copied (a sharded state's: this rank's shards)."""
    return {
        pytree.keystr(p): t.detach().clone() for p, t in pytree.tree_flatten_with_path(state)[0]
    }


def gathered(state: fasttorch.TrainState) -> dict[str, torch.Tensor]:
    """Every leaf by path, the shards gathered whole (a collective)."""
    shards = sharded_leaves(state)
    out = {}
    for i, (p, t) in enumerate(pytree.tree_flatten_with_path(state)[0]):
        like = shards.get(i)
        out[pytree.keystr(p)] = t.clone() if like is None else as_dtensor(t, like).full_tensor()
    return out


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return global_batches(1, seed=99)[0]


def train(step, state, data, rank):
    metrics = []
    for b in data:
        state, m = step(state, shard(b, rank))
        metrics.append(pytree.tree_map(lambda t: t.detach().clone(), m))
    return state, metrics


def check_save_and_resume(rank: int, out: Path) -> dict[str, Any]:
    """Train K steps, evaluate (EMA and not), save (sync and async), train M more; a
    fresh sharded template loaded from each checkpoint trains the same M steps."""
    step = compose("ema", True)
    data = global_batches(K + M)
    state, _ = train(step, new_state(step, True), data[:K], rank)
    x = eval_batch()
    before = leaves(state)
    evaluate, evaluate_ema = eval_step(step), eval_step(step, use_ema=True)
    loss = evaluate(state, x)["loss"]
    ema_loss = evaluate_ema(state, x)["loss"]
    res: dict[str, Any] = {
        "loss": float(loss),
        "ema_loss": float(ema_loss),
        # The averages went back out of the module: the state and the module's
        # forward are the parameters', bitwise.
        "eval_restored": all(torch.equal(t, leaves(state)[k]) for k, t in before.items())
        and torch.equal(evaluate(state, x)["loss"], loss)
        and torch.equal(state.apply(x[0]), state.apply(x[0])),
    }
    # The root is left unsharded by the forwards above: save reshards it first.
    root = Path(out, "ck")
    saved = checkpoint.save(root, state, data={"next": K, "rank": rank}, name="sync")
    whole = gathered(state)
    if rank == 0:
        torch.save(whole, out / "at_save.pt")
    handle = checkpoint.async_save(root, state, data={"next": K}, name="async")
    state, metrics = train(step, state, data[K:], rank)  # runs while "async" is written
    handle.wait()
    final = leaves(state)
    for name in ("sync", "async"):
        template = new_state(step, True)
        module = template.module
        resumed, got = checkpoint.load(root / name, template, inplace=True)
        own = all(
            resumed.params[k].data_ptr() == local_tensor(p).data_ptr()
            for k, p in module.named_parameters()
        )
        resumed, again = train(step, resumed, data[K:], rank)
        after = leaves(resumed)
        res[name] = {
            "data": got,
            "module_storage": own,
            "leaves_equal": final.keys() == after.keys()
            and all(torch.equal(final[k], after[k]) for k in final),
            "metrics_equal": all(
                torch.equal(a, b)
                for ma, mb in zip(metrics, again, strict=True)
                for a, b in zip(pytree.tree_leaves(ma), pytree.tree_leaves(mb), strict=True)
            ),
        }
    res["path"] = str(saved)
    return res


def check_load_one_process_checkpoint(rank: int, out: Path, single: str) -> dict[str, Any]:
    """1 -> 2: each rank's shards are the matching rows of the saved whole tensors."""
    whole = torch.load(Path(single).parent / "whole.pt", weights_only=True)
    step = compose("ema", True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, data = checkpoint.load(single, new_state(step, True), inplace=True)
    shards = sharded_leaves(state)
    world = dist.get_world_size()
    sharded, equal, mismatched = 0, 0, []
    for i, (p, t) in enumerate(pytree.tree_flatten_with_path(state)[0]):
        k = pytree.keystr(p)
        if k == ".rng":
            continue
        if i in shards:
            sharded += 1
            # FSDP2's rows of dim 0: torch.chunk's (rank 1 of a 1-row tensor: none)
            parts = torch.chunk(whole[k], world, dim=0)
            expect = parts[rank] if rank < len(parts) else whole[k][:0]
        else:
            expect = whole[k]
        if torch.equal(t, expect):
            equal += 1
        else:
            mismatched.append(k)
    return {
        "data": data,
        "sharded": sharded,
        "compared": equal + len(mismatched),
        "mismatched": mismatched,
        "rng_warned": any("keeps the template's value" in str(w.message) for w in caught),
    }


def check_errors(rank: int, out: Path) -> dict[str, Any]:
    """Mistakes that raise on every rank, before any collective could hang."""
    step = compose("ema", True)
    path = out / "ck" / "sync"
    res: dict[str, Any] = {}
    try:
        checkpoint.load(path, new_state(step, True, width=16), inplace=True)
        res["mismatch"] = None
    except checkpoint.CheckpointMismatchError as e:
        res["mismatch"] = str(e)
    template = new_state(step, True)
    try:
        checkpoint.load(path, template)
        res["not_inplace"] = None
    except ValueError as e:
        res["not_inplace"] = str(e)
    res["template_alive"] = int(template.step) == 0  # not donated by the refused load
    return res


def run(rank: int, world: int, port: int, out_dir: str, single: str) -> None:
    join(rank, world, port, "cpu")
    out = Path(out_dir)
    checks = {
        "resume": lambda: check_save_and_resume(rank, out),
        "one_to_two": lambda: check_load_one_process_checkpoint(rank, out, single),
        "errors": lambda: check_errors(rank, out),
    }
    results = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump(results, f)
    leave()
