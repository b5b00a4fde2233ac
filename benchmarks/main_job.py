"""The README's main job, its first step and wall time: this tree against another, one run.

    python -m benchmarks.main_job --against 9cef45f     # rewrites docs/benchmarks_main_job.md
    python -m benchmarks.main_job --against HEAD~3 --rounds 3 --steps 20

Each run is ``examples/train_charlm.py --steps STEPS`` in a fresh process with a fresh
``TORCHINDUCTOR_CACHE_DIR`` (a cold compile, as a new user's first run), in this tree or
in the other one (its ``fasttorch/`` and ``examples/``, extracted with ``git archive``),
the two interleaved (this, other; other, this; ...) so that load on the machine hits
them alike. The job prints its own first step and wall time on its last lines; the page
gives each run's, the medians, and the median over rounds of this tree's first step over
the other's, with the verdict against the target (at most half).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.compile_time import page_head
from benchmarks.run import other_tree, resolve_rev

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks_main_job.md"
TARGET = 0.5
_LAST = re.compile(r"wall ([0-9.]+) s \| first step ([0-9.]+) s")


def parse(stdout: str) -> dict[str, float]:
    """The job's own wall time and first step, from its summary line.

    >>> parse("...\\nwall 57.1 s | first step 31.8 s | 14.42 steps/s\\n")
    {'wall': 57.1, 'first': 31.8}
    """
    found = _LAST.findall(stdout)
    if not found:
        raise ValueError(
            f"no 'wall ... | first step ...' line in the job's output:\n{stdout[-2000:]}"
        )
    wall, first = found[-1]
    return {"wall": float(wall), "first": float(first)}


def run_job(tree: Path, steps: int, scratch: Path) -> dict[str, float]:
    """One cold run of the main job in ``tree``; its outputs and caches under ``scratch``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "ind")}
    cmd = [sys.executable, "examples/train_charlm.py", "--steps", str(steps)]
    cmd += ["--out", str(scratch / "out")]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the main job failed in {tree}:\n{done.stderr[-3000:]}")
    return parse(done.stdout)


def measure(other: str, rounds: int, steps: int) -> list[dict[str, Any]]:
    """Every run: ``{"round", "tree" ("this" or the other commit), "first", "wall"}``."""
    rows = []
    that = other_tree(other, ("fasttorch", "examples"))
    try:
        for r in range(rounds):
            order = [("this", ROOT), (other[:7], that)]
            for name, tree in order if r % 2 == 0 else order[::-1]:
                with tempfile.TemporaryDirectory(prefix="ft-main-job-run-") as scratch:
                    res = run_job(tree, steps, Path(scratch))
                rows.append({"round": r, "tree": name, **res})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(that, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]], other: str) -> str:
    """Each run's times, then the medians and the verdict."""
    lines = ["| round | tree | first step (s) | wall (s) |", "|---:|---|---:|---:|"]
    lines += [f"| {r['round']} | {r['tree']} | {r['first']:.1f} | {r['wall']:.1f} |" for r in rows]
    by = {(r["round"], r["tree"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    ratios = [
        by[(k, "this")]["first"] / by[(k, other)]["first"]
        for k in rounds
        if (k, "this") in by and (k, other) in by
    ]

    def med(tree: str, key: str) -> str:
        xs = [r[key] for r in rows if r["tree"] == tree]
        return f"{statistics.median(xs):.1f}" if xs else "–"

    lines += [
        "",
        "| | this tree | " + other + " |",
        "|---|---:|---:|",
        f"| first step, median (s) | {med('this', 'first')} | {med(other, 'first')} |",
        f"| wall, median (s) | {med('this', 'wall')} | {med(other, 'wall')} |",
    ]
    if ratios:
        ratio = statistics.median(ratios)
        verdict = "met" if ratio <= TARGET else "not met"
        lines += [
            "",
            "| first step, this tree / " + other + " (median [min-max] of per-round ratios) "
            "| measured | target | verdict |",
            "|---|---:|---:|---|",
            f"| the main job | {ratio:.2f} [{min(ratios):.2f}-{max(ratios):.2f}] | <= {TARGET} "
            f"| {verdict} |",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", required=True, help="the other tree's commit")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", help="also write the runs' rows here")
    p.add_argument("--out", default=str(DOC))
    args = p.parse_args()
    args.smoke, args.from_json = False, None  # for page_head
    commit = resolve_rev(args.against)
    t0 = time.perf_counter()
    rows = measure(commit, args.rounds, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    machine = "each run a cold process (its own inductor cache); the trees interleaved"
    options = f"--against {commit[:7]} --rounds {args.rounds} --steps {args.steps}"
    head = page_head(
        "Benchmarks: the main job's first step",
        "main_job",
        machine,
        options,
        args,
        time.perf_counter() - t0,
    )
    intro = (
        f"`examples/train_charlm.py --steps {args.steps}` (the README's main job, fewer "
        "steps: the first step is the same), this tree against the tree of commit "
        f"{commit[:12]}, each run a fresh process with a fresh `TORCHINDUCTOR_CACHE_DIR`; "
        "the job's own first step (compile included) and wall time, as it prints them."
    )
    Path(args.out).write_text("\n".join([*head, "", intro, "", table(rows, commit[:7])]) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
