"""Checks run inside each rank of a 2-process gloo group (tests/test_distributed.py).

Run by ``torch.multiprocessing`` from the tests, or by ``torchrun`` for the smoke test:
``python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_worker.py``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from dist_kit import join
from reference import LayerNormNet, mse
from tolerance import FACTOR, fp32_reference_error, params_atol, relative_reference_error

import fasttorch
from fasttorch.distributed import (
    DistributedStepError,
    replicate,
    setup,
    sync_on_last,
)

ROWS = (16, 14)  # rank 0 and rank 1 shards of a 30-row global batch: unequal on purpose


def global_batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(30, 8, generator=g), torch.randn(30, 4, generator=g)) for _ in range(steps)
    ]


def shard(batch, rank):
    lo = sum(ROWS[:rank])
    return tuple(t[lo : lo + ROWS[rank]] for t in batch)


def new_state(seed=0, opt=None):
    torch.manual_seed(seed)
    return fasttorch.TrainState.create(LayerNormNet(), opt or fasttorch.optim.adamw(1e-2))


def params_equal_across_ranks(state):
    flat = torch.cat([p.reshape(-1) for p in state.params.values()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out[1:])


def max_rel_diff(a, b):
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def check_equals_single_process(rank, across, mode):
    """Data parallel with unequal shards == one process on the full batch (to rounding)."""
    n = 2
    data = global_batches(4)
    ref = fasttorch.clip_scaled(fasttorch.step(mse, donate=False), 1.0)
    ref_state = new_state()
    for b in data:
        ref_state, _ = ref(ref_state, b)
    step = fasttorch.clip_scaled(
        sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), n, across_calls=across)), 1.0
    )
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
    state = replicate(new_state(seed=rank))  # rank 1 starts elsewhere: replicate fixes it
    equal_every_step = True
    for b in data:
        mine = shard(b, rank)
        if across:
            for micro in zip(*(t.tensor_split(n) for t in mine)):
                state, _ = step(state, tuple(micro))
        else:
            state, m = step(state, mine)
        equal_every_step &= params_equal_across_ranks(state)
    # The bound: the fp32 hand-written loop's own error against float64, in the same
    # metric, times tolerance.FACTOR (tests/README.md).
    torch.manual_seed(0)
    errors = fp32_reference_error(
        LayerNormNet(),
        [[b] for b in data],
        make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
        clip=1.0,
    )
    return {
        "rel_diff": max_rel_diff(state.params, ref_state.params),
        "bound": FACTOR * relative_reference_error(errors, ref_state.params),
        "bitwise_equal_every_step": bool(equal_every_step),
        "steps": int(state.step),
    }


def check_collective_counts(rank):
    """No collective before the last microbatch; one per bucket + one for counts on it."""
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    out = {}
    for bucket_mb, name in ((25.0, "one_bucket"), (1e-4, "bucket_per_param")):
        step = sync_on_last(
            fasttorch.grad_accumulate(fasttorch.step(mse), 3, across_calls=True),
            bucket_mb=bucket_mb,
        )
        state = replicate(new_state())
        per_call = []
        dist.all_reduce = counting
        try:
            for b in global_batches(6):
                calls.clear()
                state, _ = step(state, shard(b, rank))
                per_call.append(len(calls))
        finally:
            dist.all_reduce = original
        out[name] = per_call
    out["n_params"] = len(new_state().params)
    return out


def check_fp16_overflow_on_one_rank(rank):
    step = sync_on_last(fasttorch.with_amp(fasttorch.step(mse), "fp16"))
    state = replicate(new_state())
    b = shard(global_batches(1)[0], rank)
    if rank == 1:
        b = (b[0] * float("inf"), b[1])
    before = {k: v.clone() for k, v in state.params.items()}
    state, m = step(state, b)
    scales = [torch.zeros(()) for _ in range(2)]
    dist.all_gather(scales, state.substates["amp"].scale)
    return {
        "skipped": bool(m["skipped"]),
        "unchanged": all(torch.equal(before[k], state.params[k]) for k in before),
        "scales": [float(s) for s in scales],
    }


def check_replicate_rng(rank):
    state = replicate(new_state(seed=rank))
    rngs = [torch.zeros_like(state.rng) for _ in range(2)]
    dist.all_gather(rngs, state.rng)
    return {
        "rng_differs": not torch.equal(rngs[0], rngs[1]),
        "params_equal": params_equal_across_ranks(state),
    }


def check_no_recompiles_compiled(rank):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = fasttorch.compiled(
        sync_on_last(fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(mse), "fp16"), 2)),
        backend="aot_eager",
    )
    state = replicate(new_state(opt=fasttorch.optim.adamw(fasttorch.schedules.cosine(1e-2, 10))))
    for b in global_batches(6):
        state, _ = step(state, shard(b, rank))
    c = torch._dynamo.utils.counters
    return {
        "recompiles": sum(c["recompiles"].values()),
        "graph_breaks": len(c["graph_break"]),
        "graphs": c["stats"]["unique_graphs"],
        "equal": params_equal_across_ranks(state),
    }


def check_disagreeing_microbatches(rank):
    n = 2 if rank == 0 else 3
    step = sync_on_last(
        fasttorch.grad_accumulate(fasttorch.step(mse), n), timeout=datetime.timedelta(seconds=20)
    )
    return error_of(step, replicate(new_state()), rank)


def error_of(step, state, rank):
    """Run one step; return the DistributedStepError it raised and how long it took."""
    t = time.monotonic()
    try:
        step(state, shard(global_batches(1)[0], rank))
    except DistributedStepError as e:
        return {"error": str(e), "seconds": time.monotonic() - t}
    return {"error": None}


def check_missing_rank_times_out(rank):
    """Rank 1 stops early: rank 0 gets an error within the timeout, not a hang."""
    step = sync_on_last(fasttorch.step(mse), timeout=datetime.timedelta(seconds=3))
    state = replicate(new_state())
    if rank == 1:
        time.sleep(8)
        return {"error": None}
    return error_of(step, state, rank)


def check_empty_window(rank):
    """Every token of both ranks masked out: the global window is empty, and skipped."""

    def masked(apply, batch):
        x, y, mask = batch
        per_row = ((apply(x) - y) ** 2).mean(-1)
        count = mask.sum()
        return fasttorch.Loss((per_row * mask).sum() / count.clamp(min=1), weight=count)

    step = sync_on_last(fasttorch.step(masked), timeout=datetime.timedelta(seconds=20))
    state = replicate(new_state())
    x, y = shard(global_batches(1)[0], rank)
    state, _ = step(state, (x, y, torch.ones(len(x))))
    before = [t.clone() for t in torch.utils._pytree.tree_leaves((state.params, state.opt_state))]
    # Rank 0 keeps no token and rank 1 none either: nothing to average.
    state, m = step(state, (x, y, torch.zeros(len(x))))
    after = torch.utils._pytree.tree_leaves((state.params, state.opt_state))
    return {
        "skipped": bool(m["skipped"]),
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
    }


def check_dead_peer(rank):
    """Rank 1 dies while rank 0 waits in a step: rank 0 says a collective failed."""
    if rank == 1:
        time.sleep(1.0)  # rank 0 is inside the step by now, waiting for rank 1
        return EXIT
    step = sync_on_last(fasttorch.step(mse), timeout=datetime.timedelta(seconds=30))
    return error_of(step, new_state(), rank)


EXIT = {"exit": True}  # the rank writes its results and exits at once


class Branchy(torch.nn.Module):
    """A trunk and three heads: each rank's loss uses its own head (``a`` on rank 0,
    ``b`` on rank 1) and no rank uses ``never``."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 8)
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(8, 4)
        self.never = torch.nn.Linear(8, 4)

    def forward(self, x, which):
        return (self.a if which == 0 else self.b)(torch.tanh(self.trunk(x)))


