"""float8 training against bf16 on a GPU: tokens/s of the same compiled fasttorch step.

``python -m benchmarks.float8`` trains GPT-2 124M and a larger GPT (about 1.3B
parameters: 24 layers, width 2048) for a few steps each, with the same step in every
variant: ``with_amp(bf16)``, ``grad_accumulate``, ``clip_scaled(1.0)``, AdamW,
``compiled`` (inductor), and for the float8 variants the model converted by
``fasttorch.float8.convert`` (torchao's ``"tensorwise"`` or ``"rowwise"`` recipe, the
output head left in bf16) and the step wrapped in ``with_float8``. It prints one row per
model and variant (tokens/s, ms a step, peak memory, the last loss) and the float8 /
bf16 ratios; ``--json PATH`` also writes them. torchao's published target is 1.25x or
more over bf16 with compile where float8 applies (large matrix products);
``python -m benchmarks.gpu --float8`` runs this and puts the table in docs/benchmarks.md.

It needs CUDA with compute capability 8.9 or more and torchao (``pip install
"fasttorch[ao]"``). ``--dry-run`` runs the same code on a CPU at toy sizes, emulated
(``emulate=True``) and compiled with ``aot_eager``: it checks the machinery, and its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class Size:
    """A GPT's shape and the batch of one optimizer step (``accum`` x ``micro`` sequences)."""

    title: str
    layers: int
    width: int
    heads: int
    context: int = 1024
    vocab: int = 50304
    micro: int = 8
    accum: int = 4


SIZES = {
    "124m": Size("GPT-2 124M (12 layers, width 768)", 12, 768, 12),
    "1.3b": Size("GPT 1.3B (24 layers, width 2048)", 24, 2048, 16, micro=4, accum=8),
}
TOY = Size(
    "toy GPT (2 layers, width 64; dry run)", 2, 64, 4, context=32, vocab=256, micro=2, accum=2
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: known models and recipes, positive counts, and CUDA
    (or ``--dry-run``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.float8", description=__doc__)
    ap.add_argument("--models", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"of {', '.join(RECIPES)}")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--dry-run", action="store_true", help="a toy GPT on the CPU, emulated")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.recipes = [r for r in args.recipes.split(",") if r]
    bad = [m for m in args.models if m not in SIZES]
    if bad or not args.models:
        ap.error(f"--models: unknown {bad or 'empty'}; choose from {', '.join(SIZES)}")
    bad = [r for r in args.recipes if r not in RECIPES]
    if bad:
        ap.error(f"--recipes: unknown {bad}; choose from {', '.join(RECIPES)}")
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device here: float8 speed needs a GPU; --dry-run checks the code")
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            ap.error(f"this GPU has compute capability {cap}; float8 needs 8.9 or more")
    return args


def build(size: Size, variant: str, device: Any, dry_run: bool) -> tuple[Any, Any]:
    """The state and the compiled step of ``variant`` ("bf16" or a float8 recipe)."""
    import torch

    import fasttorch
    from benchmarks.models import GPT, loss_fn

    torch.manual_seed(0)
    model = GPT(size.vocab, size.context, size.layers, size.width, size.heads).to(device)
    step = fasttorch.with_amp(fasttorch.step(loss_fn), "bf16")
    step = fasttorch.clip_scaled(fasttorch.grad_accumulate(step, size.accum), 1.0)
    if variant != "bf16":
        from fasttorch import float8

        # the tied output head (the embedding's weight) stays in bf16, as torchtitan's
        float8.convert(model, variant, filter_fqns=("head",), emulate=dry_run)
        step = float8.with_float8(step)
    step = fasttorch.compiled(step, backend="aot_eager" if dry_run else "inductor")
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(3e-4, weight_decay=0.1))
    return state, step


def measure(size: Size, variant: str, steps: int, warmup: int, dry_run: bool) -> dict[str, Any]:
    """Train ``1 + warmup`` untimed steps, then ``steps`` timed ones."""
    import torch

    device = torch.device("cpu" if dry_run else "cuda")
    state, step = build(size, variant, device, dry_run)
    g = torch.Generator().manual_seed(1)
    rows = size.accum * size.micro
    seq = torch.randint(0, size.vocab, (rows, size.context + 1), generator=g).to(device)
    batch = (seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    for _ in range(1 + warmup):
        state, metrics = step(state, batch)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    return {
        "model": size.title,
        "variant": variant,
        "tokens_per_s": rows * size.context / seconds,
        "step_ms": seconds * 1e3,
        "warmup_s": first,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "loss": float(metrics["loss"]),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every model x variant (bf16 first), each row kept or kept as its error."""
    import torch

    out = []
    sizes = [TOY] if args.dry_run else [SIZES[m] for m in args.models]
    for size in sizes:
        for variant in ("bf16", *args.recipes):
            print(f"== {size.title}: {variant}", flush=True)
            try:
                out.append(measure(size, variant, args.steps, args.warmup, args.dry_run))
            except Exception as e:  # one failure (out of memory) leaves the other rows
                out.append({"model": size.title, "variant": variant, "error": repr(e)[-800:]})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table: one row per model and variant, float8 / bf16 in tokens/s."""
    lines = [
        "| model | variant | tokens/s | ms/step | vs bf16 | peak GiB | loss |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    base = {
        r["model"]: r["tokens_per_s"] for r in rows if r["variant"] == "bf16" and "error" not in r
    }
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | failed: {r['error'][:100]} | | | | |")
            continue
        ratio = r["tokens_per_s"] / base[r["model"]] if r["model"] in base else float("nan")
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} "
            f"| {ratio:.2f}x | {peak} | {r['loss']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows = run(args)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
