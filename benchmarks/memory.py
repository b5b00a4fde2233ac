"""Memory of one GPT training step: half precision, low-bit optimizer states, selective
activation checkpointing, float8 (emulated), each beside the hand-written loop.

    python -m benchmarks.memory [--write docs/benchmarks_memory.md] [--tiny]

The model is benchmarks/models.py's GPT at its CPU size (2 layers, width 128, context
64, vocab 256; ``--tiny``: 1 layer, width 64, context 16, vocab 64, for the tests),
trained on next-token cross-entropy. Each variant is a fasttorch step
(``fasttorch.step``, ``with_amp`` for bf16, ``optim.from_torchao`` for the low-bit
states) and the hand-written loop doing the same (autocast, ``loss.backward()``,
``torchao.optim.AdamW8bit(...).step()``, ``zero_grad``), on the same weights and batch.

What is counted, not sampled from the process's RSS:

* optimizer state: the bytes of the state tensors, a quantized state by its inner
  tensors (codes, block scales, quantization map; ``fasttorch.optim.state_bytes``), per
  parameter of the model;
* step peak: the profiler's memory events (CPU allocator, ``profile_memory=True``):
  the peak of bytes allocated during one step above what was live before it (the
  parameters and optimizer state are live before and not counted; activations,
  gradients and temporaries are);
* float8: the bytes the autograd graph saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters apart from activations.

torchao compiles its optimizer kernel per parameter shape with inductor (minutes on a
small CPU, once); ``--tiny`` runs it eagerly on both sides instead
(``torch.compiler.set_stance("force_eager")``), where its temporaries (float32 copies of
each state) count in the step peak.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import fasttorch
from benchmarks.activation_checkpointing import peak_bytes
from benchmarks.models import GPT, loss_fn

OPTIMIZERS = ("AdamW", "AdamW8bit", "AdamW4bit")
PRECISIONS = ("fp32", "bf16")
LR = 1e-3

# torchtitan's op-level selective checkpointing: keep the matrix products' and the
# attention's outputs, recompute the cheap ops (norms, GELU, adds) in the backward.
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class Selective(nn.Module):
    """A block run under ``checkpoint`` with the op-level selective policy."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(
            self.block,
            x,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(_policy),
        )
        return out


@dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    context: int
    vocab: int
    rows: int

    def model(self, selective: bool) -> GPT:
        torch.manual_seed(0)
        m = GPT(self.vocab, self.context, self.layers, self.width, self.heads)
        if selective:
            m.blocks = nn.ModuleList(Selective(b) for b in m.blocks)
        return m

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        seq = torch.randint(0, self.vocab, (self.rows, self.context + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


SIZES = {
    "cpu": Size(layers=2, width=128, heads=4, context=64, vocab=256, rows=16),
    "tiny": Size(layers=1, width=64, heads=2, context=16, vocab=64, rows=2),
}


@dataclass(frozen=True)
class Variant:
    precision: str
    optimizer: str
    selective: bool

    @property
    def name(self) -> str:
        ac = ", selective AC" if self.selective else ""
        return f"{self.precision}, {self.optimizer}{ac}"


def _torchao_class(name: str) -> Any:
    import torchao.optim as ao

    return getattr(ao, name)


def fasttorch_step(v: Variant, model: nn.Module) -> tuple[Callable[[], Any], Any]:
    """One fasttorch step of ``v`` (a closure over its state) and the state."""
    opt: Any = (
        fasttorch.optim.from_torch(torch.optim.AdamW, LR)
        if v.optimizer == "AdamW"
        else fasttorch.optim.from_torchao(_torchao_class(v.optimizer), LR)
    )
    step = fasttorch.step(loss_fn)
    if v.precision == "bf16":
        step = fasttorch.with_amp(step, "bf16")
    holder = {"state": step.init(fasttorch.TrainState.create(model, opt))}

    def run(batch: Any) -> None:
        holder["state"], metrics = step(holder["state"], batch)
        float(metrics["loss"])

    return run, holder


def hand_loop(v: Variant, model: nn.Module) -> tuple[Callable[[], Any], Any]:
    """One step of the hand-written loop of ``v`` and its optimizer."""
    cls = torch.optim.AdamW if v.optimizer == "AdamW" else _torchao_class(v.optimizer)
    opt = cls(model.parameters(), lr=LR)

    def run(batch: Any) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=v.precision == "bf16"):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())

    return run, opt


def measure(v: Variant, size: Size) -> dict[str, Any]:
    """Both sides of ``v``: optimizer-state bytes and the step peak."""
    batch = size.batch()
    model = size.model(v.selective)
    n_params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"n_params": n_params}
    fast, holder = fasttorch_step(v, copy.deepcopy(model))
    hand, opt = hand_loop(v, copy.deepcopy(model))
    for side, run in (("fasttorch", fast), ("hand", hand)):
        run(batch)  # creates the optimizer state
        run(batch)
        out[f"{side}_peak"] = peak_bytes(lambda run=run: run(batch))
    out["fasttorch_state"] = fasttorch.optim.state_bytes(holder["state"].opt_state)
    out["hand_state"] = fasttorch.optim.state_bytes(opt.state)
    return out


