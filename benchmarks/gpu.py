"""One command for a GPU machine: the GPU tests, the suite's GPU rows, the top kernels.

``python -m benchmarks.gpu`` runs the next part of four (each fits a 10-minute lend of
a GPU machine), saves what it measured in ``.gpu-cache/results.json`` and rewrites the
GPU section of docs/benchmarks.md from everything saved so far; run it again to go on
(``--part N`` runs part N again). Compiled variants compile into
``.gpu-cache/inductor/`` (``TORCHINDUCTOR_CACHE_DIR`` per variant, kept), so carrying
``.gpu-cache`` from one run to the next makes their compiles warm. Nothing else is
needed: torch (2.10 or later) and the project on ``PYTHONPATH``; Lightning and
Accelerate rows (B4, B5) run only where those are installed.

1. ``tests/test_gpu.py``; GPT-2 124M (M3) bf16: B0-B3, F0-F2, then B4, B5.
2. M3 fp16 (GradScaler in the hand loops): the same; the top kernels of F1 and B1.
3. M1 and M2 bf16: B0 and F2; M4 (ResNet-50) fp32 and bf16: B0 and F1.
4. Compile time (``benchmarks.compile_time``'s processes on CUDA, GPT-2 124M's sizes,
   cold caches): ``torch.compile(model)``, the whole step and the step with
   ``regions=True`` at 12 layers, a warm start, then the same three at 24 layers.

``--float8`` runs, instead of a part, ``benchmarks.float8``: GPT-2 124M and a 1.3B GPT,
the compiled bf16 step against the same step with torchao's float8 recipes (tokens/s),
one model at a time, each saved when done (run it again to go on); the table goes in
the same section.

``--dry-run`` runs every piece on a CPU at toy sizes (M1, eager variants; fp16 and
CUDA-graph rows noted as not run; the compile part at 1 layer with ``aot_eager``, once),
into ``.gpu-cache/dry-run*`` unless told otherwise: it checks the machinery, and its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import run
from benchmarks.sections import put_section

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".gpu-cache"
DOC = ROOT / "docs" / "benchmarks.md"
PEERS = {"B4": "lightning", "B5": "accelerate"}
COMPILED = frozenset({"B1", "B2", "B3", "B4", "B5", "F1", "F2"})


@dataclass(frozen=True)
class Stage:
    """One piece of work: ``kind`` "tests", "suite" (benchmarks.run's rows), "kernels" or
    "compile" (benchmarks.compile_time's runs, ``variants`` its kinds, at ``layers``)."""

    key: str
    part: int
    kind: str
    model: str = ""
    precision: str = ""
    variants: tuple[str, ...] = ()
    layers: int = 0


STAGES = (
    Stage("tests", 1, "tests"),
    Stage("M3 bf16", 1, "suite", "M3", "bf16", ("B0", "B1", "B2", "B3", "F0", "F1", "F2")),
    Stage("M3 bf16 peers", 1, "suite", "M3", "bf16", ("B0", "B4", "B5")),
    Stage("M3 fp16", 2, "suite", "M3", "fp16", ("B0", "B1", "B2", "B3", "F0", "F1", "F2")),
    Stage("M3 fp16 peers", 2, "suite", "M3", "fp16", ("B0", "B4", "B5")),
    Stage("M3 bf16 kernels", 2, "kernels", "M3", "bf16", ("F1", "B1")),
    Stage("M1 bf16", 3, "suite", "M1", "bf16", ("B0", "F2")),
    Stage("M2 bf16", 3, "suite", "M2", "bf16", ("B0", "F2")),
    Stage("M4 fp32", 3, "suite", "M4", "fp32", ("B0", "F1")),
    Stage("M4 bf16", 3, "suite", "M4", "bf16", ("B0", "F1")),
    Stage("compile 12", 4, "compile", variants=("model", "step", "regional", "warm"), layers=12),
    Stage("compile 24", 4, "compile", variants=("model", "step", "regional"), layers=24),
)


def plan(stage: Stage, dry_run: bool) -> tuple[Stage, list[str]]:
    """The stage as it runs here, and a note per row it leaves out (and why)."""
    notes = []
    variants = list(stage.variants)
    for v, module in PEERS.items():
        if v in variants and importlib.util.find_spec(module) is None:
            variants.remove(v)
            notes.append(f"{v}: not run: {module} is not installed")
    if stage.kind == "compile":
        from fasttorch._compile import regions as _regions

        kinds = stage.variants
        why = _regions.unavailable()
        if why is not None and "regional" in kinds:
            kinds = tuple(k for k in kinds if k != "regional")
            notes.append(f"regional: not run: {why}")
        if not dry_run:
            return dataclasses.replace(stage, variants=kinds), notes
        # aot_eager keeps no compiled code to start warm from; two layers of the toy GPT
        # (a region needs two blocks)
        if "warm" in kinds:
            notes.append("warm: dry run, not run (aot_eager keeps no compiled code)")
        kinds = tuple(k for k in kinds if k != "warm")
        return dataclasses.replace(stage, variants=kinds, layers=2), notes
    if not dry_run:
        return Stage(
            stage.key, stage.part, stage.kind, stage.model, stage.precision, tuple(variants)
        ), notes
    if stage.precision == "fp16":
        return Stage(stage.key, stage.part, "skip"), ["fp16: not run: no GPU (dry run)"]
    # Compiled rows compile for minutes on a CPU: their eager counterparts stand in.
    eager = {v: "F0" if v.startswith("F") else "B0" for v in variants}
    kept = list(dict.fromkeys(eager.values()))
    if kept == ["B0"]:
        return Stage(stage.key, stage.part, "skip"), [f"{', '.join(variants)}: dry run"]
    notes.append(f"{', '.join(variants)}: dry run, as {', '.join(kept)} on M1")
    return Stage(stage.key, stage.part, stage.kind, "M1", stage.precision, tuple(kept)), notes


def suite_args(dry_run: bool, device: str) -> argparse.Namespace:
    """benchmarks.run's settings for a short lend: one round, three blocks of 20 steps."""
    if dry_run:
        return run.parse(["--smoke", "--device", device])
    return run.parse(
        [
            *("--rounds", "1", "--blocks", "3", "--steps", "20", "--warmup", "5"),
            *("--loss-at", "10", "--device", device, "--timeout", "540"),
        ]
    )


def run_tests(dry_run: bool) -> dict[str, Any]:
    """``pytest tests/test_gpu.py``: exit status and pytest's summary line (a dry run
    only collects them: on a CPU they skip or test CPU fallbacks, minutes of it)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    if dry_run:
        cmd.append("--collect-only")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    print(proc.stdout[-3000:], flush=True)
    return {
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else proc.stderr[-500:],
        "seconds": time.perf_counter() - t0,
    }


def top_kernels(model: str, variant: str, precision: str, device: str, n: int = 10) -> Any:
    """The ``n`` costliest kernels (GPU) or operators (CPU) of 3 profiled steps, per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import variants
    from benchmarks.models import windows

    dev = torch.device(device)
    v = variants.make(variant, model, precision, dev)
    data = windows(model, dev, n=4)
    for batch in data[:3]:  # the first compiles
        v.step(batch)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for batch in data[:3]:
            v.step(batch)
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) if cuda else e.self_cpu_time_total
        if us:
            rows.append({"name": e.key, "us_per_step": us / 3, "calls_per_step": e.count / 3})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:n]


