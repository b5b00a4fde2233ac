"""One variant of one model in a fresh process; prints one JSON line with what it measured.

``python -m benchmarks.worker --model M1 --variant F1 [--blocks 5 --steps 100 ...]``

In order, in this process:

1. import everything the variant needs, then record the baseline RSS;
2. build the model (seeded weights) and the variant; time the first step, which
   compiles (``compile_s`` = first step minus a median step);
3. untimed warm-up up to ``max(warmup + 1, loss_at)`` steps; after step ``loss_at``
   (50) read the loss, the only read of a metric before the timed region;
4. ``blocks`` timed blocks of ``steps`` steps (the device is synchronized at block
   ends; nothing is read from the device inside a block); peak RSS over them
   (``VmHWM`` after resetting it through ``/proc/self/clear_refs``), and on a GPU
   ``torch.cuda.max_memory_allocated``. With ``--serve`` the process prints
   ``@@READY@@`` and then runs one block per ``block`` line on its standard input,
   answering ``@@BLOCK@@ seconds``, until ``done``: ``run.py`` uses this to interleave
   the blocks of all variants, so a change in the machine's speed hits them alike;
5. with ``--profile``, a few more steps under ``torch.profiler``: host syncs per step
   (``aten::_local_scalar_dense`` events) and the peak of tensor bytes allocated
   within those steps (the profiler's memory events).

The compile cache is ``TORCHINDUCTOR_CACHE_DIR``, set by the caller (``run.py`` gives a
fresh directory for a cold compile, and the same one again for a warm one). In a fresh
directory inductor first compiles small probe programs to learn which vector
instruction sets the C++ compiler supports, once per directory; on a CPU, for the
variants that compile, the worker times that probe where it runs (``isa_probe_s``):
inside the first step, in line before the first kernel for ``torch.compile``, in a
thread beside tracing for fasttorch's ``compiled``. ``compile_s`` includes it either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["main", "measure"]


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _profile(run: Callable[[int], Any], n: int, device: torch.device) -> dict[str, Any]:
    """Host syncs per step and peak transient tensor bytes over ``n`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts, profile_memory=True) as prof:
        run(n)
    syncs = sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense")
    # The share of host time in the kernels a compiler calls rather than generates
    # (matrix products, convolutions, attention): compiling cannot shrink it, so
    # 1 / (that share of B0) bounds any compiled variant's speed-up over B0.
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total_us = sum(self_us.values())
    extern_us = sum(t for k, t in self_us.items() if _is_extern(k))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    want = 0 if device.type == "cpu" else 1  # c10 DeviceType: CPU 0, CUDA 1
    totals = [
        int(e["args"]["Total Allocated"])
        for e in events
        if e.get("name") == "[memory]" and int(e["args"].get("Device Type", -1)) == want
    ]
    peak = (max(totals) - min(0, *totals)) if totals else 0
    return {
        "syncs_per_step": syncs / n,
        "profiled_steps": n,
        "step_peak_alloc_bytes": peak,
        "extern_share": extern_us / total_us if total_us else None,
    }


EAGER = ("B0", "F0")  # the variants that compile nothing
READY, BLOCK = "@@READY@@", "@@BLOCK@@ "
EXTERN = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn", "conv")


def _is_extern(name: str) -> bool:
    """Matrix-product, convolution and attention kernels, by profiler event name."""
    return name.startswith(EXTERN) or "scaled_dot_product" in name or "convolution" in name


def _time_isa_probe() -> list[float]:
    """Time inductor's vector-ISA probe where it runs; the list gets its seconds.

    Wraps ``cpu_vec_isa.valid_vec_isa_list`` (the probe, cached for the process): the
    first call's duration, in whichever thread makes it (inductor's code generation,
    or the thread fasttorch's ``compiled`` starts it in beside tracing).
    """
    from torch._inductor import cpu_vec_isa

    probe = cpu_vec_isa.valid_vec_isa_list
    times: list[float] = []
    calls: list[None] = []

    def timed() -> Any:
        first = not calls  # the call that started first does the probe's work
        calls.append(None)
        t0 = time.perf_counter()
        out = probe()
        if first:
            times.append(time.perf_counter() - t0)
        return out

    cpu_vec_isa.valid_vec_isa_list = timed  # type: ignore[assignment]
    return times


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the variant and return what was measured (see the module docstring)."""
    from benchmarks import models, variants

    device = torch.device(args.device)
    if args.variant in ("B4",):
        import lightning.fabric  # noqa: F401
    if args.variant in ("B5",):
        import accelerate  # noqa: F401
    import importlib

    importlib.import_module("torch._inductor.compile_fx")  # same import footprint everywhere
    fasttorch_file = importlib.import_module("fasttorch").__file__  # which tree (--against)

    sync = _sync(device)
    rss_base_kb = _proc_status_kb("VmRSS")
    data = models.windows(args.model, device)
    v = variants.make(args.variant, args.model, args.precision, device)
    n_params = sum(p.numel() for p in v.model.parameters())
    done = 0
    last: torch.Tensor | None = None

    def run(n: int) -> None:
        nonlocal done, last
        for _ in range(n):
            last = v.step(data[done % len(data)])
            done += 1

    probe_times = _time_isa_probe() if device.type == "cpu" and args.variant not in EAGER else []
    sync()
    t0 = time.perf_counter()
    run(1)
    sync()
    first_s = time.perf_counter() - t0
    if device.type == "cuda":
        first_peak = torch.cuda.max_memory_allocated()
    warm_to = max(args.warmup + 1, args.loss_at)
    loss_at: float | None = None
    if args.loss_at <= 1:
        assert last is not None
        loss_at = float(last)
    while done < warm_to:
        run(1)
        if done == args.loss_at:
            assert last is not None
            loss_at = float(last)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss_before_kb = _proc_status_kb("VmRSS")
    hwm_reset = _reset_peak_rss()
    blocks: list[float] = []

    def block() -> float:
        t0 = time.perf_counter()
        run(args.steps)
        sync()
        blocks.append(time.perf_counter() - t0)
        return blocks[-1]

    if args.serve:
        print(READY, flush=True)
        for line in sys.stdin:
            if line.strip() == "block":
                print(f"{BLOCK}{block():.6f}", flush=True)
            elif line.strip() == "done":
                break
            else:
                raise ValueError(f"--serve: unknown command {line.strip()!r}")
    else:
        for _ in range(args.blocks):
            block()
    out: dict[str, Any] = {
        "model": args.model,
        "variant": args.variant,
        "precision": args.precision,
        "device": str(device),
        "n_params": n_params,
        "first_step_s": first_s,
        "isa_probe_s": probe_times[0] if probe_times else 0.0,
        "blocks_s": blocks,
        "steps_per_block": args.steps,
        "warmup_steps": warm_to - 1,
        "loss_at": args.loss_at,
        "loss": loss_at,
        "rss_base_mb": (rss_base_kb or 0) / 1024,
        "rss_before_timed_mb": (rss_before_kb or 0) / 1024,
        "peak_rss_timed_mb": ((_proc_status_kb("VmHWM") or 0) / 1024) if hwm_reset else None,
        "threads": torch.get_num_threads(),
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "fasttorch_file": fasttorch_file,
    }
    if blocks:
        median_step = statistics.median(blocks) / args.steps
        out["compile_s"] = max(first_s - median_step, 0.0)
    if device.type == "cuda":
        out["peak_cuda_alloc_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["first_step_peak_cuda_alloc_mb"] = first_peak / 2**20
    if args.profile:
        sync()
        out.update(_profile(lambda n: (run(n), sync()), args.profile_steps, device))
    if args.matmul_peak and device.type == "cuda":
        out["bf16_matmul_tflops"] = matmul_peak_tflops(device)
    return out


def matmul_peak_tflops(device: torch.device, n: int = 8192, reps: int = 50) -> float:
    """The measured bf16 matmul rate (TFLOP/s): median of CUDA-event-timed products."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, choices=["M1", "M2", "M3", "M4"])
    p.add_argument("--variant", required=True)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps after the first")
    p.add_argument("--loss-at", type=int, default=50, help="read the loss after this step")
    p.add_argument("--profile", action="store_true", help="count host syncs and memory")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--matmul-peak", action="store_true", help="also measure bf16 matmul peak")
    p.add_argument(
        "--serve",
        action="store_true",
        help="after the warm-up, run one timed block per 'block' line on stdin until 'done'",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        out = measure(args)
    except Exception as e:  # report, don't crash the suite
        out = {
            "model": args.model,
            "variant": args.variant,
            "precision": args.precision,
            "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
            "traceback": traceback.format_exc()[-4000:],
        }
    print("@@RESULT@@ " + json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
