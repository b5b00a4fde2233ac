"""Train a small DCGAN on generated images: two models, two optimizers, one step.

The GAN beside ``train_charlm.py``, in the same shape: a user's loop around one
composed step over several models (docs/several_models.md)::

    def member(loss_fn):
        s = fasttorch.model_step(loss_fn)  # loss_fn(apply, batch, models)
        s = fasttorch.with_amp(s, "bf16")  # or "fp16": a loss scale per optimizer
        return fasttorch.grad_accumulate(s, accum, across_calls=True)

    g = fasttorch.ema(member(g_loss), 0.99, warmup_power=0.75)  # timm's ModelEmaV3 warm-up
    step = fasttorch.several({"d": member(d_loss), "g": g})
    step = fasttorch.compiled(step)  # with --compile
    for it in range(steps * accum):  # one microbatch of both models per call
        state, metrics = step(state, next_batch())

Per call the discriminator trains on real images and the generator's images (detached),
then the generator trains through the discriminator, whose parameters take no gradient;
on a window's last microbatch each model steps, the generator's loss reading the
discriminator just updated (the loop of Lightning's manual optimization with
``toggle_model``). The images are generated, never downloaded: soft discs of random
position, radius and brightness on a dark background, with a little noise. Batch ``k``
comes from a generator seeded with ``(seed, k)``.

At the end: ``loss.svg`` (both losses) and ``summary.json`` (losses, the distance
between the mean and spread of real and generated pixels before and after, calls/s) in
``--out``. Run ``python examples/train_gan.py --help``.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_charlm.py
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from example_utils import loss_svg, peak_memory_bytes  # examples/example_utils.py
from torch import Tensor, nn

import fasttorch

# --------------------------------------------------------------------------- data


def disc_images(n: int, size: int, gen: torch.Generator) -> Tensor:
    """``n`` images ``(n, 1, size, size)`` in [-1, 1]: one soft disc each, noisy."""
    coord = torch.linspace(-1, 1, size)
    yy, xx = coord[:, None], coord[None, :]
    cx, cy = (torch.rand(2, n, 1, 1, generator=gen) - 0.5) * 1.0
    r = 0.25 + 0.35 * torch.rand(n, 1, 1, generator=gen)
    brightness = 0.5 + 0.5 * torch.rand(n, 1, 1, generator=gen)
    dist = ((xx - cx) ** 2 + (yy - cy) ** 2).sqrt()
    disc = brightness * torch.sigmoid((r - dist) * 12)
    img = disc * 2 - 1 + 0.05 * torch.randn(n, size, size, generator=gen)
    return img.clamp(-1, 1)[:, None]


def batch_at(k: int, args: argparse.Namespace, device: torch.device) -> tuple[Tensor, Tensor]:
    """Call ``k``'s real images and latent codes: the same on any machine."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + k)
    real = disc_images(args.batch_size, args.image_size, gen)
    z = torch.randn(args.batch_size, args.latent, generator=gen)
    return real.to(device), z.to(device)


# --------------------------------------------------------------------------- models


