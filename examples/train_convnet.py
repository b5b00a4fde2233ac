"""Train a small ResNet-style convnet on generated images: BatchNorm, channels_last, amp.

The vision example beside ``train_charlm.py``, in the same shape: a user's loop around
one composed, compiled step::

    step = fasttorch.step(loss_fn)
    step = fasttorch.with_amp(step, "fp16")  # loss scaling; or "bf16"
    step = fasttorch.grad_accumulate(step, accum)
    step = fasttorch.clip_scaled(step, 1.0)
    step = fasttorch.compiled(step)
    for it in range(steps):
        state, metrics = step(state, next_batch())

The images are generated, never downloaded: each is an oriented sine grating (its class
sets the orientation and the stripe frequency) with a random phase, a random colour
tint and Gaussian noise. Batch ``k`` is drawn from a generator seeded with
``(seed, k)``, so the data position is one integer and a run is the same on any machine.
The model keeps its weights and activations in ``torch.channels_last`` (NHWC), the
layout fast convolution kernels want; BatchNorm's running statistics are buffers in the
state, updated inside the step. Metrics are read back only every ``--log-every`` steps.

At the end: ``loss.svg`` (train loss and held-out loss) and ``summary.json`` (images/s,
losses, held-out accuracy) in ``--out``. Run ``python examples/train_convnet.py --help``.
"""

from __future__ import annotations

import os
import warnings

# See train_charlm.py: sleeping OpenMP waiters keep a compiled step fast on a shared CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch (2.10 at least) warns "Failed to initialize NumPy" while `import torch` runs
# where numpy is not installed (torch/_subclasses/functional_tensor.py converts a tensor
# as it loads), as the first line of this job's output. Nothing here uses numpy. Read
# before `import torch`.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from example_utils import Bar, loss_svg, peak_memory_bytes  # examples/example_utils.py
from torch import Tensor, nn

import fasttorch
from fasttorch import schedules
from fasttorch.evaluation import evaluate
from fasttorch.loop import TensorBoardWriter, every

Batch = tuple[Tensor, Tensor]

# --------------------------------------------------------------------------- data