def run_kernels(stage: Stage, device: str, cache: Path) -> dict[str, Any]:
    """Each variant's top kernels, each in a fresh process (one compile, one profile)."""
    out = {}
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor" / "kernels")}
    for v in stage.variants:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            *("--top-kernels", v, "--model", stage.model),
            *("--precision", stage.precision, "--device", device),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
        out[v] = json.loads(lines[-1]) if proc.returncode == 0 and lines else proc.stderr[-800:]
    return out


def run_compile(stage: Stage, dry_run: bool, device: str, cache: Path) -> dict[str, Any]:
    """``benchmarks.compile_time``'s processes, one per kind, each with fresh inductor
    caches (``warm``: the whole step again from the ``step`` run's ``cache_dir``). A run
    that fails or passes 540 s is kept as its error; the others go on."""
    from benchmarks import compile_time

    rows = []
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="compile-", dir=cache) as tmp:
        kept = os.path.join(tmp, "step-cache")  # the step's cache_dir, for the warm run
        for i, kind in enumerate(stage.variants):
            own = os.path.join(tmp, f"inductor-{i}")
            child, keep = ("step", kept) if kind in ("step", "warm") else (kind, None)
            row: dict[str, Any] = {"kind": kind, "layers": stage.layers}
            print(f"   {kind}, {stage.layers} layers", flush=True)
            try:
                row |= compile_time.spawn(
                    child, stage.layers, dry_run, keep, own, device, timeout=540
                )
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                row["error"] = str(e)[-1500:]
            rows.append(row)
    return {"compile": rows}