def _ddp_unused(model, windows, rank, make_opt):
    """DDP(find_unused_parameters=True) + torch.optim, accumulating with no_sync."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, find_unused_parameters=True)
    opt = make_opt(ddp.parameters())
    for window in windows:
        for i, (x, y) in enumerate(window):
            ctx = ddp.no_sync() if i < len(window) - 1 else contextlib.nullcontext()
            with ctx:
                (F.mse_loss(ddp(x, rank), y) / len(window)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: p.detach() for k, p in model.named_parameters()}


def check_unused_parameters(rank):
    """Parameters no rank uses are left alone (no momentum, no weight decay); one used
    on one rank only gets the average with the other rank's zeros: as DDP with
    find_unused_parameters=True and torch.optim, sgd and adamw, eager and compiled."""
    cases = {
        "sgd_eager_n1": ("sgd", "eager", 1),
        "sgd_eager": ("sgd", "eager", 2),
        "sgd_compiled": ("sgd", "compiled", 2),
        "adamw_eager": ("adamw", "eager", 2),
        "adamw_compiled": ("adamw", "compiled", 2),
    }
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(3)]
    mine = [tuple(t[8 * rank : 8 * rank + 8] for t in b) for b in data]
    out = {}
    for name, (opt_name, mode, n) in cases.items():
        torch.manual_seed(3)
        model = Branchy()
        if opt_name == "sgd":
            opt = fasttorch.optim.sgd(0.1, momentum=0.9, weight_decay=0.1)
            make_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1)  # noqa: E731
        else:
            opt = fasttorch.optim.adamw(1e-2, weight_decay=0.1)
            make_opt = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)  # noqa: E731
        windows = [list(zip(*(t.tensor_split(n) for t in b))) for b in mine]
        ref = _ddp_unused(copy.deepcopy(model), windows, rank, make_opt)
        windows64 = [[tuple(t.double() for t in m) for m in w] for w in windows]
        ref64 = _ddp_unused(copy.deepcopy(model).double(), windows64, rank, make_opt)
        errors = {k: float((ref[k].double() - ref64[k]).abs().max()) for k in ref}

        def loss_fn(apply, batch):
            x, y = batch
            return F.mse_loss(apply(x, rank), y)

        step = sync_on_last(fasttorch.grad_accumulate(fasttorch.step(loss_fn), n))
        if mode == "compiled":
            step = fasttorch.compiled(step, backend="aot_eager", dynamic=False)
        state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
        for b in mine:
            state, _ = step(state, b)
        init = dict(model.named_parameters())
        out[name] = {
            "diff": max(float((state.params[k] - ref[k]).abs().max()) for k in ref),
            "bound": params_atol(errors, ref),
            "never_kept": all(
                torch.equal(state.params[k], init[k].detach())
                for k in ("never.weight", "never.bias")
            ),
            "ddp_never_kept": all(
                torch.equal(ref[k], init[k].detach()) for k in ("never.weight", "never.bias")
            ),
            "other_head_moved": not torch.equal(
                state.params["b.weight" if rank == 0 else "a.weight"],
                init["b.weight" if rank == 0 else "a.weight"].detach(),
            ),
        }
    return out


CHECKS = {
    "within_eager": lambda r: check_equals_single_process(r, False, "eager"),
    "across_eager": lambda r: check_equals_single_process(r, True, "eager"),
    "within_compiled": lambda r: check_equals_single_process(r, False, "compiled"),
    "counts": check_collective_counts,
    "fp16": check_fp16_overflow_on_one_rank,
    "rng": check_replicate_rng,
    "compiled": check_no_recompiles_compiled,
    "disagree": check_disagreeing_microbatches,
    "empty_window": check_empty_window,
    "unused": check_unused_parameters,
    "timeout": check_missing_rank_times_out,  # it leaves the group unusable
    "dead_peer": check_dead_peer,  # last: rank 1 exits
}


def run(rank, world, port, out_dir):
    join(rank, world, port, "cpu")
    results = {}
    for name, check in CHECKS.items():
        try:
            results[name] = check(rank)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        if results[name] is EXIT:
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    os._exit(0)  # the timed-out group cannot be torn down cleanly


def smoke_device(world):
    """A GPU per rank (NCCL) when there are enough of them, else the CPU (gloo): one
    process per rank on one GPU is what CUDA calls an invalid device ordinal."""
    return "cuda" if torch.cuda.device_count() >= world else "cpu"


def smoke():
    """Under torchrun: a few data-parallel steps; prints one line per rank."""
    torch.set_num_threads(1)
    rank, world, device = setup(smoke_device(int(os.environ["WORLD_SIZE"])))
    step = sync_on_last(fasttorch.grad_accumulate(fasttorch.step(mse), 2))
    torch.manual_seed(0)
    state = replicate(
        fasttorch.TrainState.create(LayerNormNet().to(device), fasttorch.optim.adamw(1e-2))
    )
    for b in global_batches(3):
        state, m = step(state, tuple(t.to(device) for t in shard(b, rank)))
    line = (
        f"rank {rank}/{world} on {device}: step {int(state.step)} "
        f"loss {float(m['loss']):.4f} equal={params_equal_across_ranks(state)}\n"
    )
    sys.stdout.write(line)  # one write per rank: the ranks share the pipe
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    smoke()
