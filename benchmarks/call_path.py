"""How far a reader follows the state through a composed step: files entered, climbs back.

    python -m benchmarks.call_path [--path]
    python -m benchmarks.call_path --before REV --write docs/call_path.md

Runs ``clip_scaled(grad_accumulate(with_amp(step, "bf16"), 4), 1.0)`` on a small MLP,
eagerly and under ``compiled(..., backend="aot_eager")``, and records with
``sys.setprofile`` the source file of every Python function called during one warm
call (the third; the first compiles), in call order. Only fasttorch's own files count
(torch, the standard library and this script are left out); consecutive calls within
one file are one visit. Two numbers per composition:

- files: how many distinct fasttorch files the call enters;
- climbs back: how many visits enter a file that the path had already left
  (``steps -> grad_accumulate -> steps`` is one): each is a place where a reader
  following the state has to go back up to a file read before.

Both are counted twice: over every fasttorch function the call runs (helpers such as
``struct`` and ``_compat`` included), and over the functions the state itself passes
through, those called with a ``TrainState`` among their arguments: the path a reader
follows the state along.

Under ``compiled`` the functions a graph inlines run as generated code, so the
compiled path is what still runs in Python around the graphs. ``--path`` prints the
sequence of visits. Counts, not times: the numbers are the same on every machine for
one source tree. ``--before REV`` also counts the package as it was at git revision
``REV`` (its ``fasttorch/`` exported to a temporary directory, counted by this script
in a second process), and ``--write`` puts both, side by side, in a markdown file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import fasttorch

ROOT = Path(fasttorch.__file__).resolve().parent


def _loss_fn(apply: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(apply(x), y)


def _composed(compile_it: bool) -> Any:
    step = fasttorch.clip_scaled(
        fasttorch.grad_accumulate(fasttorch.with_amp(fasttorch.step(_loss_fn), "bf16"), 4), 1.0
    )
    return fasttorch.compiled(step, backend="aot_eager") if compile_it else step


def _carries_state(frame: FrameType) -> bool:
    """Whether the function of ``frame`` was called with a ``TrainState`` argument."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return any(isinstance(frame.f_locals.get(n), fasttorch.TrainState) for n in names)


def _files(frame: FrameType | None, state_only: bool = False) -> list[str]:
    """The fasttorch files on the stack from ``frame`` up, consecutive repeats merged
    (``state_only``: only the functions that carry the state)."""
    out: list[str] = []
    while frame is not None:
        f = Path(frame.f_code.co_filename)
        if ROOT in f.parents and (not state_only or _carries_state(frame)):
            name = f.relative_to(ROOT).as_posix().removesuffix(".py")
            if not out or out[-1] != name:
                out.append(name)
        frame = frame.f_back
    return out


def trace(
    compile_it: bool, state_only: bool, functions: set[str] | None = None
) -> tuple[set[str], set[tuple[str, str]]]:
    """The fasttorch files one warm call enters, and its climbs back (caller, callee);
    ``functions``, if given, gets each function counted, as ``file:name``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-3))
    step = _composed(compile_it)
    batch = (torch.randn(16, 8), torch.randn(16, 1))
    for _ in range(2):
        state, _ = step(state, batch)
    files: set[str] = set()
    climbs: set[tuple[str, str]] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        if ROOT not in Path(frame.f_code.co_filename).parents:
            return
        if state_only and not _carries_state(frame):
            return
        stack = _files(frame, state_only)
        if not stack:
            return
        files.add(stack[0])
        if functions is not None:
            functions.add(f"{stack[0]}:{frame.f_code.co_name}")
        # stack[0] is the callee's file, stack[1] its caller's: a climb back when the
        # callee's file is already further up, below a file it called.
        if stack[0] in stack[2:]:
            climbs.add((stack[1], stack[0]))

    sys.setprofile(profile)
    try:
        state, _ = step(state, batch)
    finally:
        sys.setprofile(None)
    return files, climbs


LABEL = "compiled(clip_scaled(grad_accumulate(with_amp(step))))"
WHICH = {False: "all", True: "those the state passes through"}


def counts() -> dict[str, dict[str, list[Any]]]:
    """Files and climbs of both compositions, both ways of counting, by ``label|which``."""
    out: dict[str, dict[str, list[Any]]] = {}
    for compile_it in (False, True):
        for state_only in (False, True):
            label = LABEL if compile_it else LABEL.removeprefix("compiled(")[:-1]
            files, climbs = trace(compile_it, state_only)
            out[f"{label}|{WHICH[state_only]}"] = {
                "files": sorted(files),
                "climbs": [list(c) for c in sorted(climbs)],
            }
    return out


def counts_at(rev: str) -> dict[str, dict[str, list[Any]]]:
    """:func:`counts` for the package as it was at git revision ``rev``."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", rev, "fasttorch"],
            check=True,
            capture_output=True,
        ).stdout
        tar = Path(tmp) / "tree.tar"
        tar.write_bytes(archive)
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        # The script by its path, so that the old package (first on PYTHONPATH) is the
        # one imported, not the checkout's.
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--json"],
            env={**os.environ, "PYTHONPATH": tmp},
            check=True,
            capture_output=True,
            text=True,
        )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _revision(rev: str) -> str:
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def table(rows: dict[str, dict[str, dict[str, list[Any]]]]) -> list[str]:
    """A markdown table: per tree and way of counting, files and climbs of both
    compositions (eager, compiled)."""
    out = [
        "| tree | functions counted | files, eager | climbs back, eager "
        "| files, compiled | climbs back, compiled |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    eager = LABEL.removeprefix("compiled(")[:-1]
    for which in WHICH.values():
        for tree, found in rows.items():
            e, c = found[f"{eager}|{which}"], found[f"{LABEL}|{which}"]
            out.append(
                f"| {tree} | {which} | {len(e['files'])} | {len(e['climbs'])} "
                f"| {len(c['files'])} | {len(c['climbs'])} |"
            )
    return out


def paths(rows: dict[str, dict[str, dict[str, list[Any]]]]) -> list[str]:
    """The files and climbs behind each count."""
    out: list[str] = []
    for tree, found in rows.items():
        for key, v in found.items():
            label, which = key.split("|")
            out.append(f"\n`{label}`, {which}, {tree}:\n")
            out.append(f"- files: {', '.join(v['files'])}")
            out.extend(f"- climbs back: {a} -> {b}" for a, b in v["climbs"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", action="store_true", help="list the files and the climbs")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument("--before", metavar="REV", help="also count git revision REV")
    parser.add_argument("--write", metavar="FILE", help="write the markdown to FILE")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(counts()))
        return
    rows = {}
    if args.before:
        rows[f"before ({_revision(args.before)})"] = counts_at(args.before)
    rows["this tree"] = counts()
    lines = table(rows)
    if args.path or args.write:
        lines += paths(rows)
    if args.write:
        command = "python -m benchmarks.call_path" + (
            f" --before {args.before}" if args.before else ""
        )
        head = [
            "# Following the state through a composed step",
            "",
            f"<!-- Written by `{command} --write {args.write}`; do not edit by hand. -->",
            "",
            "Counted by `benchmarks/call_path.py` (its docstring says how). Counts, not",
            "times: the same on every machine for one source tree.",
            "",
        ]
        Path(args.write).write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
