"""The training steps under test: one optimizer step over one window of ``ACCUM`` microbatches.

Every variant does the same work: autocast (bf16, or fp16 with a loss scale), the mean
cross-entropy over the window's microbatches, gradient clipping to a global norm of 1,
and one AdamW update (lr 1e-3, weight decay 0.01). Each returns the window's mean loss
as a tensor and never reads it back: the worker reads it once, after step 50.

* B0: the hand-written eager loop (``torch.optim.AdamW``, foreach on CPU, fused on GPU).
* B1: B0 with ``torch.compile(model)``.
* B2: B1 with the post-backward work (unscale, ``clip_grad_norm_``, ``opt.step()``) in a
  ``torch.compile``-d function, as the "compiling the optimizer" tutorial does.
* B3: B1 with ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs; GPU only),
  with ``torch.compiler.cudagraph_mark_step_begin()`` before each microbatch's forward:
  without it the next microbatch's replay overwrites the outputs the previous backward
  still reads (what the CUDA graph guide prescribes for a forward run several times
  per optimizer step).
* B4: Lightning Fabric (``precision="bf16-mixed"``, ``torch.compile`` then
  ``fabric.setup``, ``no_backward_sync``, ``fabric.backward``, ``fabric.clip_gradients``).
* B5: Hugging Face Accelerate (``Accelerator(mixed_precision=..., gradient_accumulation_steps=4,
  dynamo_backend="inductor")``, ``accelerator.accumulate``, ``accelerator.clip_grad_norm_``).
* F0: ``clip_scaled(grad_accumulate(with_amp(step(loss_fn), prec), 4), 1.0)``.
* F1: ``compiled(F0)``.
* F2: ``compiled(F0, mode="reduce-overhead")`` (CUDA graphs; GPU only).
* F0T / F1T: F0 / F1 with ``fasttorch.optim.from_torch(torch.optim.AdamW, ...)``,
  torch's own AdamW kernels (F0T ``fused=True``; F1T torch's capturable kernel, traced,
  since torch does not let a compiler trace its fused one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.models import ACCUM, build, loss_fn

__all__ = ["GPU_ONLY", "LR", "VARIANTS", "WEIGHT_DECAY", "Variant", "make"]

LR = 1e-3
WEIGHT_DECAY = 0.01
MAX_NORM = 1.0

VARIANTS: dict[str, str] = {
    "B0": "eager loop (autocast, accumulate, clip_grad_norm_, AdamW)",
    "B1": "B0 + torch.compile(model)",
    "B2": "B1 + compiled unscale/clip/optimizer step",
    "B3": 'B1 with mode="reduce-overhead"',
    "B4": "Lightning Fabric (+ torch.compile(model))",
    "B5": "Accelerate (+ dynamo_backend=inductor)",
    "F0": "fasttorch, eager",
    "F1": "fasttorch, compiled",
    "F2": 'fasttorch, compiled mode="reduce-overhead"',
    "F0T": "fasttorch, eager, torch's fused AdamW (from_torch)",
    "F1T": "fasttorch, compiled, torch's AdamW kernel (from_torch)",
}
GPU_ONLY = frozenset({"B3", "F2"})
STOCK = ("B1", "B2", "B3")  # "the best stock option" is the fastest of these
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Variant:
    """A ready-to-run variant: ``step(window)`` trains one window and returns its loss."""

    step: Callable[[Batch], torch.Tensor]
    model: torch.nn.Module
    note: str = ""


def _dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype; ``None`` for "fp32" (a diagnostic precision, autocast off)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def _adamw(
    model: torch.nn.Module, device: torch.device, fused: bool | None = None
) -> torch.optim.Optimizer:
    """torch's AdamW: fused on a GPU and foreach elsewhere, unless ``fused`` says."""
    if fused is None:
        fused = device.type == "cuda"
    kind: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kind)


