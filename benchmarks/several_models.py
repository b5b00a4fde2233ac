"""A GAN step over two models: fasttorch's compiled step against the plain loop.

The guide's GAN loop (each call one microbatch of both models, accumulation over 2
calls, the discriminator's update then the generator's through it) on a small MLP GAN
with BatchNorm in both models, fp32, three ways, timed in interleaved rounds (median of
the rounds' calls per second):

* ``fasttorch``: ``compiled(several({"d": d_step, "g": g_step}))``, each member's step
  ``grad_accumulate(model_step(loss_fn), 2, across_calls=True)``;
* ``hand``: the plain loop with two ``torch.optim.Adam`` (foreach), ``requires_grad_``
  toggled around the generator's loss;
* ``hand + torch.compile``: the same loop with ``torch.compile`` on both models (the
  backward and the optimizers stay outside the graphs).

Writes its table to docs/benchmarks_several.md::

    python -m benchmarks.several_models            # minutes: compiling
    python -m benchmarks.several_models --smoke    # the machinery, in seconds (aot_eager)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fasttorch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks_several.md"
bce = nn.functional.binary_cross_entropy_with_logits
N = 2  # calls per window


def models(width: int, latent: int, data: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(
        nn.Linear(latent, width, bias=False),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, data),
    )
    d = nn.Sequential(
        nn.Linear(data, width),
        nn.LeakyReLU(0.2),
        nn.Linear(width, width, bias=False),
        nn.BatchNorm1d(width),
        nn.LeakyReLU(0.2),
        nn.Linear(width, 1),
    )
    return d, g


def d_objective(d: Callable[..., Any], real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    on_real, on_fake = d(real), d(fake)
    return bce(on_real, torch.ones_like(on_real)) + bce(on_fake, torch.zeros_like(on_fake))


def g_objective(out: torch.Tensor) -> torch.Tensor:
    return bce(out, torch.ones_like(out))


def d_loss(apply: Any, batch: Any, models: Any) -> torch.Tensor:
    real, z = batch
    return d_objective(apply, real, models["g"](z).detach())


def g_loss(apply: Any, batch: Any, models: Any) -> torch.Tensor:
    return g_objective(models["d"](apply(batch[1])))


Runner = Callable[[Any], None]


def fast_runner(d: nn.Module, g: nn.Module, backend: str) -> Runner:
    def member(fn: Any) -> fasttorch.Step:
        return fasttorch.grad_accumulate(fasttorch.model_step(fn), N, across_calls=True)

    step = fasttorch.compiled(
        fasttorch.several({"d": member(d_loss), "g": member(g_loss)}), backend=backend
    )
    box = [
        fasttorch.Models.create(
            d=fasttorch.TrainState.create(copy.deepcopy(d), fasttorch.optim.adam(1e-3)),
            g=fasttorch.TrainState.create(copy.deepcopy(g), fasttorch.optim.adam(1e-3)),
        )
    ]

    def run(batch: Any) -> None:
        box[0], _ = step(box[0], batch)

    return run


def hand_runner(d: nn.Module, g: nn.Module, compile_backend: str | None) -> Runner:
    d, g = copy.deepcopy(d), copy.deepcopy(g)
    d_opt = torch.optim.Adam(d.parameters(), lr=1e-3, foreach=True)
    g_opt = torch.optim.Adam(g.parameters(), lr=1e-3, foreach=True)
    d_fn: Any = d if compile_backend is None else torch.compile(d, backend=compile_backend)
    g_fn: Any = g if compile_backend is None else torch.compile(g, backend=compile_backend)
    count = [0]

    def run(batch: Any) -> None:
        real, z = batch
        last = (count[0] + 1) % N == 0
        count[0] += 1
        (d_objective(d_fn, real, g_fn(z).detach()) / N).backward()
        if last:
            d_opt.step()
            d_opt.zero_grad(set_to_none=True)
        d.requires_grad_(False)
        (g_objective(d_fn(g_fn(z))) / N).backward()
        d.requires_grad_(True)
        if last:
            g_opt.step()
            g_opt.zero_grad(set_to_none=True)

    return run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    d, g = models(args.width, args.latent, args.data)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.batch, args.data, generator=gen),
            torch.randn(args.batch, args.latent, generator=gen),
        )
        for _ in range(2 * N)
    ]
    runners = {
        "fasttorch": fast_runner(d, g, args.backend),
        "hand": hand_runner(d, g, None),
        "hand + torch.compile": hand_runner(d, g, args.backend),
    }
    first: dict[str, float] = {}
    for name, run in runners.items():  # the first call compiles; then a warm-up window
        t = time.perf_counter()
        run(batches[0])
        first[name] = time.perf_counter() - t
        for b in batches[1:]:
            run(b)
    rates: dict[str, list[float]] = {n: [] for n in runners}
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))  # interleaved
        for name in order:
            run = runners[name]
            t = time.perf_counter()
            for i in range(args.calls):
                run(batches[i % len(batches)])
            rates[name].append(args.calls / (time.perf_counter() - t))
    return {"rates": rates, "first": first}


def write(args: argparse.Namespace, result: dict[str, Any], out: Path) -> None:
    rates, first = result["rates"], result["first"]
    med = {n: statistics.median(v) for n, v in rates.items()}

    def ratio(a: str, b: str) -> float:  # the median of the per-round ratios
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmarks: a GAN step over two models",
        "",
        "Written by `python -m benchmarks.several_models` (never edit by hand). The guide's",
        "GAN loop: each call is one microbatch of both models, 2 calls per update; the",
        "discriminator's update, then the generator's through it. Calls per second, median",
        "over interleaved rounds; ratios are the medians of each round's ratios.",
        "`fasttorch`: `compiled(several({...}))`, each member",
        "`grad_accumulate(model_step(loss_fn), 2, across_calls=True)`; `hand`: the plain",
        "loop, two `torch.optim.Adam` (foreach);",
        "`hand + torch.compile`: the same loop with `torch.compile` on both models.",
        "",
        "## Conditions",
        "",
        f"- date: {now}{' (smoke run: the numbers mean nothing)' if args.smoke else ''}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, {args.threads} torch threads",
        f"- load average at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (a shared "
        "machine: read the ratios, from one interleaved run, more than the rates)",
        f"- backend: {args.backend}; {args.rounds} rounds x {args.calls} calls per runner; "
        "first call: a cold compile (a fresh inductor cache directory)",
        f"- models: MLP GAN, width {args.width}, latent {args.latent}, data {args.data}, "
        f"BatchNorm in both; batch {args.batch}; fp32",
        "",
        "| runner | calls/s | vs hand | vs hand + torch.compile | first call s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in rates:
        lines.append(
            f"| {name} | {med[name]:,.1f} | {ratio(name, 'hand'):.2f}x | "
            f"{ratio(name, 'hand + torch.compile'):.2f}x | {first[name]:.1f} |"
        )
    out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny, aot_eager: the machinery only")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--data", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args(argv)
    # A fresh inductor cache: the first call's time is a cold compile, run after run.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="several_bench_")
    if args.smoke:
        args.rounds, args.calls, args.width, args.backend = 2, 4, 16, "aot_eager"
    write(args, measure(args), Path(args.out))
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
