"""A learning-rate sweep of the main job's model: 8 learning rates trained in one run.

Trains ``train_charlm.py``'s ``CharGPT`` on the standard library's source with eight
learning rates at once: one population (``fasttorch.create_population``), each member
its own AdamW learning rate, all members updated by one call of a vmapped step
(``fasttorch.vmapped``) on the same batches, with the same initialisation (so the
learning rate is the only difference). Writes ``loss.svg`` (one training-loss curve per
learning rate) and ``summary.json`` (each learning rate's final training and held-out
loss, and the best one) to ``--out``::

    python examples/sweep_charlm.py                 # about a minute on 2 CPU cores
    python examples/sweep_charlm.py --compile       # one compiled graph for all members

The plain loop it replaces trains the eight models one after another (or in eight
processes); see docs/population.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from example_utils import loss_svg  # examples/example_utils.py
from train_charlm import (  # examples/train_charlm.py: the main job's data and model
    Batches,
    ByteVocab,
    CharGPT,
    loss_fn,
    split_tokens,
    stdlib_source,
)

import fasttorch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of every member")
    p.add_argument("--lr-min", type=float, default=3e-4, help="smallest learning rate")
    p.add_argument("--lr-max", type=float, default=3e-2, help="largest learning rate")
    p.add_argument("--members", type=int, default=8, help="learning rates (log-spaced)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=1)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="each member's max gradient norm")
    p.add_argument("--compile", action="store_true", help="compile the population's step")
    p.add_argument("--log-every", type=int, default=5, help="steps between loss points")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches at the end")
    p.add_argument("--max-bytes", type=int, default=300_000, help="stdlib bytes to read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/sweep", metavar="DIR")
    return p.parse_args(argv)


def learning_rates(lo: float, hi: float, n: int) -> list[float]:
    """``n`` learning rates spaced evenly in log from ``lo`` to ``hi``."""
    if n == 1:
        return [lo]
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweep, write ``loss.svg`` and ``summary.json``; return the summary."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    text, _ = stdlib_source(args.max_bytes)
    vocab = ByteVocab(text)
    train_tokens, val_tokens = split_tokens(vocab.encode(text), args.block_size, 0.1)
    lrs = learning_rates(args.lr_min, args.lr_max, args.members)
    n = len(lrs)

    def make_model() -> CharGPT:
        return CharGPT(
            len(vocab), args.block_size, args.n_layer, args.n_embd, args.n_head,
            args.dropout, tie_weights=True,
        )  # fmt: skip

    # The same initial model and the same dropout generator for every member: the
    # learning rate is the only difference.
    torch.manual_seed(args.seed)
    pop = fasttorch.create_population(
        make_model(), fasttorch.optim.adamw(lrs[0]), n, init="copies",
        hyper={"lr": lrs}, rng_seeds=[args.seed] * n,
    )  # fmt: skip
    step = fasttorch.vmapped(fasttorch.clip_scaled(fasttorch.step(loss_fn), args.clip), n)
    evaluate = fasttorch.vmapped_eval(fasttorch.eval_step(loss_fn), n)
    if args.compile:
        step = fasttorch.compiled(step)
    batches = Batches(train_tokens, args.block_size, args.batch_size, args.seed)
    curves: dict[str, list[list[float]]] = {f"lr {lr:.1e}": [] for lr in lrs}
    start = time.perf_counter()
    for i in range(args.steps):
        pop, metrics = step(pop, batches())
        if i % args.log_every == 0 or i == args.steps - 1:
            losses = metrics["loss"].tolist()  # one host read per logged step
            for label, loss in zip(curves, losses):
                curves[label].append([i + 1, loss])
            best = min(losses)
            print(
                f"step {i + 1:4d} | losses {' '.join(f'{x:.3f}' for x in losses)} | best {best:.3f}"
            )
    seconds = time.perf_counter() - start
    held = Batches(val_tokens, args.block_size, args.batch_size, args.seed + 1)
    val = torch.stack([evaluate(pop, held())["loss"] for _ in range(args.eval_batches)])
    val_losses = val.mean(0).tolist()
    finite = [v if math.isfinite(v) else math.inf for v in val_losses]
    best_i = min(range(n), key=finite.__getitem__)
    summary = {
        "torch": torch.__version__,
        "members": n,
        "steps": args.steps,
        "compiled": args.compile,
        "learning_rates": lrs,
        "final_train_loss": [pts[-1][1] for pts in curves.values()],
        "val_loss": val_losses,
        "best_lr": lrs[best_i],
        "seconds": seconds,
        "member_steps_per_s": n * args.steps / seconds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"CharGPT learning-rate sweep: {n} members in one vmapped step"
    (out / "loss.svg").write_text(loss_svg(curves, args.steps, title, "loss (nats per byte)"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"best lr {lrs[best_i]:.1e}: held-out loss {val_losses[best_i]:.4f} | "
        f"{summary['member_steps_per_s']:.1f} member-steps/s | wrote {out / 'loss.svg'}"
    )
    return summary


if __name__ == "__main__":
    main()