def _micro(batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batch
    return list(zip(x.tensor_split(ACCUM), y.tensor_split(ACCUM)))


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _stock(
    name: str, model_name: str, precision: str, device: torch.device, fused: bool | None = None
) -> Variant:
    """B0-B3: the loop from the AMP and accumulation guides, more or less compiled.

    ``fused``: AdamW's kernel (default: fused on a GPU, foreach elsewhere)."""
    model = build(model_name, device)
    opt = _adamw(model, device, fused)
    dtype = _dtype(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    forward: Callable[..., torch.Tensor] = model
    if name in ("B1", "B2"):
        forward = torch.compile(model)
    elif name == "B3":
        forward = torch.compile(model, mode="reduce-overhead")

    def post_backward() -> None:
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    finish = torch.compile(post_backward) if name == "B2" else post_backward

    def step(batch: Batch) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for x, y in _micro(batch):
            if name == "B3":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = _ce(forward(x), y) / ACCUM
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach()
        finish()
        opt.zero_grad(set_to_none=True)
        return total

    return Variant(step, model)


def _fabric(model_name: str, precision: str, device: torch.device) -> Variant:
    """B4, as Fabric's docs show: compile, setup, no_backward_sync, backward, clip."""
    from lightning.fabric import Fabric

    fabric = Fabric(
        accelerator="cuda" if device.type == "cuda" else "cpu",
        devices=1,
        precision={"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}[precision],
    )
    model = build(model_name, device)
    opt = _adamw(model, device)
    fmodel, fopt = fabric.setup(torch.compile(model), opt)

    def step(batch: Batch) -> torch.Tensor:
        total = torch.zeros((), device=device)
        parts = _micro(batch)
        for i, (x, y) in enumerate(parts):
            with fabric.no_backward_sync(fmodel, enabled=i < len(parts) - 1):
                loss = _ce(fmodel(x), y) / ACCUM
                fabric.backward(loss)
            total += loss.detach()
        fabric.clip_gradients(fmodel, fopt, max_norm=MAX_NORM)
        fopt.step()
        fopt.zero_grad(set_to_none=True)
        return total

    return Variant(step, model)


def _accelerate(model_name: str, precision: str, device: torch.device) -> Variant:
    """B5, as Accelerate's docs show: accumulate(), backward(), clip_grad_norm_ on sync."""
    from accelerate import Accelerator

    acc = Accelerator(
        mixed_precision="no" if precision == "fp32" else precision,
        gradient_accumulation_steps=ACCUM,
        cpu=device.type == "cpu",
        dynamo_backend="inductor",
    )
    model = build(model_name, device)
    opt = _adamw(model, device)
    amodel, aopt = acc.prepare(model, opt)

    def step(batch: Batch) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for x, y in _micro(batch):
            with acc.accumulate(amodel):
                loss = _ce(amodel(x), y)
                acc.backward(loss)  # divides by gradient_accumulation_steps
                if acc.sync_gradients:
                    acc.clip_grad_norm_(amodel.parameters(), MAX_NORM)
                aopt.step()  # a no-op until the window's last microbatch
                aopt.zero_grad(set_to_none=True)
            total += loss.detach() / ACCUM
        return total

    return Variant(step, model)


def _fasttorch(name: str, model_name: str, precision: str, device: torch.device) -> Variant:
    import fasttorch

    model = build(model_name, device)
    if name in ("F0T", "F1T"):
        fused = {"fused": True} if name == "F0T" else {}
        opt: Any = fasttorch.optim.from_torch(
            torch.optim.AdamW, LR, weight_decay=WEIGHT_DECAY, **fused
        )
    else:
        opt = fasttorch.optim.adamw(LR, weight_decay=WEIGHT_DECAY)
    state = fasttorch.TrainState.create(model, opt)
    base = fasttorch.step(loss_fn)
    if precision != "fp32":
        base = fasttorch.with_amp(base, precision)
    s = fasttorch.clip_scaled(fasttorch.grad_accumulate(base, ACCUM), MAX_NORM)
    if name in ("F1", "F1T"):
        s = fasttorch.compiled(s)
    elif name == "F2":
        s = fasttorch.compiled(s, mode="reduce-overhead")
    box = {"state": s.init(state)}

    def step(batch: Batch) -> torch.Tensor:
        box["state"], metrics = s(box["state"], batch)
        loss: torch.Tensor = metrics["loss"]
        return loss

    return Variant(step, model)


def make(name: str, model_name: str, precision: str, device: torch.device) -> Variant:
    """Build variant ``name`` for ``model_name`` at ``precision`` ("bf16", "fp16", "fp32").

    "fp32" (autocast off) is not part of the suite's tables; it is there to show how
    much of a CPU step is bf16 matrix products on CPUs without native bf16 units.
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    if name in GPU_ONLY and device.type != "cuda":
        raise ValueError(f"{name} uses CUDA graphs and needs a GPU")
    if name in ("B0", "B1", "B2", "B3"):
        return _stock(name, model_name, precision, device)
    if name == "B4":
        return _fabric(model_name, precision, device)
    if name == "B5":
        return _accelerate(model_name, precision, device)
    return _fasttorch(name, model_name, precision, device)
