"""Peak memory of a training step with and without activation checkpointing.

    python -m benchmarks.activation_checkpointing [--depth 8] [--width 512] [--rows 1024]

A residual MLP (``depth`` pre-LayerNorm blocks, ``width -> 4 width -> width``, GELU)
trained by ``fasttorch.step`` with bf16 ``with_amp``, ``grad_accumulate`` (2) and
``clip_scaled``; each block run through ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` or not. For each variant and mode (``--modes``: eager, and
``compiled(step, backend=...)`` for each backend named), in a fresh process: the peak
of tensor bytes allocated during one step above what was live before it (the
profiler's memory events, CPU allocator), and the median step time of a few steps.
The state (parameters, AdamW moments) is the same in every variant and not counted.
Prints a markdown table for docs/transforms.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fasttorch


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, depth: int, ckpt: bool) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        out: torch.Tensor = self.head(x)
        return out


def loss_fn(apply: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(apply(x).float(), y)


def peak_bytes(run: Any) -> int:
    """Peak of the CPU allocator's total allocated bytes during ``run()``, above its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    totals = [
        int(e["args"]["Total Allocated"])
        for e in events
        if e.get("name") == "[memory]" and int(e["args"].get("Device Type", -1)) == 0
    ]
    return (max(totals) - min(0, *totals)) if totals else 0


def worker(args: argparse.Namespace, ckpt: bool, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net(args.width, args.depth, ckpt)
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-3))
    step = fasttorch.clip_scaled(
        fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(loss_fn), "bf16"), 2), 1.0
    )
    state = step.init(state)
    if mode != "eager":
        step = fasttorch.compiled(step, backend=mode)
    g = torch.Generator().manual_seed(1)
    batch = (
        torch.randn(args.rows, args.width, generator=g),
        torch.randn(args.rows, 1, generator=g),
    )
    holder = {"state": state}

    def one() -> None:
        holder["state"], metrics = step(holder["state"], batch)
        float(metrics["loss"])

    one()  # compiles, creates the optimizer moments
    one()
    peak = peak_bytes(one)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "step_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rows", type=int, default=1024, help="rows per step (2 microbatches)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument(
        "--modes", default="eager,aot_eager", help="eager and/or compiled backends, e.g. inductor"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        ckpt, mode = args.worker.split(",")
        print(json.dumps(worker(args, ckpt == "ckpt", mode)))
        return
    rows = []
    for mode in args.modes.split(","):
        for ckpt in ("plain", "ckpt"):
            argv = [sys.executable, "-m", "benchmarks.activation_checkpointing"]
            argv += [*sys.argv[1:], "--worker", f"{ckpt},{mode}"]
            out = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows.append((mode, ckpt, json.loads(out.stdout.strip().splitlines()[-1])))
    n_params = sum(p.numel() for p in Net(args.width, args.depth, False).parameters())
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}; depth {args.depth}, width "
        f"{args.width}, {args.rows} rows, {n_params / 1e6:.1f}M params, bf16, 2 microbatches\n"
    )
    print("| mode | checkpointing | step peak (MiB) | vs plain | step time (s) | vs plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    base: dict[str, dict[str, Any]] = {}
    for mode, ckpt, r in rows:
        b = base.setdefault(mode, r)
        print(
            f"| {mode} | {'per block' if ckpt == 'ckpt' else 'none'} | "
            f"{r['peak'] / 2**20:.0f} | {r['peak'] / b['peak']:.2f}x | {r['step_s']:.3f} | "
            f"{r['step_s'] / b['step_s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
