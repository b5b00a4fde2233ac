"""One command for a GPU machine: the GPU tests, the suite's GPU rows, the top kernels.

``python -m benchmarks.gpu`` runs the next part of three (each fits a 10-minute lend of
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

``--dry-run`` runs every piece on a CPU at toy sizes (M1, eager variants; fp16 and
CUDA-graph rows noted as not run), into ``.gpu-cache/dry-run*`` unless told otherwise:
it checks the machinery, and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
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
    """One piece of work: ``kind`` "tests", "suite" (benchmarks.run's rows) or "kernels"."""

    key: str
    part: int
    kind: str
    model: str = ""
    precision: str = ""
    variants: tuple[str, ...] = ()


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
)


def plan(stage: Stage, dry_run: bool) -> tuple[Stage, list[str]]:
    """The stage as it runs here, and a note per row it leaves out (and why)."""
    notes = []
    variants = list(stage.variants)
    for v, module in PEERS.items():
        if v in variants and importlib.util.find_spec(module) is None:
            variants.remove(v)
            notes.append(f"{v}: not run: {module} is not installed")
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


def run_stage(stage: Stage, dry_run: bool, device: str, cache: Path) -> dict[str, Any]:
    if stage.kind == "tests":
        return run_tests(dry_run)
    if stage.kind == "kernels":
        return run_kernels(stage, device, cache)
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
    notes = saved.get("notes", [])
    if notes:
        lines += ["", "Not run:", "", *(f"- {n}" for n in notes)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    ap.add_argument("--part", type=int, choices=[1, 2, 3], help="default: the next one not done")
    ap.add_argument("--dry-run", action="store_true", help="every piece on a CPU, toy sizes")
    ap.add_argument("--results", type=Path, default=None, help="the results file to resume")
    ap.add_argument("--out", type=Path, default=None, help="the document to write the section to")
    ap.add_argument(
        "--cache-dir", type=Path, default=CACHE, help="results and inductor caches (carry it)"
    )
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
    if part is None:
        print("every part is done; the section is rewritten from the saved results")
    else:
        saved["dates"] = [*saved.get("dates", []), f"part {part} {datetime.date.today()}"]
        saved["torch"] = torch.__version__
        saved["device"] = device
        saved["device_name"] = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
        notes = set(saved.get("notes", []))
        ran_suite = False  # a dry run runs one suite stage a part: the rest repeat it
        for stage in (s for s in STAGES if s.part == part):
            if stage.key in done and args.part is None:
                continue  # this part was cut short before: go on where it stopped
            real, why = plan(stage, args.dry_run)
            notes.update(f"{stage.key}: {n}" for n in why)
            if real.kind == "skip" or (real.kind == "suite" and real.variants in ((), ("B0",))):
                done[stage.key] = "not run"
                continue
            if args.dry_run and real.kind == "suite" and ran_suite:
                notes.add(f"{stage.key}: dry run: the same machinery as this part's first")
                done[stage.key] = "not run"
                continue
            ran_suite = ran_suite or real.kind == "suite"
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
