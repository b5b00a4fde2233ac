"""fasttorch data parallel against DistributedDataParallel with no_sync, 2 gloo ranks.

    python -m benchmarks.distributed            # rewrites docs/benchmarks_distributed.md

Same model, initial weights and data on both; 4 microbatches per update, gradients
reduced on the last only (DDP: ``no_sync()`` on the first three), clip at 1.0, AdamW
(foreach). Variants alternate within one process group, round after round (A B C A B C),
each timed over blocks of steps after untimed warm-up and compilation; the table gives
medians and ratios to DDP, and the largest parameter difference after the same steps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fasttorch
from fasttorch.distributed import replicate, sync_on_last

ROOT = Path(__file__).resolve().parent.parent
N_MICRO = 4


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def data(steps: int, micro_rows: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    rows = N_MICRO * micro_rows
    return [
        (torch.randn(rows, 64, generator=g), torch.randint(0, 10, (rows,), generator=g))
        for _ in range(steps)
    ]


def loss_fn(apply, batch):  # type: ignore[no-untyped-def]
    x, y = batch
    return nn.functional.cross_entropy(apply(x), y)


class DDPVariant:
    def __init__(self, model: nn.Module) -> None:
        self.ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3, foreach=True)

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        micro = list(zip(batch[0].tensor_split(N_MICRO), batch[1].tensor_split(N_MICRO)))
        for i, mb in enumerate(micro):
            ctx = self.ddp.no_sync() if i < N_MICRO - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(self.ddp, mb) / N_MICRO).backward()
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.ddp.module.named_parameters()}


class FastVariant:
    def __init__(self, model: nn.Module, compile_it: bool) -> None:
        step = sync_on_last(fasttorch.grad_accumulate(fasttorch.step(loss_fn), N_MICRO))
        step = fasttorch.clip_scaled(step, 1.0)
        self.step = fasttorch.compiled(step) if compile_it else step
        opt = fasttorch.optim.adamw(1e-3, weight_decay=1e-2)
        self.state = replicate(fasttorch.TrainState.create(copy.deepcopy(model), opt))

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.state, _ = self.step(self.state, batch)

    def params(self) -> dict[str, torch.Tensor]:
        return self.state.params


def worker(rank: int, port: int, cfg: dict, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    model = make_model(cfg["width"], cfg["depth"])
    variants = {
        "DDP no_sync": DDPVariant(model),
        "fasttorch": FastVariant(model, False),
        "fasttorch compiled": FastVariant(model, True),
    }
    # Equal parameters: the same steps from the same weights.
    check = data(cfg["check_steps"], cfg["micro_rows"], rank)
    compile_s = 0.0
    for name, v in variants.items():
        t = time.perf_counter()
        for b in check:
            v(b)
        if name == "fasttorch compiled":
            compile_s = time.perf_counter() - t
    ref = variants["DDP no_sync"].params()
    diffs = {
        name: max(float((v.params()[k] - ref[k]).abs().max()) for k in ref)
        for name, v in variants.items()
        if name != "DDP no_sync"
    }
    # Timing: interleaved rounds of blocks, after warm-up.
    batches = data(cfg["block"], cfg["micro_rows"], rank)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(cfg["rounds"]):
        for name, v in variants.items():
            for b in batches[: cfg["warmup"]]:
                v(b)
            dist.barrier()
            t = time.perf_counter()
            for b in batches:
                v(b)
            dist.barrier()
            times[name].append((time.perf_counter() - t) / len(batches))
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "diffs": diffs, "compile_s": compile_s}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--micro-rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=30, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_distributed.md"))
    a = p.parse_args(argv)
    cfg = vars(a)
    with tempfile.TemporaryDirectory() as tmp:
        res_path = os.path.join(tmp, "r.json")
        mp.spawn(worker, args=(free_port(), cfg, res_path), nprocs=2, join=True)
        res = json.loads(Path(res_path).read_text())
    base = statistics.median(res["times"]["DDP no_sync"])
    rows = []
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        diff = "reference" if name == "DDP no_sync" else f"{res['diffs'][name]:.1e}"
        rows.append(
            f"| {name} | {med * 1e3:.2f} | {base / med:.2f}x | "
            f"{' '.join(f'{t * 1e3:.1f}' for t in ts)} | {diff} |"
        )
    n_params = sum(q.numel() for q in make_model(a.width, a.depth).parameters())
    text = f"""# Data parallel: fasttorch against DDP

Generated by `python -m benchmarks.distributed` on {datetime.date.today()}; do not edit
by hand. Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores,
Python {platform.python_version()}, torch {torch.__version__}. 2 gloo ranks on one
machine, {a.threads} torch thread(s) each, `OMP_WAIT_POLICY={os.environ.get("OMP_WAIT_POLICY")}`.

Work: an MLP of {n_params / 1e6:.2f}M parameters (width {a.width}, {a.depth} hidden
blocks with LayerNorm), fp32, 4 microbatches of {a.micro_rows} rows per rank and update,
gradients reduced on the last microbatch only (DDP: `no_sync()` on the first three),
`clip_grad_norm_(1.0)`, AdamW (foreach). Each round runs every variant for {a.warmup}
untimed steps, then a block of {a.block} timed steps between barriers; variants alternate
within each of {a.rounds} rounds. "max |param diff|" is the largest parameter difference
from DDP after {a.check_steps} identical steps from the same weights and data.

| variant | ms/step (median) | speed vs DDP | ms/step per round | max abs param diff vs DDP |
| --- | --- | --- | --- | --- |
{chr(10).join(rows)}

The compiled variant's first {a.check_steps} steps, compilation included, took
{res["compile_s"]:.1f} s. On a GPU machine the same script runs with NCCL where
`torch.cuda.is_available()`; see docs/benchmarks.md for the single-process suite.
"""
    Path(a.out).write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
