"""Steady-state time per step of the compile-time benchmark's step, its options side by side.

    python -m benchmarks.steady_step               # rewrites docs/benchmarks_steady.md
    python -m benchmarks.steady_step --layers 4 --mlp 12   # also M1's MLP, 12 blocks
    python -m benchmarks.steady_step --smoke       # tiny, aot_eager: checks the machinery
    python -m benchmarks.steady_step --from-json a.json,b.json   # one page, two runs

``benchmarks.compile_time`` times each option's first step, each in a process of its
own, and its steady column is three steps right after the compile: too few, and taken
at different moments of a shared machine, to decide an option's default. Here one
process compiles every option of the same step (the GPT of ``compile_time``, bf16
autocast, 4 microbatches, clip to norm 1, AdamW), each on its own copy of the same
model, warms each up, and then times them in interleaved rounds (A B C D, D C B A,
...): each round one block of steps of every option; per option the median over rounds
of the time per step, and of the whole step's time over the option's in the same round
(``benchmarks.stats.summarize``, as the suite reports speed-ups). ``--mlp`` adds the
residual MLP of ``benchmarks.run``'s M1 (width 64, 16 samples a microbatch: small
kernels, where inductor's Python wrapper, which regions need, costs the most), with
the same step.

* ``step``: ``fasttorch.compiled`` of the whole step (the defaults: AdamW's update
  torch's fused CPU kernel, run outside the graphs, ``opaque``);
* ``inductor_update``: the same with ``adamw(..., opaque=False)``, the update generated
  by inductor for the model's tensors, the default before: the default's time over
  this one's is the verdict (at least 0.97 of its speed);
* ``regional``: with ``compiled(..., regions=True)``;
* ``python_wrapper``: the whole step with inductor's Python wrapper
  (``options={"cpp_wrapper": False}``), which a graph with regions needs on a CPU: the
  whole step's time over this one is what the wrapper alone costs, and this one's over
  ``regional``'s what the regions cost beyond it (a smoke run's aot_eager has no
  wrapper: the whole step again).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.compile_time import ACCUM, _batches, _fasttorch_step, _gpt, page_head
from benchmarks.stats import summarize

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("step", "inductor_update", "regional", "python_wrapper")
# Older rows' kinds too (``opaque=True`` before it was the default, with the update's
# ``_foreach`` operator), shown under their own labels.
LEGACY = ("opaque", "regional_opaque")
LABELS = {
    "step": "`fasttorch.compiled`",
    "inductor_update": "`fasttorch.compiled`, `adamw(..., opaque=False)`",
    "regional": "`fasttorch.compiled(..., regions=True)`",
    "python_wrapper": "`fasttorch.compiled`, inductor's Python wrapper (`cpp_wrapper=False`)",
    "opaque": "`fasttorch.compiled`, `adamw(..., opaque=True)` (older: `_foreach` operator)",
    "regional_opaque": "`fasttorch.compiled(..., regions=True)`, `opaque=True` (older)",
}
PYTHON_WRAPPER = {"cpp_wrapper": False}
STEADY_TARGET = 0.97


def _mlp(blocks: int, smoke: bool) -> tuple[Any, list[Any]]:
    """M1's residual MLP (``benchmarks.models.MLP``, width 64) with ``blocks`` blocks, and
    two steps of data: 4 microbatches of 16 vectors (8 in a smoke run)."""
    import torch

    from benchmarks.models import MLP

    model = MLP(64, 64, blocks, 10)
    g = torch.Generator().manual_seed(1)
    n = ACCUM * (8 if smoke else 16)
    data = [(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))]
    data.append((torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)))
    return model, data


def measure(
    layers: int, rounds: int, block: int, smoke: bool, model_name: str = "gpt"
) -> dict[str, Any]:
    """``{"compile": {kind: s}, "rounds": [{kind: s per step}, ...]}`` for one depth of
    ``model_name`` ("gpt": the compile-time benchmark's GPT; "mlp": M1's MLP)."""
    import torch

    torch.manual_seed(0)
    backend = "aot_eager" if smoke else "inductor"
    if model_name == "mlp":
        model, data = _mlp(layers, smoke)
    else:
        model, data = _gpt(layers, smoke), _batches(smoke, 2)
    runs, first = {}, {}
    for kind in KINDS:
        regional, opaque = kind == "regional", kind != "inductor_update"
        inductor = PYTHON_WRAPPER if kind == "python_wrapper" else None
        run = _fasttorch_step(copy.deepcopy(model), backend, None, regional, opaque, inductor)
        t0 = time.perf_counter()
        run(data[0])
        first[kind] = time.perf_counter() - t0
        for _ in range(2):  # warm-up
            run(data[1])
        runs[kind] = run
        line = {"model": model_name, "layers": layers, "kind": kind, "first": first[kind]}
        print(json.dumps(line), flush=True)
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
    threads = torch.get_num_threads()
    return {
        "model": model_name,
        "layers": layers,
        "threads": threads,
        "compile": first,
        "rounds": out,
    }


def _model(res: dict[str, Any]) -> str:
    """The table's model cell: the GPT's layers or the MLP's blocks."""
    if res.get("model", "gpt") == "mlp":
        return f"MLP (M1), {res['layers']} blocks"
    return f"GPT, {res['layers']} layers"