def run_stage(stage: Stage, dry_run: bool, device: str, cache: Path) -> dict[str, Any]:
    if stage.kind == "tests":
        return run_tests(dry_run)
    if stage.kind == "kernels":
        return run_kernels(stage, device, cache)
    if stage.kind == "compile":
        return run_compile(stage, dry_run, device, cache)
    args = suite_args(dry_run, device)
    block = run.run_model(
        args, stage.model, list(stage.variants), stage.precision, device, cache / "inductor"
    )
    block["variants"], block["loss_at"], block["skipped"] = list(stage.variants), args.loss_at, []
    return block


def _section(saved: dict[str, Any], dry_run: bool) -> str:
    """The GPU section's Markdown, from every stage saved so far."""
    head = "## On a GPU" + (" (DRY RUN on a CPU: the numbers mean nothing)" if dry_run else "")
    lines = [
        head,
        "",
        "Written by `python -m benchmarks.gpu` (benchmarks/README.md), in parts; never by",
        "hand. One round of 3 blocks x 20 steps per row (a GPU machine is lent for short",
        "runs): ratios are indicative, compile times warm after the first part that",
        "compiled the same variant.",
        "",
        f"- device: {saved.get('device_name')}; torch {saved.get('torch')}",
        f"- parts run: {', '.join(saved.get('dates', []))}",
        "",
    ]
    stages = saved.get("stages", {})
    tests = stages.get("tests")
    if isinstance(tests, dict):
        lines += [f"GPU tests (`tests/test_gpu.py`): {tests['summary']}", ""]
    blocks = [s for s in stages.values() if isinstance(s, dict) and "runs" in s]
    if blocks:
        args = suite_args(dry_run, saved.get("device", "cuda"))
        for b in blocks:
            b["analysis"] = run.analyse(b, tol=args.drift)
        text = run.render(args, blocks, saved.get("device", "cuda"), 0.0, [])
        for ln in text.splitlines():
            if ln.startswith("#"):
                ln = "##" + ln  # below this section's heading
            lines.append(ln)
    for key, stage in stages.items():
        if key.endswith("kernels") and isinstance(stage, dict):
            for v, rows in stage.items():
                lines += ["", f"### Top kernels of {v} ({key}), per step", ""]
                if isinstance(rows, str):
                    lines.append(f"failed: {rows.splitlines()[-1] if rows else '?'}")
                    continue
                lines += ["| kernel | us/step | calls/step |", "|---|---:|---:|"]
                for r in rows:
                    name = r["name"].replace("|", "/")[:90]
                    lines.append(f"| `{name}` | {r['us_per_step']:.1f} | {r['calls_per_step']:g} |")
    compiled = [r for s in stages.values() if isinstance(s, dict) for r in s.get("compile", [])]
    if compiled:
        lines += ["", *_compile_section(compiled)]
    f8 = saved.get("float8")
    if isinstance(f8, dict):
        from benchmarks import float8

        lines += ["", f"### float8 training against bf16 ({f8['date']})", ""]
        lines += [
            "Written by `python -m benchmarks.gpu --float8` (`benchmarks.float8`): the same "
            "compiled step (bf16 autocast, grad_accumulate, clip_scaled, AdamW) with the model "
            "as it is and converted by `fasttorch.float8.convert` (output head in bf16). "
            "torchao's target: 1.25x or more over bf16 where float8 applies.",
            "",
        ]
        lines.append(float8.table(f8["rows"]))
    notes = saved.get("notes", [])
    if notes:
        lines += ["", "Not run:", "", *(f"- {n}" for n in notes)]
    return "\n".join(lines)


