"""The one command: run the benchmark suite and rewrite ``docs/benchmarks.md``.

``python -m benchmarks.run`` (about an hour on 2 CPU cores for the CPU models; see
``--help``).

Each variant runs in its own process (``benchmarks.worker``); rounds interleave the
variants (every round runs each once, in order), at least 3 of them. Within a round
the timed blocks interleave too: the variants' processes compile and warm up one after
another, then take turns, one block each (A B C, A B C, ...), so a change in the
machine's speed during the round hits every variant alike. Compilation and the
warm-up steps are untimed; a run's time is the median of its blocks; a round whose
baseline (B0) time per step drifts more than 5% from the baseline's median over
rounds is discarded, and the document says so. Round 0 compiles into a fresh
``TORCHINDUCTOR_CACHE_DIR`` per variant (cold); later rounds reuse it (warm).

``--against REV`` also runs each fasttorch variant (F0, F1, ...) with the ``fasttorch/``
of another commit of this repository (``git archive`` into a temporary directory,
removed at the end; the user's tree is never touched), measured by this tree's harness
in the same rounds, each right after this tree's, and reports the speed of this tree
over that one per model and variant.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.sections import keep_section
from benchmarks.stats import Summary, drifted_rounds, payback_steps, per_step, schedule, summarize

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
ALL_VARIANTS = ("B0", "B1", "B2", "B3", "B4", "B5", "F0", "F1", "F2", "F0T", "F1T")
GPU_ONLY = ("B3", "F2")
STOCK = ("B1", "B2", "B3")
MARK = "@@RESULT@@ "
READY, BLOCK = "@@READY@@", "@@BLOCK@@ "  # as benchmarks.worker prints them


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument(
        "--models", default="M1,M2,M3", help="comma-separated, of M1,M2,M3,M4 (M4: a ResNet)"
    )
    p.add_argument("--variants", default=",".join(ALL_VARIANTS), help="comma-separated")
    p.add_argument(
        "--precisions",
        default=None,
        help="bf16[,fp16][,fp32]; fp16 needs a GPU; fp32 is a diagnostic (autocast off)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--loss-at", type=int, default=50)
    p.add_argument("--drift", type=float, default=0.05, help="baseline drift that discards")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument(
        "--omp-wait-policy",
        default="",
        help="OMP_WAIT_POLICY for the workers (default: unset, OpenMP's own, as users run)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds a worker may take per stage")
    p.add_argument(
        "--gap", type=float, default=0.05, help="idle seconds between two workers' blocks"
    )
    p.add_argument("--out", type=Path, default=DOC, help="the Markdown file to rewrite")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="rewrite the document from results a --json run saved, without running "
        "anything (give that run's --rounds/--blocks/--steps/--warmup/--loss-at too)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check the machinery in seconds: M1, B0 and F0, tiny blocks (numbers mean nothing)",
    )
    p.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also run each fasttorch variant (F0, F1, ...) with the fasttorch/ of this "
        "git revision (this tree's harness, the same rounds) and report this tree's speed "
        "over it, e.g. --against HEAD~1",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.variants = "M1", "B0,F0"
        args.rounds, args.blocks, args.steps, args.warmup, args.loss_at = 1, 2, 3, 1, 3
    args.against_commit = None
    if args.against is not None:
        if args.from_json is not None:
            p.error(
                "--against runs the other tree's variants; --from-json runs nothing "
                "(a --json file of an --against run keeps its rows): give one of them"
            )
        if not any(v.startswith("F") for v in args.variants.split(",")):
            p.error(
                f"--against {args.against} compares fasttorch variants, and --variants "
                f"{args.variants} has none: add F0 or F1 (of {', '.join(ALL_VARIANTS)})"
            )
        args.against_commit = resolve_rev(args.against)
    return args


def resolve_rev(rev: str) -> str:
    """The full hash of the commit ``rev`` names in this repository.

    Exits with a message naming ``rev`` when git knows no such commit.
    """
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(
            f"--against {rev!r}: not a commit of the repository at {ROOT} "
            f"({out.stderr.strip() or 'git rev-parse found none'}); give a revision git "
            "knows: a commit hash, a branch, a tag, HEAD~1"
        )
    return out.stdout.strip()


def against_key(variant: str, commit: str) -> str:
    """The row name of ``variant`` run with the other tree: ``F1@487a65c``."""
    return f"{variant}@{commit[:7]}"


def base_variant(key: str) -> str:
    """The variant a row runs: ``F1`` for ``F1`` and for ``F1@487a65c``."""
    return key.split("@", 1)[0]


def other_tree(commit: str, paths: tuple[str, ...] = ("fasttorch",)) -> Path:
    """``paths`` of ``commit`` in a fresh temporary directory (``git archive``).

    By default only the package is extracted: a worker started there (its working
    directory, so first on ``sys.path``) imports that ``fasttorch`` and this tree's
    ``benchmarks`` (on ``PYTHONPATH``). The caller removes the directory.
    """
    where = Path(tempfile.mkdtemp(prefix=f"ft-bench-against-{commit[:7]}-"))
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, *paths],
        capture_output=True,
    )
    if tar.returncode != 0:
        shutil.rmtree(where, ignore_errors=True)
        raise SystemExit(
            f"--against: git archive of fasttorch/ at {commit[:12]} failed: "
            f"{tar.stderr.decode(errors='replace').strip()}"
        )
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(where, filter="data")
        else:  # Python < 3.11.4: our own repository's archive
            t.extractall(where)
    return where


def with_against(variants: list[str], commit: str | None) -> list[str]:
    """``variants`` with, right after each fasttorch one, its row run with ``commit``.

    >>> with_against(["B0", "F0", "F1"], "487a65c004e3")
    ['B0', 'F0', 'F0@487a65c', 'F1', 'F1@487a65c']
    """
    out: list[str] = []
    for v in variants:
        out.append(v)
        if commit is not None and v.startswith("F"):
            out.append(against_key(v, commit))
    return out


def _cuda_available() -> bool:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() == "True"


def _omp_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' environment: ``OMP_WAIT_POLICY`` as asked, unset by default.

    OpenMP's default lets a thread spin briefly between parallel regions; with
    ``PASSIVE`` every small op wakes the other thread from sleep, which on 2 cores made
    M1 about 3x slower in every variant and measured thread wake-ups, not the step.
    """
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    return env