def saved_bytes(model: nn.Module, batch: Any) -> dict[str, int]:
    """Bytes the forward saves for backward, parameters and activations apart (each
    storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[bool, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        inner = [t]
        if hasattr(type(t), "__tensor_flatten__"):  # a float8 tensor: its own data
            inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]]
        for x in inner:
            s = x.untyped_storage()
            seen[s.data_ptr()] = (s.data_ptr() in params, s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model, batch)
    loss.backward()
    return {
        "weights": sum(n for is_param, n in seen.values() if is_param),
        "activations": sum(n for is_param, n in seen.values() if not is_param),
    }


def float8_rows(size: Size) -> list[tuple[str, dict[str, int], int]]:
    """The hand loop in fp32 and with torchao's float8 linear layers (emulated)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    batch = size.batch()
    rows = []
    for name in ("fp32", "float8 (tensorwise, emulated)"):
        model = size.model(False)
        if name != "fp32":
            # The tied head (the embedding's weight) stays a plain Linear.
            convert_to_float8_training(
                model,
                config=Float8LinearConfig(emulate=True),
                module_filter_fn=lambda m, fqn: fqn != "head",
            )
        saved = saved_bytes(model, batch)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def run(model: nn.Module = model, opt: Any = opt) -> None:
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        run()
        rows.append((name, saved, peak_bytes(run)))
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(size_name: str) -> str:
    size = SIZES[size_name]
    eager_kernel = size_name == "tiny"
    variants = [Variant(p, o, s) for s in (False, True) for p in PRECISIONS for o in OPTIMIZERS]
    if eager_kernel:  # the tests' run: each option once
        variants = [variants[0], variants[4], variants[8], variants[9]]
    stance = "force_eager" if eager_kernel else "default"
    with torch.compiler.set_stance(stance):
        results = [(v, measure(v, size)) for v in variants]
    n = results[0][1]["n_params"]
    lines = [
        "# Memory of one training step (python -m benchmarks.memory)",
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, torchao "
        f"{_version('torchao')}. GPT ({size.layers} layer(s), width {size.width}, "
        f"{size.heads} heads, context {size.context}, vocab {size.vocab}; "
        f"{n / 1e6:.2f}M parameters), {size.rows} sequences a step, eager, one thread.",
        "",
        "Optimizer state: bytes of the state tensors (a quantized state by its codes, "
        "block scales and quantization map). Step peak: the profiler's CPU allocator "
        "peak during one step above what was live before it (activations, gradients, "
        "temporaries; not the parameters or the optimizer state). torchao keeps "
        "tensors of fewer than 4096 values (biases, norms) in float32. Its optimizer "
        "kernel runs "
        + (
            'eagerly here on both sides (`torch.compiler.set_stance("force_eager")`): '
            "its float32 temporaries count in the peak."
            if eager_kernel
            else "compiled by inductor, as torchao compiles it, on both sides."
        ),
        "",
        "| variant | state bytes/param | state (MiB) | step peak, fasttorch (MiB) "
        "| step peak, hand loop (MiB) | params + state + peak, fasttorch (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    param_bytes = 4 * n
    for v, r in results:
        assert r["fasttorch_state"] == r["hand_state"] or v.optimizer == "AdamW", r
        lines.append(
            f"| {v.name} | {r['fasttorch_state'] / n:.2f} | {_mib(r['fasttorch_state'])} | "
            f"{_mib(r['fasttorch_peak'])} | {_mib(r['hand_peak'])} | "
            f"{_mib(param_bytes + r['fasttorch_state'] + r['fasttorch_peak'])} |"
        )
    lines += [
        "",
        "fasttorch's AdamW state here is `from_torch(torch.optim.AdamW)`'s, torch's own "
        "keys (two moments and a step count per tensor), as the hand loop's.",
        "",
        "## float8 linear layers (hand loop, emulated)",
        "",
    ]
    if importlib.util.find_spec("torchao.float8") is None:
        lines.append("torchao's float8 is not installed here; nothing measured.")
    else:
        lines += [
            "torchao's `convert_to_float8_training(model, config=Float8LinearConfig("
            "emulate=True))` (every Linear but the tied head), fp32 master weights, "
            "torch.optim.AdamW. Saved for backward: the bytes the forward keeps for the "
            "backward (`saved_tensors_hooks`, each storage once), weights apart.",
            "",
            "| hand loop | saved activations (MiB) | saved weights (MiB) | step peak (MiB) |",
            "| --- | --- | --- | --- |",
        ]
        for name, saved, peak in float8_rows(size):
            lines.append(
                f"| {name} | {_mib(saved['activations'])} | {_mib(saved['weights'])} | "
                f"{_mib(peak)} |"
            )
    lines += [
        "",
        "## CPU offload",
        "",
        "torchao's `CPUOffloadOptimizer` (and `fasttorch.optim.cpu_offload`) keeps the "
        "optimizer state and its update in host memory while the model trains on a "
        "CUDA (or XPU) device: the device holds no optimizer state. It needs such a "
        "device; on this CPU-only machine there is nothing to offload from, so it is "
        "not measured here.",
        "",
    ]
    return "\n".join(lines)


def _version(name: str) -> str:
    try:
        return str(importlib.import_module(name).__version__)
    except (ImportError, AttributeError):
        return "not installed"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", default=None, help="write the markdown table to this file")
    p.add_argument("--tiny", action="store_true", help="a tiny model (for the tests)")
    args = p.parse_args()
    torch.set_num_threads(1)
    text = report("tiny" if args.tiny else "cpu")
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