_KINDS = {
    "model": "`torch.compile(model)`",
    "step": "`fasttorch.compiled`",
    "regional": "`fasttorch.compiled(..., regions=True)`",
    "warm": "`fasttorch.compiled`, warm start",
}


def _compile_section(rows: list[dict[str, Any]]) -> list[str]:
    """Part 4's table: each run's first step and its parts, then the ratios the compile
    targets are stated in (cold compile <= 1.5x ``torch.compile(model)``'s for GPT-2
    124M on a GPU; 24 / 12 layers <= 1.2)."""
    lines = [
        "### Compile time (GPT-2 124M's sizes, one cold process each)",
        "",
        "Written by this command's part 4 with `benchmarks.compile_time`'s processes "
        "(bf16 autocast, 4 microbatches of 8 sequences, clip to norm 1, AdamW; a fresh "
        "`TORCHINDUCTOR_CACHE_DIR` each; warm: the whole step again from the first run's "
        "`cache_dir`). Steady step: the median of 3 steps after the first, indicative only.",
        "",
        "| run | layers | first step (s) | dynamo (s) | backend (s) | steady step (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    got: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        label = _KINDS.get(r["kind"], r["kind"])
        if "error" in r:
            last = r["error"].strip().splitlines()[-1:] or ["?"]
            lines.append(f"| {label} | {r['layers']} | failed: {last[0][:120]} | | | |")
            continue
        got[(r["kind"], r["layers"])] = r
        lines.append(
            f"| {label} | {r['layers']} | {r['first']:.1f} | {r.get('dynamo', 0):.1f} | "
            f"{r.get('backend', 0):.1f} | {r['step'] * 1e3:.1f} |"
        )

    def ratio(a: tuple[str, int], b: tuple[str, int], key: str = "first") -> str:
        if a not in got or b not in got:
            return "not measured"
        return f"{got[a][key] / got[b][key]:.2f}"

    layers = sorted({n for _, n in got})
    lo, hi = (layers[0], layers[-1]) if layers else (0, 0)
    lines += ["", "| ratio | measured | target |", "|---|---:|---:|"]
    for n in layers:
        lines.append(
            f"| cold compile, whole step / `torch.compile(model)`, {n} layers "
            f"| {ratio(('step', n), ('model', n))} | {'<= 1.5' if n == lo else ''} |"
        )
        lines.append(
            f"| cold compile, regions / whole step, {n} layers "
            f"| {ratio(('regional', n), ('step', n))} | |"
        )
        lines.append(
            f"| steady step, regions / whole step, {n} layers "
            f"| {ratio(('regional', n), ('step', n), 'step')} | |"
        )
    if hi != lo:
        for kind in ("model", "step", "regional"):
            lines.append(
                f"| cold compile, {_KINDS[kind]}, {hi} / {lo} layers "
                f"| {ratio((kind, hi), (kind, lo))} | {'<= 1.2' if kind != 'model' else ''} |"
            )
    warm = got.get(("warm", lo))
    lines.append(
        f"| warm start (s), {lo} layers | {warm['first']:.1f} | <= 5 |"
        if warm
        else f"| warm start (s), {lo} layers | not measured | <= 5 |"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    ap.add_argument("--part", type=int, choices=[1, 2, 3, 4], help="default: the next one not done")
    ap.add_argument("--dry-run", action="store_true", help="every piece on a CPU, toy sizes")
    ap.add_argument("--results", type=Path, default=None, help="the results file to resume")
    ap.add_argument("--out", type=Path, default=None, help="the document to write the section to")
    ap.add_argument(
        "--cache-dir", type=Path, default=CACHE, help="results and inductor caches (carry it)"
    )
    ap.add_argument("--float8", action="store_true", help="float8 against bf16 (benchmarks.float8)")
    ap.add_argument("--top-kernels", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="M3", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.top_kernels:
        rows = top_kernels(args.model, args.top_kernels, args.precision, args.device)
        print(json.dumps(rows))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu: no CUDA device here; --dry-run checks it on a CPU")
    device = "cpu" if args.dry_run else "cuda"
    tag = "dry-run-" if args.dry_run else ""
    cache = args.cache_dir.resolve()
    results = args.results or cache / f"{tag}results.json"
    out = args.out or (cache / "dry-run-benchmarks.md" if args.dry_run else DOC)
    saved: dict[str, Any] = json.loads(results.read_text()) if results.exists() else {}
    done = saved.setdefault("stages", {})
    part = args.part or next((s.part for s in STAGES if s.key not in done), None)
    if args.float8:
        from benchmarks import float8

        # One model at a time, saved after each (a lend may end between them); a model
        # measured without an error is not run again: run the command again to go on.
        f8 = saved.setdefault("float8", {"date": str(datetime.date.today()), "rows": []})
        failed = {r["model"] for r in f8["rows"] if "error" in r}
        done_models = {r["model"] for r in f8["rows"]} - failed
        for model in ["toy"] if args.dry_run else list(float8.SIZES):
            size = float8.TOY if args.dry_run else float8.SIZES[model]
            if size.title in done_models:
                continue
            argv = ["--dry-run", "--steps", "2", "--warmup", "1"] if args.dry_run else []
            rows = float8.run(float8.parse([*argv, "--models", "124m" if args.dry_run else model]))
            f8["rows"] = [r for r in f8["rows"] if r["model"] != size.title] + rows
            f8["date"] = str(datetime.date.today())
            saved.setdefault("torch", torch.__version__)
            saved.setdefault("device", device)
            saved.setdefault(
                "device_name", torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
            )
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps(saved, indent=1))
    elif part is None:
        print("every part is done; the section is rewritten from the saved results")
    else:
        saved["dates"] = [*saved.get("dates", []), f"part {part} {datetime.date.today()}"]
        saved["torch"] = torch.__version__
        saved["device"] = device
        saved["device_name"] = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
        notes = set(saved.get("notes", []))
        ran: set[str] = set()  # a dry run runs one suite (compile) stage a part: the
        # rest would repeat its machinery
        for stage in (s for s in STAGES if s.part == part):
            if stage.key in done and args.part is None:
                continue  # this part was cut short before: go on where it stopped
            real, why = plan(stage, args.dry_run)
            notes.update(f"{stage.key}: {n}" for n in why)
            if real.kind == "skip" or (real.kind == "suite" and real.variants in ((), ("B0",))):
                done[stage.key] = "not run"
                continue
            if args.dry_run and real.kind in ("suite", "compile") and real.kind in ran:
                notes.add(f"{stage.key}: dry run: the same machinery as this part's first")
                done[stage.key] = "not run"
                continue
            ran.add(real.kind)
            print(f"== part {part}: {stage.key}", flush=True)
            done[stage.key] = run_stage(real, args.dry_run, device, cache)
            saved["notes"] = sorted(notes)
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps(saved, indent=1))  # resumable stage by stage
        saved["notes"] = sorted(notes)
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(saved, indent=1))
    put_section(out, _section(saved, args.dry_run))
    left = sorted({s.part for s in STAGES if s.key not in done})
    print(f"wrote {out}; parts left: {left or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