def table(results: list[dict[str, Any]]) -> str:
    """Per depth and option: median ms per step and the median per-round speed-up over
    the whole step (``benchmarks.stats.summarize``: whole step's time / option's)."""
    lines = [
        "| option | model | ms per step (median over rounds) | speed-up over the whole "
        "step (its time / the option's; median [min-max] of per-round ratios) | first step "
        "(s, compile included) |",
        "|---|---:|---:|---:|---:|",
    ]
    verdicts = []
    for res in results:
        rounds = res["rounds"]
        present = [k for k in KINDS + LEGACY if k in rounds[0]]  # older rows: other options
        times = {k: {i: r[k] for i, r in enumerate(rounds)} for k in present}
        summary = summarize(times, "step", range(len(rounds)))
        for kind in present:
            s = summary[kind]
            lines.append(
                f"| {LABELS[kind]} | {_model(res)} | {s.seconds_per_step * 1e3:.1f} | "
                f"{s.ratio_to_baseline:.2f} [{s.ratio_min:.2f}-{s.ratio_max:.2f}] | "
                f"{res['compile'][kind]:.1f} |"
            )
        if "inductor_update" in present:
            # The default against the update inductor generates (the default before).
            before = summarize(times, "inductor_update", range(len(rounds)))["step"]
            verdict = "met" if before.ratio_to_baseline >= STEADY_TARGET else "not met"
            verdicts.append(
                f"| {_model(res)} | {before.ratio_to_baseline:.2f} "
                f"[{before.ratio_min:.2f}-{before.ratio_max:.2f}] | >= {STEADY_TARGET} "
                f"| {verdict} |"
            )
    if verdicts:
        lines += [
            "",
            "| the default's speed / `opaque=False`'s (its time / the default's; median "
            "[min-max] of per-round ratios) | measured | target | verdict |",
            "|---|---:|---:|---|",
            *verdicts,
        ]
    return "\n".join(lines)


def _options(args: argparse.Namespace) -> str:
    mlp = f" --mlp {args.mlp}" if args.mlp else ""
    return f"--layers {args.layers}{mlp} --rounds {args.rounds} --block {args.block}"