def grating_images(
    n: int, size: int, classes: int, gen: torch.Generator, noise: float = 1.0
) -> Batch:
    """``n`` images ``(n, 3, size, size)`` in channels_last and their labels ``(n,)``.

    Class ``c`` is a sine grating at angle ``pi * (c // 2) / ceil(classes / 2)`` with
    2 or 4 stripes per image (``c % 2``); phase, colour tint and noise are random.
    """
    y = torch.randint(classes, (n,), generator=gen)
    angle = math.pi * (y // 2).float() / math.ceil(classes / 2)
    freq = 2.0 * math.pi * (2.0 + 2.0 * (y % 2).float()) / size
    phase = 2 * math.pi * torch.rand(n, generator=gen)
    tint = 0.5 + torch.rand(n, 3, generator=gen)
    coord = torch.arange(size, dtype=torch.float32)
    yy, xx = coord[:, None], coord[None, :]
    along = torch.cos(angle)[:, None, None] * xx + torch.sin(angle)[:, None, None] * yy
    wave = torch.sin(freq[:, None, None] * along + phase[:, None, None])
    speckle = torch.randn(n, 3, size, size, generator=gen)
    x = tint[:, :, None, None] * wave[:, None] + noise * speckle
    return x.contiguous(memory_format=torch.channels_last), y


class Images:
    """Batch ``k`` of the stream: ``grating_images`` from a generator seeded by ``(seed, k)``.

    ``position`` (an int) is all a checkpoint needs to resume the stream exactly.
    """

    def __init__(
        self, batch_size: int, size: int, classes: int, seed: int, device: torch.device
    ) -> None:
        self.batch_size, self.size, self.classes = batch_size, size, classes
        self.seed, self.device = seed, device
        self.position = 0

    def __call__(self) -> Batch:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        x, y = grating_images(self.batch_size, self.size, self.classes, gen)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


# --------------------------------------------------------------------------- model


class BasicBlock(nn.Module):
    """Two 3x3 conv + BatchNorm layers and a shortcut (1x1 conv + BN when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem, three stages (width, 2x, 4x; stride 1, 2, 2) of
    ``blocks`` BasicBlocks each, global average pooling, a linear classifier."""

    def __init__(self, classes: int, width: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c_in = width
        for i, c_out in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                layers.append(BasicBlock(c_in, c_out, 2 if i > 0 and j == 0 else 1))
                c_in = c_out
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stages(self.stem(x))
        out: Tensor = self.fc(h.mean(dim=(2, 3)))
        return out


# --------------------------------------------------------------------------- training

StepFn = Callable[[fasttorch.TrainState, Batch], tuple[fasttorch.TrainState, dict[str, Any]]]
EvalFn = Callable[[fasttorch.TrainState, Batch], dict[str, Tensor]]


def loss_fn(apply: Callable[..., Tensor], batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy in float32 whatever the autocast dtype, and the batch's accuracy."""
    x, y = batch
    logits = apply(x).float()
    accuracy = (logits.argmax(-1) == y).float().mean()
    return F.cross_entropy(logits, y), {"accuracy": accuracy}


def build_step(
    precision: str, accum: int, clip: float, compile: bool
) -> tuple[fasttorch.Step, StepFn]:
    """The composed step (amp, accumulation, clipping) and the one to call (compiled)."""
    step = fasttorch.step(loss_fn)
    if precision != "fp32":
        step = fasttorch.with_amp(step, cast(Literal["bf16", "fp16", "auto"], precision))
    step = fasttorch.grad_accumulate(step, accum)
    step = fasttorch.clip_scaled(step, clip)
    return step, (fasttorch.compiled(step) if compile else step)


def held_out(fn: EvalFn, state: fasttorch.TrainState, batches: list[Batch]) -> dict[str, float]:
    """Mean loss and accuracy over the fixed held-out batches (BatchNorm in eval mode)."""
    return {k: float(v) for k, v in evaluate(fn, state, batches).items()}


# --------------------------------------------------------------------------- flags


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small ResNet on generated images with fasttorch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="images per optimizer step")
    p.add_argument("--accum", type=int, default=2, help="microbatches per step")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--width", type=int, default=16, help="channels of the first stage")
    p.add_argument("--blocks", type=int, default=1, help="BasicBlocks per stage")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp16", "auto", "fp32"),
        default="bf16",
        help="autocast dtype (fasttorch.with_amp; fp16 scales the loss); fp32 skips it",
    )
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (SGD)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 10)")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--eval-every", type=int, default=50, metavar="K", help="held-out loss every K steps"
    )
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per eval")
    p.add_argument(
        "--tensorboard", default=None, metavar="DIR", help="also write TensorBoard event files"
    )
    p.add_argument(
        "--out", default="runs/convnet", metavar="DIR", help="loss.svg and summary.json go here"
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's choice)"
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "accum", "image_size", "width", "blocks", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.classes < 2:
        p.error("--classes must be >= 2")
    if args.image_size < 8:
        p.error("--image-size must be >= 8 (two stride-2 stages)")
    if args.batch_size % args.accum:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --accum {args.accum}")
    if args.eval_every < 0 or args.eval_batches < 1:
        p.error("--eval-every must be >= 0 and --eval-batches >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    return args


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, print progress, write ``loss.svg`` and ``summary.json``; return the summary."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train = Images(args.batch_size, args.image_size, args.classes, args.seed, device)
    val = Images(args.batch_size, args.image_size, args.classes, args.seed + 1, device)
    val_set = [val() for _ in range(args.eval_batches)]  # fixed: every eval scores the same

    model = ResNet(args.classes, args.width, args.blocks).to(device)
    model = model.to(memory_format=torch.channels_last)  # NHWC weights, like the images
    n_params = sum(p.numel() for p in model.parameters())
    warmup = min(args.warmup, args.steps)
    schedule = schedules.warmup(
        warmup, schedules.cosine(args.lr, max(1, args.steps - warmup)), init=args.lr / warmup
    )
    optimizer = fasttorch.optim.sgd(
        schedule, momentum=args.momentum, nesterov=True, weight_decay=args.weight_decay
    )
    state = fasttorch.TrainState.create(model, optimizer, seed=args.seed)
    compile = not args.no_compile
    base, step = build_step(args.precision, args.accum, args.clip, compile)
    state = base.init(state)
    ev = fasttorch.eval_step(base)
    evaluate_fn = cast(EvalFn, fasttorch.compiled(ev)) if compile else ev

    print(f"device {device} | torch {torch.__version__} | threads {torch.get_num_threads()}")
    print(
        f"data: generated {args.image_size}x{args.image_size} gratings, {args.classes} "
        f"classes | model: ResNet {args.blocks}x3 blocks, width {args.width}, "
        f"{n_params / 1e6:.3f}M params, channels_last"
    )
    print(
        f"step: {' -> '.join(base.transforms)}{' -> compiled' if compile else ''} | "
        f"precision {args.precision}, batch {args.batch_size} = {args.accum} x "
        f"{args.batch_size // args.accum}, clip {args.clip} | {args.steps} steps, "
        f"SGD lr {args.lr:g} (warm-up {warmup}, cosine)"
    )
    history: dict[str, list[list[float]]] = {"train": [], "held-out": []}
    first_eval = held_out(evaluate_fn, state, val_set)
    history["held-out"].append([0, first_eval["loss"]])
    print(
        f"held-out loss before training {first_eval['loss']:.4f} "
        f"(uniform: {math.log(args.classes):.4f}), accuracy {first_eval['accuracy']:.3f}"
    )
    tb = TensorBoardWriter(args.tensorboard) if args.tensorboard is not None else None
    if tb is not None:
        tb(0, {"eval": first_eval})

    bar = Bar(args.steps, precision=args.precision, start=0, compiles=compile)
    log_due, eval_due = every(args.log_every), every(args.eval_every or args.steps + 1)
    t_train = time.perf_counter()
    compile_s = eval_s = 0.0
    loss = initial_loss = math.nan
    last_eval = first_eval
    window_loss = torch.zeros((), device=device)  # summed on the device: no sync per step
    skipped = torch.zeros((), dtype=torch.int64, device=device)
    last_log = 0
    for it in range(args.steps):
        state, metrics = step(state, train())
        window_loss += metrics["loss"].detach().float()
        if "skipped" in metrics:
            skipped += metrics["skipped"]
        done, first, last = it + 1, it == 0, it + 1 == args.steps
        if first or last or log_due(it):
            loss = float(metrics["loss"])  # the loop's host sync, on log steps only
            mean_loss = float(window_loss) / (done - last_log)
            if first:
                compile_s = time.perf_counter() - t_train
                initial_loss = loss
            history["train"].append([done, mean_loss])
            bar.show(done, {**metrics, "mean": mean_loss}, compile_s if first else None)
            if tb is not None:
                tb(done, {"train": {**metrics, "loss_avg": mean_loss}})
            window_loss.zero_()
            last_log = done
        if last or eval_due(it):
            t0 = time.perf_counter()
            last_eval = held_out(evaluate_fn, state, val_set)
            history["held-out"].append([done, last_eval["loss"]])
            dt = time.perf_counter() - t0
            eval_s += dt
            bar.exclude(dt)
            bar.close()
            if tb is not None:
                tb(done, {"eval": last_eval})
            print(
                f"eval  {done:5d} | held-out loss {last_eval['loss']:.4f} | "
                f"accuracy {last_eval['accuracy']:.3f}"
            )
    t_end = time.perf_counter()
    bar.close()
    if tb is not None:
        tb.close()

    steady_steps = args.steps - 1
    steady_s = t_end - t_train - compile_s - eval_s
    steps_per_s = steady_steps / steady_s if steady_steps > 0 else math.nan
    peak = peak_memory_bytes(device)
    wall_s = time.perf_counter() - t_start
    summary: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "params": n_params,
        "precision": args.precision,
        "image_size": args.image_size,
        "classes": args.classes,
        "steps": args.steps,
        "initial_loss": initial_loss,
        "final_loss": loss,
        "val_loss_initial": first_eval["loss"],
        "val_loss": last_eval["loss"],
        "val_accuracy_initial": first_eval["accuracy"],
        "val_accuracy": last_eval["accuracy"],
        "skipped_steps": int(skipped),
        "compile_s": compile_s,
        "eval_s": eval_s,
        "steps_per_s": steps_per_s,
        "images_per_s": steps_per_s * args.batch_size,
        "wall_s": wall_s,
        "peak_memory_bytes": peak,
    }
    print(
        f"train loss {initial_loss:.4f} -> {loss:.4f} | held-out loss "
        f"{summary['val_loss_initial']:.4f} -> {summary['val_loss']:.4f}, accuracy "
        f"{summary['val_accuracy_initial']:.3f} -> {summary['val_accuracy']:.3f} | "
        f"skipped steps {summary['skipped_steps']}"
    )
    print(
        f"wall {wall_s:.1f} s | first step {compile_s:.1f} s"
        f"{' (compile time included)' if compile else ''} | {steps_per_s:.2f} steps/s, "
        f"{summary['images_per_s']:,.0f} images/s after it | peak mem {peak / 2**30:.2f} GiB"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {"train (mean per log window)": history["train"], "held-out": history["held-out"]}
    title = f"ResNet on generated gratings, {n_params / 1e6:.2f}M params, {args.precision}"
    (out / "loss.svg").write_text(loss_svg(curves, args.steps, title, "cross-entropy loss"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / 'loss.svg'} and {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
