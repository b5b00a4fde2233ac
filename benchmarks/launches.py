"""ATen operations per optimizer step: fasttorch's eager step (F0) against the hand loop (B0).

``python -m benchmarks.launches`` counts, in a ``TorchDispatchMode``, the non-view ATen
operations of one optimizer step (a window of 4 microbatches: autocast forward and
backward, clip to norm 1, AdamW) of a GPT with 148 parameter tensors, as GPT-2 has, and
rewrites docs/benchmarks_launches.md. On a GPU each such operation is a kernel launch,
except a ``_foreach_*`` call that CUDA runs one tensor at a time
(benchmarks/foreach_rule.py): the "launches" column counts those once per tensor.

Counts, not times: they are exact and the same on any machine, so a CPU run tells what a
GPU run launches. Rows:

* B0 foreach / B0 fused: the suite's hand loop (benchmarks/variants.py) with
  ``torch.optim.AdamW(foreach=True)`` / ``(fused=True)``; fp16 with ``GradScaler``.
* F0: the suite's F0 (``clip_scaled(grad_accumulate(with_amp(step(loss_fn)), 4), 1.0)``)
  with the kernel choice of a CUDA step (torch's fused AdamW), run here on CPU tensors.
* F0 (CPU choice): the same step as it runs on a CPU (torch's fused CPU kernel, the
  opaque update, the default there).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import variants
from benchmarks.foreach_rule import slow_reason
from benchmarks.models import spec, windows

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks_launches.md"
MODEL = "M3x12"
ROWS = ("B0 foreach", "B0 fused", "F0", "F0 (CPU choice)")


class OpCount(TorchDispatchMode):
    """Non-view ATen operations; ``launches`` counts a CUDA per-tensor foreach N times."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.launches = 0
        self.slow = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # ATen's only: the profiler's record_function markers (GradScaler's) launch nothing
        if not func.is_view and func.namespace == "aten":
            self.ops += 1
            name = func.overloadpacket.__name__
            reason = slow_reason(name, args, kwargs) if name.startswith("_foreach_") else None
            if reason is None:
                self.launches += 1
            else:
                self.slow += 1
                self.launches += max(len(a) for a in args if isinstance(a, (list, tuple)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def fused_kernel_choice(devices: frozenset[str]) -> Iterator[None]:
    """fasttorch's kernel choice as on ``devices`` (``{"cuda", "cpu"}``: a CUDA step's)."""
    from fasttorch.optim import _base

    saved = _base.FUSED_DEVICES
    _base.FUSED_DEVICES = devices
    try:
        yield
    finally:
        _base.FUSED_DEVICES = saved


def count(row: str, precision: str, model: str = MODEL, steps: int = 3) -> dict[str, int]:
    """Ops of the last of ``steps`` steps (the first ones create optimizer state)."""
    device = torch.device("cpu")
    cuda_choice = frozenset({"cuda", "cpu"}) if row == "F0" else frozenset({"cuda"})
    with fused_kernel_choice(cuda_choice):
        if row.startswith("B0"):
            v = variants._stock("B0", model, precision, device, fused=row == "B0 fused")
        else:
            v = variants.make("F0", model, precision, device)
        data = windows(model, device, n=steps)
        for batch in data[:-1]:
            v.step(batch)
        counter = OpCount()
        with counter:
            v.step(data[-1])
    tensors = len(list(v.model.parameters()))
    return {
        "ops": counter.ops,
        "launches": counter.launches,
        "slow": counter.slow,
        "tensors": tensors,
    }


def measure(precisions: tuple[str, ...], model: str = MODEL) -> dict[str, dict[str, Any]]:
    return {p: {row: count(row, p, model) for row in ROWS} for p in precisions}


def render(results: dict[str, dict[str, Any]], model: str = MODEL) -> str:
    title = spec(model, "cpu").title
    lines = [
        "# Operations per optimizer step: fasttorch eager against the hand loop",
        "",
        "Written by `python -m benchmarks.launches` (never edit by hand). Counts, not",
        "times: non-view ATen operations of one optimizer step, counted in a",
        "`TorchDispatchMode`, which on a GPU are kernel launches, except a `_foreach_*`",
        "call that CUDA runs one tensor at a time (its rule: benchmarks/foreach_rule.py),",
        "counted once per tensor under **launches**. The step is the suite's: a window",
        "of 4 microbatches, autocast, clip to norm 1, AdamW (benchmarks/variants.py).",
        f"Model: {title}. F0 uses the kernels a CUDA step chooses (torch's fused AdamW);",
        '"F0 (CPU choice)" is the same step as it runs on a CPU (torch\'s fused CPU kernel,',
        "the opaque update, the default there; `opaque=False`: `_foreach_*` calls).",
        "",
        f"torch {torch.__version__}, {platform.machine()}, {datetime.date.today().isoformat()}.",
        "",
    ]
    for precision, rows in results.items():
        extra = " (+ GradScaler in B0)" if precision == "fp16" else ""
        lines += [
            f"## {precision}{extra}",
            "",
            "| variant | ATen ops | launches on CUDA | per-tensor `_foreach_` calls |",
            "|---|---:|---:|---:|",
        ]
        for row, c in rows.items():
            lines.append(f"| {row} | {c['ops']} | {c['launches']} | {c['slow']} |")
        f0 = rows["F0"]["launches"]
        best = min(rows["B0 foreach"]["launches"], rows["B0 fused"]["launches"])
        verdict = "holds" if f0 <= best else "does NOT hold"
        lines += ["", f"F0 <= B0 (both kernels) in launches: {verdict} ({f0} vs {best}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="bf16,fp16")
    ap.add_argument("--out", type=Path, default=DOC, help="the Markdown file to write")
    ap.add_argument("--model", default=MODEL, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    results = measure(tuple(args.precisions.split(",")), args.model)
    text = render(results, args.model)
    print(text)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