def generator(latent: int, width: int, size: int) -> nn.Module:
    """DCGAN's generator: a projection to ``size/4`` squared, two upsampling convs, tanh."""
    s = size // 4
    return nn.Sequential(
        nn.Linear(latent, 2 * width * s * s, bias=False),
        nn.Unflatten(1, (2 * width, s, s)),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.ConvTranspose2d(2 * width, width, 4, 2, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.ConvTranspose2d(width, 1, 4, 2, 1),
        nn.Tanh(),
    )


def discriminator(width: int, size: int) -> nn.Module:
    """DCGAN's discriminator: two strided convs with LeakyReLU, a linear logit."""
    return nn.Sequential(
        nn.Conv2d(1, width, 4, 2, 1),
        nn.LeakyReLU(0.2),
        nn.Conv2d(width, 2 * width, 4, 2, 1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.LeakyReLU(0.2),
        nn.Flatten(),
        nn.Linear(2 * width * (size // 4) ** 2, 1),
    )


def bce(logits: Tensor, target: float) -> Tensor:
    logits = logits.float()
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def d_loss(apply: Any, batch: tuple[Tensor, Tensor], models: Any) -> Tensor:
    """The discriminator's loss: real images are 1, the generator's (detached) are 0."""
    real, z = batch
    fake = models["g"](z).detach()
    return bce(apply(real), 1.0) + bce(apply(fake), 0.0)


def g_loss(apply: Any, batch: tuple[Tensor, Tensor], models: Any) -> Tensor:
    """The generator's loss through the discriminator (whose parameters stay as they are)."""
    _, z = batch
    return bce(models["d"](apply(z)), 1.0)


def pixel_gap(state: fasttorch.Models, args: argparse.Namespace, device: torch.device) -> float:
    """How far generated pixels are from real ones: |mean gap| + |std gap| of the images'
    mean image and per-image spread, from the generator's EMA in evaluation mode."""
    real, z = batch_at(-1, args, device)
    g = state["g"]
    assert isinstance(g, fasttorch.TrainState)
    with torch.no_grad(), fasttorch.state.evaluating(g.module):
        params, buffers = g.params, g.buffers
        if "ema" in g.substates:  # the average's parameters with the average's buffers
            ema = g.substates["ema"]
            params, buffers = ema.params, {**g.buffers, **ema.buffers}
        fake = torch.func.functional_call(g.module, (params, buffers), (z,)).float()
    gap = (real.mean(0) - fake.mean(0)).abs().mean() + (real.std(0) - fake.std(0)).abs().mean()
    return float(gap)


# --------------------------------------------------------------------------- job


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=150, help="updates of each model")
    p.add_argument("--accum", type=int, default=2, help="calls (microbatches) per update")
    p.add_argument("--batch-size", type=int, default=32, help="images per call")
    p.add_argument("--image-size", type=int, default=16, help="a multiple of 4")
    p.add_argument("--latent", type=int, default=16)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--ema",
        type=float,
        default=0.99,
        help="decay of the generator's EMA (warmed up as timm's ModelEmaV3 with power 3/4)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile each model's step (inductor); on 2 CPU cores the compile takes longer "
        "than this short run, so eager is the default",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25, help="updates between log lines")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="runs/gan", metavar="DIR", help="loss.svg, summary.json")
    args = p.parse_args(argv)
    if args.image_size % 4:
        p.error(f"--image-size must be a multiple of 4, got {args.image_size}")
    return args


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, fasttorch.Models]:
    torch.manual_seed(args.seed)
    g = generator(args.latent, args.width, args.image_size).to(device)
    d = discriminator(args.width, args.image_size).to(device)
    adam = fasttorch.optim.adam(args.lr, betas=(0.5, 0.999))  # DCGAN's betas
    state = fasttorch.Models.create(
        d=fasttorch.TrainState.create(d, adam), g=fasttorch.TrainState.create(g, adam)
    )

    def member(loss_fn: Any) -> fasttorch.Step:
        s = fasttorch.model_step(loss_fn)
        if args.precision != "fp32":
            s = fasttorch.with_amp(s, args.precision)
        return fasttorch.grad_accumulate(s, args.accum, across_calls=True)

    step = fasttorch.several(
        {"d": member(d_loss), "g": fasttorch.ema(member(g_loss), args.ema, warmup_power=0.75)}
    )
    if args.compile:
        step = fasttorch.compiled(step)
    return step, state


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, print progress, write ``loss.svg`` and ``summary.json``; return the summary."""
    args = parse_args(argv)
    device = torch.device(args.device)
    step, state = build(args, device)
    print(
        f"device {device} | torch {torch.__version__} | {args.precision} | "
        f"{args.steps} updates x {args.accum} calls of {args.batch_size} images\n{step!r}"
    )
    gap0 = pixel_gap(state, args, device)
    curves: dict[str, list[list[float]]] = {"D": [], "G": []}
    first_s = None
    t0 = time.perf_counter()
    calls = args.steps * args.accum
    for k in range(calls):
        state, metrics = step(state, batch_at(k, args, device))
        if first_s is None:
            first_s = time.perf_counter() - t0
            t_warm = time.perf_counter()
        done = (k + 1) // args.accum
        if (k + 1) % args.accum == 0 and (done % args.log_every == 0 or done == args.steps):
            ld, lg = float(metrics["d"]["loss"]), float(metrics["g"]["loss"])  # host reads here
            curves["D"].append([done, ld])
            curves["G"].append([done, lg])
            print(f"step {done:5d}/{args.steps} | d_loss {ld:.4f} | g_loss {lg:.4f}", flush=True)
    wall = time.perf_counter() - t0
    rate = (calls - 1) / (time.perf_counter() - t_warm) if calls > 1 else float("nan")
    gap = pixel_gap(state, args, device)
    summary: dict[str, Any] = {
        "steps": args.steps,
        "precision": args.precision,
        "compiled": args.compile,
        "d_loss": curves["D"][-1][1],
        "g_loss": curves["G"][-1][1],
        "d_loss_first": curves["D"][0][1],
        "pixel_gap_initial": gap0,
        "pixel_gap": gap,
        "wall_s": wall,
        "first_call_s": first_s,
        "calls_per_s": rate,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    print(
        f"done: d_loss {summary['d_loss']:.4f}, g_loss {summary['g_loss']:.4f} | pixel gap "
        f"{gap0:.3f} -> {gap:.3f} | {wall:.1f} s, first call {first_s:.1f} s"
        f"{' (compile time included)' if args.compile else ''}, {rate:.1f} calls/s after"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"DCGAN on generated discs ({args.precision}, accumulate {args.accum})"
    (out / "loss.svg").write_text(loss_svg(curves, args.steps, title, "BCE loss"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / 'loss.svg'} and {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