class Worker:
    """One worker process in ``--serve`` mode, driven over its standard input and output.

    A thread reads its output into a queue, so every wait has a deadline; its standard
    error goes to a file (never a full pipe) and gives the reason when it fails.
    """

    def __init__(
        self, cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = ROOT
    ) -> None:
        self.timeout = timeout
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by finish)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            bufsize=1,
            env=env,
            cwd=cwd,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.result: dict[str, Any] | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _until(self, marker: str) -> str | None:
        """The rest of the next line starting with ``marker``; ``None`` if it ended first.

        A result line instead is kept as the worker's result (it failed, or finished).
        """
        deadline = time.perf_counter() + self.timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.perf_counter(), 0.0))
            except queue.Empty:
                self.fail(f"timed out after {self.timeout:.0f} s")
                return None
            if line is None:
                if self.result is None:
                    self.fail(f"worker exited {self.proc.wait()}")
                return None
            if line.startswith(MARK):
                self.result = json.loads(line[len(MARK) :])
                if marker == MARK:
                    return line[len(MARK) :]
            elif line.startswith(marker):
                return line[len(marker) :]

    def fail(self, why: str) -> None:
        self.kill()
        self.err.seek(0)
        tail = self.err.read().strip().splitlines()[-3:]
        self.result = {"error": f"{why}: {' | '.join(tail)[:300]}" if tail else why}

    def ready(self) -> bool:
        """Wait until it has compiled and warmed up; ``False`` if it failed instead."""
        return self._until(READY) is not None and self.result is None

    def block(self) -> bool:
        """Run one timed block in it; ``False`` if it failed."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("block\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died; _until reports how
        return self._until(BLOCK) is not None and self.result is None

    def finish(self) -> dict[str, Any]:
        """Let it measure the rest and exit; its JSON result (with ``error`` if it failed)."""
        if self.result is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("done\n")
                self.proc.stdin.close()
            except OSError:
                pass
            self._until(MARK)
        self.kill()
        self.err.close()
        res = self.result or {"error": "no result"}
        res["wall_s"] = time.perf_counter() - self.t0
        return res

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def worker_cmd(
    args: argparse.Namespace, model: str, variant: str, precision: str, device: str
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.worker",
        *("--model", model, "--variant", variant, "--precision", precision),
        *("--device", device, "--blocks", str(args.blocks), "--steps", str(args.steps)),
        *("--warmup", str(args.warmup), "--loss-at", str(args.loss_at), "--serve"),
    ]


def run_round(
    args: argparse.Namespace,
    model: str,
    variants: list[str],
    precision: str,
    device: str,
    caches: dict[str, Path],
    r: int,
) -> dict[str, dict[str, Any]]:
    """One round: every variant in its own process, their timed blocks interleaved.

    The processes start one after another, each compiling and warming up while the
    others wait idle (so compile times are measured alone); then they take turns, one
    block each, ``blocks`` times over; then each measures the rest (profile) alone.
    A row of the other tree (``F1@487a65c``, ``--against``) runs in that tree's
    directory (``args.against_tree``), so it imports that tree's ``fasttorch``.
    """
    env = _omp_env(args)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    other: Path | None = getattr(args, "against_tree", None)
    workers: dict[str, Worker] = {}
    out: dict[str, dict[str, Any]] = {}
    try:
        for v in variants:
            cmd = worker_cmd(args, model, base_variant(v), precision, device)
            if r == 0:
                cmd.append("--profile")
                if device == "cuda" and model == "M3" and v == variants[0]:
                    cmd.append("--matmul-peak")
            tree = ROOT if "@" not in v else other
            if tree is None:
                raise ValueError(f"{v}: a row of another tree, and args.against_tree is unset")
            venv = {**env, "TORCHINDUCTOR_CACHE_DIR": str(caches[v])}
            if tree != ROOT:
                venv["PYTHONPATH"] = os.pathsep.join([str(tree), env["PYTHONPATH"]])
            w = Worker(cmd, venv, args.timeout, cwd=tree)
            workers[v] = w
            if not w.ready():
                out[v] = w.finish()
        for _, v in schedule(variants, args.blocks):  # A B C, A B C, ...
            if v in out:  # failed
                continue
            time.sleep(args.gap)  # let the last one's OpenMP threads go idle
            if not workers[v].block():
                out[v] = workers[v].finish()
        for v in variants:
            if v not in out:
                out[v] = workers[v].finish()
    finally:
        for w in workers.values():
            w.kill()
    for v in variants:
        _check_tree(out[v], ROOT if "@" not in v else other, v)
    return {v: out[v] for v in variants}


def _check_tree(res: dict[str, Any], tree: Path | None, key: str) -> None:
    """Mark ``res`` failed if its worker imported ``fasttorch`` from another tree than
    ``tree`` (a row measuring the wrong code must not look like a result)."""
    got = res.get("fasttorch_file")
    if "error" in res or got is None or tree is None:
        return
    if not Path(got).resolve().is_relative_to(tree.resolve()):
        res["error"] = f"{key} imported fasttorch from {got}, not from {tree}"


def run_model(
    args: argparse.Namespace,
    model: str,
    variants: list[str],
    precision: str,
    device: str,
    cache_root: Path | None = None,
) -> dict[str, Any]:
    """All rounds of one model at one precision: raw results by round and variant.

    Each variant compiles into a fresh inductor cache, removed afterwards; with
    ``cache_root``, into ``cache_root/<model>-<precision>-<variant>``, kept (a later run
    of the same command starts warm: benchmarks/gpu.py).
    """
    if cache_root is None:
        caches = {v: Path(tempfile.mkdtemp(prefix=f"ft-bench-{model}-{v}-")) for v in variants}
    else:
        caches = {v: cache_root / f"{model}-{precision}-{v}" for v in variants}
        for d in caches.values():
            d.mkdir(parents=True, exist_ok=True)
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    load: dict[int, float] = {}
    try:
        for r in range(args.rounds):
            load[r] = os.getloadavg()[0]
            for v, res in run_round(args, model, variants, precision, device, caches, r).items():
                res["round"], res["cold"] = r, r == 0
                runs.setdefault(r, {})[v] = res
                status = res.get("error") or (
                    f"{1e3 * per_step(res['blocks_s'], res['steps_per_block']):.2f} ms/step, "
                    f"first step {res['first_step_s']:.1f} s"
                )
                print(f"  {model} {precision} round {r} {v}: {status}", flush=True)
    finally:
        if cache_root is None:
            for d in caches.values():
                shutil.rmtree(d, ignore_errors=True)
    return {
        "model": model,
        "precision": precision,
        "device": device,
        "runs": runs,
        "load_1min": load,
    }


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, spec)


def analyse(block: dict[str, Any], baseline: str = "B0", tol: float = 0.05) -> dict[str, Any]:
    """Per-variant figures of one model from its raw runs."""
    runs: dict[int, dict[str, dict[str, Any]]] = block["runs"]
    times: dict[str, dict[int, float]] = {}
    for r, by_v in runs.items():
        for v, res in by_v.items():
            if "error" not in res and res.get("blocks_s"):
                times.setdefault(v, {})[r] = per_step(res["blocks_s"], res["steps_per_block"])
    errors = {
        v: res["error"] for by_v in runs.values() for v, res in by_v.items() if "error" in res
    }
    if baseline not in times:
        return {"errors": errors, "summary": {}, "discarded": {}, "kept": []}
    discarded = drifted_rounds(times[baseline], tol)
    kept = sorted(r for r in times[baseline] if r not in discarded)
    summary = summarize(times, baseline, kept)
    stock = {v: summary[v] for v in STOCK if v in summary}
    best_stock = min(stock, key=lambda v: stock[v].seconds_per_step) if stock else None
    per_variant: dict[str, dict[str, Any]] = {}
    for v in summary:
        res_all = [runs[r][v] for r in sorted(runs) if v in runs[r] and "error" not in runs[r][v]]
        cold = [x["compile_s"] for x in res_all if x["cold"] and "compile_s" in x]
        warm = [x["compile_s"] for x in res_all if not x["cold"] and "compile_s" in x]
        prof = next((x for x in res_all if "syncs_per_step" in x), {})
        s, b = summary[v].seconds_per_step, summary[baseline].seconds_per_step
        per_variant[v] = {
            "cold_s": cold[0] if cold else None,
            "warm_s": statistics.median(warm) if warm else None,
            "syncs": prof.get("syncs_per_step"),
            "extern": prof.get("extern_share"),
            "alloc_mb": prof["step_peak_alloc_bytes"] / 2**20 if prof else None,
            "rss_mb": statistics.median(
                x["peak_rss_timed_mb"] - x["rss_base_mb"]
                for x in res_all
                if x.get("peak_rss_timed_mb") is not None
            )
            if any(x.get("peak_rss_timed_mb") is not None for x in res_all)
            else None,
            "cuda_mb": statistics.median(x["peak_cuda_alloc_mb"] for x in res_all)
            if res_all and "peak_cuda_alloc_mb" in res_all[0]
            else None,
            "loss": res_all[0].get("loss") if res_all else None,
            "n_params": res_all[0].get("n_params") if res_all else None,
            "payback_cold": payback_steps(cold[0], s, b) if cold else None,
            "payback_warm": payback_steps(statistics.median(warm), s, b) if warm else None,
            "tflops": next(
                (x["bf16_matmul_tflops"] for x in res_all if "bf16_matmul_tflops" in x), None
            ),
        }
    # --against: this tree's variant over the other tree's, per round, every round
    against: dict[str, dict[str, Any]] = {}
    for key in times:
        if "@" in key and base_variant(key) in times:
            new, old = times[base_variant(key)], times[key]
            both = [r for r in sorted(new) if r in old]
            if both:
                against[base_variant(key)] = {
                    "speed": summarize({"new": new, "old": old}, "old", both)["new"],
                    "old_s": statistics.median(old[r] for r in both),
                }
    probes = [
        res["isa_probe_s"]
        for by_v in runs.values()
        for res in by_v.values()
        if res.get("cold") and res.get("isa_probe_s") and "error" not in res
    ]
    return {
        "errors": errors,
        "isa_probe_s": statistics.median(probes) if probes else None,
        "summary": summary,
        "discarded": discarded,
        "kept": kept,
        "best_stock": best_stock,
        "figures": per_variant,
        "baseline_times": times[baseline],
        "against": against,
    }


def _table(block: dict[str, Any], a: dict[str, Any], variants: list[str], gpu: bool) -> list[str]:
    summary: dict[str, Summary] = a["summary"]
    figs = a.get("figures", {})
    best = a.get("best_stock")
    b0_loss = figs.get("B0", {}).get("loss")
    mem_head = "peak CUDA alloc (MiB)" if gpu else "step alloc peak (MiB)"
    lines = [
        f"| variant | ms/step | steps/s | x B0 [min-max] | x best stock ({best or '–'}) "
        f"| compile cold / warm (s) | pays off after (steps, cold / warm) | {mem_head} "
        f"| peak RSS (MiB) | host syncs/step | matmul/conv/attention share "
        f"| loss@{block.get('loss_at', 50)} (vs B0) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        if v not in summary:
            why = a["errors"].get(v) or "not run"
            lines.append(f"| {v} | {why} |" + " |" * 11)
            continue
        s, f = summary[v], figs[v]
        vs_best = summary[best].seconds_per_step / s.seconds_per_step if best else None
        loss = f["loss"]
        rel = (loss - b0_loss) / abs(b0_loss) if loss is not None and b0_loss else None
        pay = "–"
        if v != "B0":
            pc, pw = f["payback_cold"], f["payback_warm"]
            never_warm = "never" if f["warm_s"] is not None else "–"
            pay = f"{_fmt(pc, '.0f', 'never')} / {_fmt(pw, '.0f', never_warm)}"
        mem = f["cuda_mb"] if gpu else f["alloc_mb"]
        lines.append(
            f"| {v} | {1e3 * s.seconds_per_step:.2f} | {1 / s.seconds_per_step:.1f} "
            f"| {s.ratio_to_baseline:.2f} [{s.ratio_min:.2f}-{s.ratio_max:.2f}] "
            f"| {_fmt(vs_best)} | {_fmt(f['cold_s'], '.1f')} / {_fmt(f['warm_s'], '.1f')} "
            f"| {pay} | {_fmt(mem, '.2f')} | {_fmt(f['rss_mb'], '.0f')} "
            f"| {_fmt(f['syncs'], '.0f')} | {_fmt(f.get('extern'), '.0%')} "
            f"| {_fmt(loss, '.4f')} ({_fmt(rel, '+.2%')}) |"
        )
    return lines


def _round(item: tuple[Any, float]) -> int:
    return int(item[0])  # rounds are str keys in a --json file


def _against_table(block: dict[str, Any], a: dict[str, Any]) -> list[str]:
    """This tree's fasttorch variants against the same variants of ``--against``'s tree."""
    against: dict[str, dict[str, Any]] = a.get("against") or {}
    if not against:
        return []
    commit = block.get("against_commit") or "?"
    rev = block.get("against") or commit[:7]
    lines = [
        f"### {block['model']}: this tree against {rev} ({commit[:12]})",
        "",
        f"The same variants with the `fasttorch/` of {commit[:12]} (rows `F…@{commit[:7]}` "
        "above), measured by this tree's harness in the same rounds, each process right "
        "after this tree's, the blocks taking turns. New/old speed is the median over the "
        "rounds of (old ms/step) / (new ms/step) in the same round, min-max in brackets; "
        "above 1 this tree is faster. Every round counts (both sides ran in it, so the "
        "drift rule, which is about B0 across rounds, discards none here); the ms/step "
        "are medians over the same rounds.",
        "",
        f"| variant | this tree ms/step | {commit[:7]} ms/step | new/old speed [min-max] "
        "| rounds |",
        "|---|---:|---:|---:|---:|",
    ]
    for v, c in against.items():
        s: Summary = c["speed"]
        lines.append(
            f"| {v} | {1e3 * s.seconds_per_step:.2f} | {1e3 * c['old_s']:.2f} "
            f"| {s.ratio_to_baseline:.2f} [{s.ratio_min:.2f}-{s.ratio_max:.2f}] "
            f"| {s.rounds} |"
        )
    return [*lines, ""]


def targets(results: list[dict[str, Any]], gpu: bool) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for the issue's targets that these results cover."""
    by = {(b["model"], b["precision"]): b["analysis"] for b in results}
    rows: list[tuple[str, str, str]] = []

    def ratio(m: str, v: str, to: str = "B0", prec: str = "bf16") -> float | None:
        a = by.get((m, prec))
        if not a or v not in a["summary"]:
            return None
        if to == "best":
            best = a.get("best_stock")
            if not best:
                return None
            return a["summary"][best].seconds_per_step / a["summary"][v].seconds_per_step
        return a["summary"][v].ratio_to_baseline

    def bound(m: str) -> str:
        """Amdahl's bound on a compiled speed-up: B0's time outside extern kernels."""
        a = by.get((m, "bf16"))
        share = a.get("figures", {}).get("B0", {}).get("extern") if a else None
        if not share or share >= 1:
            return ""
        return f" (bound {1 / share:.2f}: {share:.0%} of B0 is matmul/conv/attention)"

    def check(name: str, got: float | None, want: float, spec: str = ".2f", note: str = "") -> None:
        if got is None:
            rows.append((name, "not run", "–"))
        else:
            verdict = "met" if got >= want else "**missed**"
            rows.append((name, format(got, spec) + (note if got < want else ""), verdict))

    if not gpu:
        for m in ("M1", "M2", "M3"):
            check(f"{m}: F0 >= 0.98x B0", ratio(m, "F0"), 0.98)
        check("M1: F1 >= 2.0x B0", ratio("M1", "F1"), 2.0, note=bound("M1"))
        check("M1: F1 >= 1.25x best stock (B1-B3)", ratio("M1", "F1", "best"), 1.25)
        check("M3: F1 >= 1.2x B0", ratio("M3", "F1"), 1.2, note=bound("M3"))
        a3 = by.get(("M3", "bf16"))
        cold = a3["figures"].get("F1", {}).get("cold_s") if a3 and "figures" in a3 else None
        rows.append(
            (
                "M3: F1 compile < 30 s (cold)",
                _fmt(cold, ".1f"),
                "–" if cold is None else ("met" if cold < 30 else "**missed**"),
            )
        )
        for (m, _), a in sorted(by.items()):
            figs = a.get("figures", {})
            for v in ("F0", "F1"):
                syncs = figs.get(v, {}).get("syncs")
                if syncs is not None:
                    rows.append(
                        (
                            f"{m}: {v} zero host syncs/step",
                            f"{syncs:g}",
                            "met" if syncs == 0 else "**missed**",
                        )
                    )
                mem, base = figs.get(v, {}).get("alloc_mb"), figs.get("B0", {}).get("alloc_mb")
                if mem is not None and base is not None:
                    rows.append(
                        (
                            f"{m}: {v} step alloc peak <= B0",
                            f"{mem:.2f} vs {base:.2f} MiB",
                            "met" if mem <= base else "**missed**",
                        )
                    )
    else:
        check("M1: F2 >= 3x B0", ratio("M1", "F2"), 3.0)
        check("M2: F2 >= 3x B0", ratio("M2", "F2"), 3.0)
        check("M3 (GPT-2 124M): F1 >= 1.6x B0", ratio("M3", "F1"), 1.6)
        check("M3: F1 >= 1.3x best stock", ratio("M3", "F1", "best"), 1.3)
        check("M3 fp16 (GradScaler): F1 >= 1.6x B0", ratio("M3", "F1", prec="fp16"), 1.6)
        for m in ("M1", "M2", "M3", "M4"):
            check(f"{m}: F0 >= 0.99x B0", ratio(m, "F0"), 0.99)
        a4, f4 = by.get(("M4", "bf16")), by.get(("M4", "fp32"))
        if a4 and f4 and "F1" in a4["summary"] and "B0" in f4["summary"]:
            fast = a4["summary"]["F1"].seconds_per_step
            check("M4: bf16 F1 >= 2.5x fp32 B0", f4["summary"]["B0"].seconds_per_step / fast, 2.5)
            mem = a4.get("figures", {}).get("F1", {}).get("alloc_mb")
            base = f4.get("figures", {}).get("B0", {}).get("alloc_mb")
            if mem is not None and base:
                check("M4: bf16 F1 peak <= 0.5x fp32 B0", base / mem, 2.0, note=" (inverse)")
        else:
            check("M4: bf16 F1 >= 2.5x fp32 B0", None, 2.5)
        a3 = by.get(("M3", "bf16"))
        if a3 and "F1" in a3.get("summary", {}):
            from benchmarks.models import flops_per_window

            f = a3["figures"]["F1"]
            peak = next((x["tflops"] for x in a3["figures"].values() if x.get("tflops")), None)
            fl = flops_per_window("M3", "cuda", f["n_params"])
            if peak and fl:
                mfu = fl / a3["summary"]["F1"].seconds_per_step / 1e12 / peak
                check("M3: F1 MFU >= 50% of measured bf16 matmul peak", mfu, 0.50, ".1%")
            b1 = a3["figures"].get("B1", {}).get("cold_s")
            if f.get("cold_s") and b1:
                check(
                    "M3: F1 cold compile <= 2x B1's", 2 * b1 / f["cold_s"], 1.0, note=" (2xB1/F1)"
                )
    return rows


