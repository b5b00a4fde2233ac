"""Steady-state time per step of the compile-time benchmark's step, its options side by side.

    python -m benchmarks.steady_step               # rewrites docs/benchmarks_steady.md
    python -m benchmarks.steady_step --smoke       # tiny, aot_eager: checks the machinery

``benchmarks.compile_time`` times each option's first step, each in a process of its
own, and its steady column is three steps right after the compile: too few, and taken
at different moments of a shared machine, to decide an option's default. Here one
process compiles every option of the same step (the GPT of ``compile_time``, bf16
autocast, 4 microbatches, clip to norm 1, AdamW), each on its own copy of the same
model, warms each up, and then times them in interleaved rounds (A B C D, D C B A,
...): each round one block of steps of every option; per option the median over rounds
of the time per step, and of the whole step's time over the option's in the same round
(``benchmarks.stats.summarize``, as the suite reports speed-ups).

* ``step``: ``fasttorch.compiled`` of the whole step (the defaults);
* ``opaque``: the same with ``adamw(..., opaque=True)``;
* ``regional``: with ``compiled(..., regions=True)``;
* ``regional_opaque``: both.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.compile_time import _batches, _fasttorch_step, _gpt, page_head
from benchmarks.stats import summarize

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("step", "opaque", "regional", "regional_opaque")
LABELS = {
    "step": "`fasttorch.compiled`",
    "opaque": "`fasttorch.compiled`, `adamw(..., opaque=True)`",
    "regional": "`fasttorch.compiled(..., regions=True)`",
    "regional_opaque": "`fasttorch.compiled(..., regions=True)`, `opaque=True`",
}


def measure(layers: int, rounds: int, block: int, smoke: bool) -> dict[str, Any]:
    """``{"compile": {kind: s}, "rounds": [{kind: s per step}, ...]}`` for one depth."""
    import torch

    torch.manual_seed(0)
    backend = "aot_eager" if smoke else "inductor"
    model = _gpt(layers, smoke)
    runs, first = {}, {}
    data = _batches(smoke, 2)
    for kind in KINDS:
        regional, opaque = kind in ("regional", "regional_opaque"), kind.endswith("opaque")
        run = _fasttorch_step(copy.deepcopy(model), backend, None, regional, opaque)
        t0 = time.perf_counter()
        run(data[0])
        first[kind] = time.perf_counter() - t0
        for _ in range(2):  # warm-up
            run(data[1])
        runs[kind] = run
        print(json.dumps({"layers": layers, "kind": kind, "first": first[kind]}), flush=True)
    out = []
    for r in range(rounds):
        order = KINDS if r % 2 == 0 else tuple(reversed(KINDS))
        times = {}
        for kind in order:
            t0 = time.perf_counter()
            for i in range(block):
                runs[kind](data[i % 2])
            times[kind] = (time.perf_counter() - t0) / block
        out.append(times)
    return {"layers": layers, "threads": torch.get_num_threads(), "compile": first, "rounds": out}


def table(results: list[dict[str, Any]]) -> str:
    """Per depth and option: median ms per step and the median per-round speed-up over
    the whole step (``benchmarks.stats.summarize``: whole step's time / option's)."""
    lines = [
        "| option | layers | ms per step (median over rounds) | speed-up over the whole "
        "step (its time / the option's; median [min-max] of per-round ratios) | first step "
        "(s, compile included) |",
        "|---|---:|---:|---:|---:|",
    ]
    for res in results:
        rounds = res["rounds"]
        times = {k: {i: r[k] for i, r in enumerate(rounds)} for k in KINDS}
        summary = summarize(times, "step", range(len(rounds)))
        for kind in KINDS:
            s = summary[kind]
            lines.append(
                f"| {LABELS[kind]} | {res['layers']} | {s.seconds_per_step * 1e3:.1f} | "
                f"{s.ratio_to_baseline:.2f} [{s.ratio_min:.2f}-{s.ratio_max:.2f}] | "
                f"{res['compile'][kind]:.1f} |"
            )
    return "\n".join(lines)


def write(path: Path, results: list[dict[str, Any]], args: argparse.Namespace, wall: float) -> None:
    import torch

    threads = results[0].get("threads", torch.get_num_threads())
    machine = (
        f"torch threads: {threads}; shared with other work while it ran (read the ratios, "
        "taken within a round, more than the times)"
    )
    options = f"--layers {args.layers} --rounds {args.rounds} --block {args.block}"
    title = "Benchmarks: steady step of the compile-time benchmark's options"
    head = [
        *page_head(title, "steady_step", machine, options, args, wall),
        "",
        "One process compiles each option of the step of docs/benchmarks_compile.md (a GPT "
        "of width 64, 4 heads, context 32, vocab 128; 16 sequences a step as 4 "
        "microbatches under bf16 autocast, clipped to norm 1, AdamW) on its own copy of "
        "the same model, runs two warm-up steps of each, then times them in interleaved "
        "rounds (the order reversed every other round), each round a block of "
        f"{args.block} steps of every option. The speed-up is the whole step's time over "
        "the option's in the same round (above 1: the option is faster); the table gives "
        "the median over rounds. The first "
        "step column is not a cold compile: the options compile one after the other in "
        "one process, in the table's order, and each later one reuses kernels inductor "
        "built for the earlier ones (docs/benchmarks_compile.md has the cold times).",
        "",
    ]
    if args.smoke:
        head.append('Smoke run: tiny sizes and `backend="aot_eager"`; the numbers mean nothing.\n')
    path.write_text("\n".join(head) + "\n" + table(results) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="12", help="depths, comma-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--block", type=int, default=5, help="steps per option per round")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json")
    p.add_argument("--from-json", help="rewrite the page from a run's --json results")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_steady.md"))
    args = p.parse_args()
    if args.smoke:
        args.layers, args.rounds, args.block = "2", min(args.rounds, 2), min(args.block, 2)
    t0 = time.perf_counter()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        depths = args.layers.split(",")
        results = [measure(int(n), args.rounds, args.block, args.smoke) for n in depths]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    write(Path(args.out), results, args, time.perf_counter() - t0)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