def write(path: Path, results: list[dict[str, Any]], args: argparse.Namespace, wall: float) -> None:
    """The page; rewritten from several runs' rows (``--from-json a,b``), it gives each
    run's command (rows kept without one: this command's options) and threads."""
    import torch

    threads = sorted({str(r.get("threads", torch.get_num_threads())) for r in results})
    machine = (
        f"torch threads: {', '.join(threads)}; shared with other work while it ran (read "
        "the ratios, taken within a round, more than the times)"
    )
    options = list(dict.fromkeys(r.get("options", _options(args)) for r in results))
    blocks = sorted({str(r.get("block", args.block)) for r in results})
    title = "Benchmarks: steady step of the compile-time benchmark's options"
    head = [
        *page_head(title, "steady_step", machine, options, args, wall),
        "",
        "One process compiles each option of the step of docs/benchmarks_compile.md (a GPT "
        "of width 64, 4 heads, context 32, vocab 128; 16 sequences a step as 4 "
        "microbatches under bf16 autocast, clipped to norm 1, AdamW; the MLP rows: "
        "`benchmarks.run`'s M1, residual blocks of width 64, 64 vectors a step as 4 "
        "microbatches, the same step) on its own copy of "
        "the same model, runs two warm-up steps of each, then times them in interleaved "
        "rounds (the order reversed every other round), each round a block of "
        f"{' or '.join(blocks)} steps of every option. The speed-up is the whole step's "
        "time over the option's in the same round (above 1: the option is faster); the "
        "table gives the median over rounds. The first "
        "step column is not a cold compile: the options compile one after the other in "
        "one process, in the table's order, and each later one reuses kernels inductor "
        "built for the earlier ones (docs/benchmarks_compile.md has the cold times). "
        "`fasttorch.compiled` is the default step, whose AdamW update is torch's fused "
        'CPU kernel, run outside the graphs (`opaque=True`, docs/optimizers.md, "Opaque '
        'update"); '
        "`opaque=False` is the same step with the update traced and generated by inductor, "
        "the default before, and the verdict table gives the default's speed over its. "
        "The Python wrapper rows are the whole step with inductor's Python wrapper "
        "(`cpp_wrapper=False`) instead of its C++ one, as a graph with regions needs on a "
        "CPU (inductor's C++ wrapper cannot call a subgraph): the part of the regions' "
        "speed-up that is not the wrapper's is their own.",
        "",
    ]
    for setting, rows in _stale(results).items():
        head.append(
            f"The regions rows ({'; '.join(rows)}) were measured while a graph with regions "
            f"was still compiled with inductor's {setting} on, with which some models' "
            'regions computed wrong gradients (docs/design.md, "Regions computed wrong '
            'gradients with inductor").\n'
        )
    slowed = _without_reuse(results)
    if slowed:
        head.append(
            f"The regions rows ({'; '.join(slowed)}) were measured before the alias pass "
            "(`RegionAliases`), with their regions compiled without inductor's "
            "`allow_buffer_reuse` and `inplace_buffers`, which cost them an allocation per "
            "kernel and every in-place kernel.\n"
        )
    if args.smoke:
        head.append('Smoke run: tiny sizes and `backend="aot_eager"`; the numbers mean nothing.\n')
    path.write_text("\n".join(head) + "\n" + table(results) + "\n")


# What each row records about how its regions were compiled
# (fasttorch._compile.regions.inductor_options): today with the graph pass of this
# name, under which inductor's buffer reuse and in-place buffers keep their defaults;
# before it with both off (``regions_compiled_without``); before that with either on and
# no pass, which computed wrong gradients for some models.
ALIAS_PASS = "RegionAliases"
NO_REUSE = ("allow_buffer_reuse", "inplace_buffers")


def _stale(results: list[dict[str, Any]]) -> dict[str, list[str]]:
    """For each of :data:`NO_REUSE` still on in some rows' regions without the alias
    pass, those rows' models. Rows older than the record say
    ``regions_without_buffer_reuse`` (the first turned off) or nothing (neither)."""
    out: dict[str, list[str]] = {}
    for r in results:
        if r.get("regions_alias_pass") == ALIAS_PASS:
            continue
        off = r.get("regions_compiled_without")
        if off is None:
            off = ["allow_buffer_reuse"] if r.get("regions_without_buffer_reuse") else []
        for name in NO_REUSE:
            if name not in off and _model(r) not in out.get(name, []):
                out.setdefault(name, []).append(_model(r))
    return {f"`{k}`": sorted(v) for k, v in out.items()}


def _without_reuse(results: list[dict[str, Any]]) -> list[str]:
    """The models of rows whose regions were compiled with both of :data:`NO_REUSE` off."""
    return sorted(
        {
            _model(r)
            for r in results
            if r.get("regions_alias_pass") != ALIAS_PASS
            and set(NO_REUSE) <= set(r.get("regions_compiled_without") or ())
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="12", help="GPT depths, comma-separated")
    p.add_argument("--mlp", default="", help="M1 MLP block counts, comma-separated")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--block", type=int, default=5, help="steps per option per round")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json")
    p.add_argument(
        "--from-json", help="rewrite the page from runs' --json results (comma-separated)"
    )
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_steady.md"))
    args = p.parse_args()
    if args.smoke:
        args.layers, args.rounds, args.block = "2", min(args.rounds, 2), min(args.block, 2)
        args.mlp = args.mlp and "2"
    t0 = time.perf_counter()
    if args.from_json:
        files = args.from_json.split(",")
        results = [r for f in files for r in json.loads(Path(f).read_text())]
        args.from_json = max(files, key=lambda f: Path(f).stat().st_mtime)  # the page's date
    else:
        asked = [("gpt", n) for n in args.layers.split(",") if n]
        asked += [("mlp", n) for n in args.mlp.split(",") if n]
        results = []
        for model_name, n in asked:
            res = measure(int(n), args.rounds, args.block, args.smoke, model_name)
            res["regions_alias_pass"] = ALIAS_PASS
            results.append({**res, "options": _options(args), "block": args.block})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    write(Path(args.out), results, args, time.perf_counter() - t0)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