def environment(args: argparse.Namespace, device: str) -> list[str]:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, json; print(json.dumps([torch.__version__, torch.get_num_threads(),"
            " torch.cuda.get_device_name() if torch.cuda.is_available() else None]))",
        ],
        capture_output=True,
        text=True,
        env=_omp_env(args),
    )
    tv, threads, gpu_name = json.loads(probe.stdout.strip().splitlines()[-1])
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    versions = []
    for mod in ("lightning", "accelerate"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            versions.append(f"{mod} not installed")
    return [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {cpu}; {os.cpu_count()} logical CPUs visible; torch threads {threads}"
        + (f"; GPU: {gpu_name}" if gpu_name else "; no GPU"),
        f"- torch {tv}; {', '.join(versions)}; Python {platform.python_version()}",
        f"- worker environment: OMP_WAIT_POLICY={args.omp_wait_policy or 'unset'}, a fresh "
        "TORCHINDUCTOR_CACHE_DIR per variant (round 0: cold), reused in later rounds (warm)",
        f"- rounds {args.rounds}, blocks {args.blocks} x {args.steps} steps (the variants' "
        "blocks taking turns within a round), untimed warm-up "
        f"max({args.warmup}, {args.loss_at} - 1) steps after the first (compiling) step; "
        f"drift limit {args.drift:.0%}"
        + (" (**--smoke: the numbers mean nothing**)" if args.smoke else ""),
        f"- command: `python -m benchmarks.run {' '.join(sys.argv[1:])}`".replace("  ", " "),
    ]


def render(
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    device: str,
    total_s: float,
    env: list[str] | None = None,
) -> str:
    from benchmarks.models import spec
    from benchmarks.variants import VARIANTS

    gpu = device == "cuda"
    out = [
        "# Benchmarks",
        "",
        "<!-- Written by `python -m benchmarks.run`; do not edit by hand. -->",
        "",
        *(env if env is not None else environment(args, device)),
        f"- suite wall time: {total_s / 60:.1f} min",
        "- populations, many models in one vmapped step: "
        "[benchmarks_population.md](benchmarks_population.md) "
        "(`python -m benchmarks.population`)",
        "",
        "Every variant trains the same model from the same initial weights on the same "
        "synthetic windows: one optimizer step = 4 microbatches, autocast, clip to norm 1, "
        "AdamW (lr 1e-3, weight decay 0.01). Speed-ups are medians over the kept rounds of "
        'the per-round ratio to B0 (min-max over rounds in brackets); "x best stock" is '
        "against the fastest of B1-B3. Within a round each variant runs in its own "
        "process and the processes take turns, one timed block each, so the machine's "
        "drift hits them alike. Compile time is the first step minus a median step; in a "
        "cold cache on a CPU it includes inductor's one-time probe of the C++ compiler's "
        "vector instruction sets (timed where it runs; the ISA probe line under each table). "
        '"Pays off after" is compile time over the time saved per step against B0. Host '
        "syncs are the profiler's `aten::_local_scalar_dense` events per step (on a CPU "
        "these are scalar reads, not device waits, but they are what a GPU would wait on). "
        + (
            "Memory is `torch.cuda.max_memory_allocated` over the timed blocks. "
            if gpu
            else '"Step alloc peak" is the peak of tensor bytes allocated within a step '
            "above what was live when it began, from the profiler's memory events (the "
            "persistent state, parameters plus AdamW moments, is the same in every variant "
            'and not included); "peak RSS" is the process\'s peak resident set over the '
            "timed blocks above its RSS before the model was built, which also counts the "
            "compiler's own memory and code. "
        )
        + '"Matmul/conv/attention share" is the part of the host time the profiler puts '
        "in matrix-product, convolution and attention kernels; a compiler calls these "
        "rather than generating them, so 1 / (B0's share) bounds what compiling the rest "
        "can gain over B0 while those kernels run as they are (the bound quoted for a "
        "missed speed-up target). On a CPU without bf16 units F1 does not leave them as "
        "they are: fasttorch's `compiled` computes bf16 matrix products and attention in "
        "float32 there (`cpu_gemm`, docs/design.md), which is several times faster, so F1 "
        "can pass the bound. "
        "Loss@50 is the window loss at step 50 (bf16 rounding makes small differences).",
        "",
        "| | variant |",
        "|---|---|",
        *(f"| {k} | {d}{' (GPU only)' if k in GPU_ONLY else ''} |" for k, d in VARIANTS.items()),
        "",
        "Compile time (cold, warm start and depth scaling, against `torch.compile(model)`): "
        "[Benchmarks: compile time](benchmarks_compile.md), written by "
        "`python -m benchmarks.compile_time`.",
        "",
    ]
    rows = targets(results, gpu)
    if rows:
        out += ["## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
        if args.smoke:
            rows = [(t, m, "not judged (--smoke)") for t, m, _ in rows]
        out += [f"| {t} | {m} | {v} |" for t, m, v in rows]
        if not gpu:
            out += [
                "| GPU targets (M1/M2 F2 >= 3x B0; GPT-2 124M F1 >= 1.5x B0, MFU >= 45%) "
                "| not run: no GPU | – |"
            ]
        out.append("")
    for block in results:
        m, prec = block["model"], block["precision"]
        a = block["analysis"]
        n = next((f["n_params"] for f in a.get("figures", {}).values()), None)
        out += [f"## {m} ({prec}): {spec(m, device).title}", ""]
        if n:
            out += [f"{n / 1e6:.3f} M parameters.", ""]
        out += _table(block, a, block["variants"], gpu)
        out.append("")
        bt = a.get("baseline_times", {})
        if bt:
            out.append(
                "B0 ms/step by round: "
                + ", ".join(f"{r}: {1e3 * t:.2f}" for r, t in sorted(bt.items()))
                + "."
            )
        probe = a.get("isa_probe_s")
        if probe:
            out.append(
                f"Cold compiles include inductor's ISA probe, {probe:.1f} s (median over the "
                "variants that compile): once per cache directory, whatever the model; "
                "`torch.compile` runs it in line before the first kernel, fasttorch's "
                "`compiled` in a thread beside tracing."
            )
        load = block.get("load_1min")
        if load:
            out.append(
                "Load average (1 min) as each round began: "
                + ", ".join(f"{r}: {x:.2f}" for r, x in sorted(load.items(), key=_round))
                + f" ({os.cpu_count()} logical CPUs)."
            )
        if a["discarded"]:
            out.append(
                "Discarded rounds (B0 drifted more than the limit from its median): "
                + ", ".join(f"round {r} ({d:+.1%})" for r, d in sorted(a["discarded"].items()))
                + "."
            )
        else:
            out.append("No round discarded for baseline drift.")
        for v, e in a["errors"].items():
            out.append(f"- {v} failed: `{e}`")
        for v in block.get("skipped", []):
            out.append(f"- {v}: not run: no GPU")
        out.append("")
        out += _against_table(block, a)
    if not gpu:
        out += [
            "## Not run here",
            "",
            "GPU rows (B3, F2, fp16 with GradScaler, GPT-2 124M at context 1024, MFU against "
            "a measured bf16 matmul peak): not run: no GPU. The same command runs them on a "
            "CUDA machine.",
            "",
        ]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.from_json is not None:
        return _rerender(args)
    t_start = time.perf_counter()
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    gpu = device == "cuda"
    precisions = (args.precisions or ("bf16,fp16" if gpu else "bf16")).split(",")
    wanted = [v for v in args.variants.split(",") if v]
    unknown = [v for v in wanted if v not in ALL_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {ALL_VARIANTS}")
    if "B0" not in wanted:
        wanted.insert(0, "B0")  # the baseline of every ratio and of the drift rule
    runnable = [v for v in wanted if gpu or v not in GPU_ONLY]
    skipped = [v for v in wanted if v not in runnable]
    commit = args.against_commit
    runnable, wanted = with_against(runnable, commit), with_against(wanted, commit)
    if args.rounds < 3 and not args.smoke:
        print("warning: fewer than 3 rounds", file=sys.stderr)
    load_start = os.getloadavg()
    results = []
    args.against_tree = other_tree(commit) if commit is not None else None
    try:
        for prec in precisions:
            if prec == "fp16" and not gpu:
                print("fp16 rows: not run: no GPU", flush=True)
                continue
            for m in args.models.split(","):
                print(
                    f"{m} {prec} on {device}: {', '.join(runnable)} x {args.rounds} rounds",
                    flush=True,
                )
                block = run_model(args, m, runnable, prec, device)
                block["variants"] = wanted
                block["loss_at"] = args.loss_at
                block["skipped"] = skipped
                block["against"], block["against_commit"] = args.against, commit
                block["analysis"] = analyse(block, tol=args.drift)
                results.append(block)
    finally:
        if args.against_tree is not None:
            shutil.rmtree(args.against_tree, ignore_errors=True)
    wall_s = time.perf_counter() - t_start
    env = environment(args, device)
    load_end = os.getloadavg()
    env.append(
        "- load average (1 / 5 / 15 min) at the start: "
        + " / ".join(f"{x:.2f}" for x in load_start)
        + "; at the end: "
        + " / ".join(f"{x:.2f}" for x in load_end)
        + f" ({os.cpu_count()} logical CPUs; on a shared machine others' work is in it)"
    )
    if commit is not None:
        env.append(
            f"- against: `{args.against}` = {commit[:12]}: each fasttorch variant also run "
            f"with the `fasttorch/` of that commit (rows `F…@{commit[:7]}`), taken with "
            "`git archive` into a temporary directory removed after the run"
        )
    text = render(args, results, device, wall_s, env)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(keep_section(args.out, text))
    _quote_in_readme(args)
    if args.json:
        raw = [{k: v for k, v in b.items() if k != "analysis"} for b in results]
        saved = {"device": device, "wall_s": wall_s, "environment": env, "results": raw}
        args.json.write_text(json.dumps(saved, indent=1))
    print(text)
    print(f"wrote {args.out}")
    return 0


def _quote_in_readme(args: argparse.Namespace) -> None:
    """Rewrite the README's speed table from docs/benchmarks.md (``benchmarks.readme``),
    when this run wrote that document (not another ``--out``) and meant its numbers
    (not ``--smoke``)."""
    if args.smoke or args.out.resolve() != DOC.resolve():
        return
    from benchmarks import readme

    readme.write(DOC)
    print(f"wrote the speed table of {readme.README}")


def _rerender(args: argparse.Namespace) -> int:
    """Rewrite the document from a ``--json`` file: the same tables, nothing run."""
    saved = json.loads(args.from_json.read_text())
    keys = {"device", "wall_s", "environment", "results"}
    if not isinstance(saved, dict) or not keys <= saved.keys():
        raise SystemExit(f"{args.from_json}: not a results file written by --json")
    results = saved["results"]
    for block in results:
        block["analysis"] = analyse(block, tol=args.drift)
    now = datetime.datetime.now(datetime.timezone.utc)
    env = [
        *saved["environment"],  # the run's own date, machine and command
        f"- tables rewritten from its saved results on {now:%Y-%m-%d %H:%M} UTC "
        f"(`--from-json`; nothing was re-run)",
    ]
    text = render(args, results, saved["device"], saved["wall_s"], env)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(keep_section(args.out, text))
    _quote_in_readme(args)
    print(f"wrote {args.out} from {args.from_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
