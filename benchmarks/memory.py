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
* float8: the bytes the autograd graph saves for backward during one step
  (``torch.autograd.graph.saved_tensors_hooks``), parameters apart from activations,
  for fasttorch's float8 step (``float8.convert`` + ``with_float8``) and torchao's hand
  loop (``convert_to_float8_training``), each recipe alone and combined with bf16
  autocast, AdamW8bit and selective activation checkpointing.

torchao compiles its optimizer kernel per parameter shape with inductor (minutes on a
small CPU, once); ``--tiny`` runs it eagerly on both sides instead
(``torch.compiler.set_stance("force_eager")``), where its temporaries (float32 copies of
each state) count in the step peak.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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


def fasttorch_step(
    v: Variant, model: nn.Module, *, float8: bool = False
) -> tuple[Callable[[], Any], Any]:
    """One fasttorch step of ``v`` (a closure over its state) and the state;
    ``float8``: the step wrapped in ``with_float8`` (a model already converted)."""
    opt: Any = (
        fasttorch.optim.from_torch(torch.optim.AdamW, LR)
        if v.optimizer == "AdamW"
        else fasttorch.optim.from_torchao(_torchao_class(v.optimizer), LR)
    )
    step = fasttorch.step(loss_fn)
    if v.precision == "bf16":
        step = fasttorch.with_amp(step, "bf16")
    if float8:
        from fasttorch.float8 import with_float8

        step = with_float8(step)
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


def saved_bytes(run: Callable[[], Any], params: list[torch.Tensor]) -> dict[str, int]:
    """Bytes the autograd graph saves for backward during ``run()`` (one step), the
    storages of ``params`` apart from the rest (each storage once)."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, tuple[bool, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        inner = [t]
        if hasattr(type(t), "__tensor_flatten__"):  # a float8 tensor: its own data
            inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]]
        for x in inner:
            s = x.untyped_storage()
            seen[s.data_ptr()] = (s.data_ptr() in weights, s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return {
        "weights": sum(n for is_param, n in seen.values() if is_param),
        "activations": sum(n for is_param, n in seen.values() if not is_param),
    }


@dataclass(frozen=True)
class Float8Variant:
    """A float8 recipe (``None``: no float8) and what it is combined with."""

    recipe: str | None
    precision: str = "fp32"
    optimizer: str = "AdamW"
    selective: bool = False

    @property
    def name(self) -> str:
        parts = [f"float8 ({self.recipe}, emulated)" if self.recipe else "no float8"]
        parts += [self.precision] if self.precision != "fp32" else []
        parts += [self.optimizer] if self.optimizer != "AdamW" else []
        parts += ["selective AC"] if self.selective else []
        return ", ".join(parts)

    @property
    def base(self) -> Variant:
        return Variant(self.precision, self.optimizer, self.selective)


FLOAT8 = (
    Float8Variant(None),
    Float8Variant("tensorwise"),
    Float8Variant("rowwise"),
    Float8Variant(None, precision="bf16"),
    Float8Variant("tensorwise", precision="bf16"),
    Float8Variant("tensorwise", optimizer="AdamW8bit"),
    Float8Variant(None, selective=True),
    Float8Variant("tensorwise", selective=True),
    Float8Variant("tensorwise", "bf16", "AdamW8bit", selective=True),
)

# The tied head (the embedding's weight) stays a plain Linear, on both sides.
_HEAD = "head"


def float8_fasttorch(v: Float8Variant, model: nn.Module) -> tuple[Callable[[], Any], Any]:
    """fasttorch's float8 step: ``float8.convert`` before ``TrainState.create``, the
    step wrapped in ``with_float8`` (outside ``with_amp``)."""
    from fasttorch import float8

    if v.recipe is not None:
        float8.convert(model, v.recipe, filter_fqns=(_HEAD,), emulate=True)  # type: ignore[arg-type]
    run, holder = fasttorch_step(v.base, model, float8=v.recipe is not None)
    return run, holder


def float8_hand(v: Float8Variant, model: nn.Module) -> tuple[Callable[[], Any], Any]:
    """torchao's hand loop: ``convert_to_float8_training`` with the recipe's config
    (emulated), then the loop of ``v``'s precision and optimizer."""
    if v.recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(v.recipe)
        convert_to_float8_training(
            model,
            config=dataclasses.replace(config, emulate=True),
            module_filter_fn=lambda m, fqn: fqn != _HEAD,
        )
    return hand_loop(v.base, model)


def measure_float8(v: Float8Variant, size: Size) -> dict[str, Any]:
    """Both sides of ``v``: saved-for-backward bytes (weights, activations), step peak."""
    batch = size.batch()
    model = size.model(v.selective)
    out: dict[str, Any] = {}
    fast, holder = float8_fasttorch(v, copy.deepcopy(model))
    hand_model = copy.deepcopy(model)
    hand, _ = float8_hand(v, hand_model)
    for side, run in (("fasttorch", fast), ("hand", hand)):
        run(batch)  # creates the optimizer state
        if side == "fasttorch":
            state = holder["state"]
            params = [*state.params.values(), *state.module.parameters()]
        else:
            params = list(hand_model.parameters())
        out[f"{side}_saved"] = saved_bytes(lambda run=run: run(batch), params)
        out[f"{side}_peak"] = peak_bytes(lambda run=run: run(batch))
    return out


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
        "## float8 linear layers (emulated), alone and combined",
        "",
    ]
    if importlib.util.find_spec("torchao.float8") is None:
        lines.append("torchao's float8 is not installed here; nothing measured.")
    else:
        lines += _float8_table(size, eager_kernel)
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


def _float8_table(size: Size, eager_kernel: bool) -> list[str]:
    variants = FLOAT8 if not eager_kernel else (FLOAT8[0], FLOAT8[1], FLOAT8[-1])
    with torch.compiler.set_stance("force_eager" if eager_kernel else "default"):
        results = [(v, measure_float8(v, size)) for v in variants]
    lines = [
        "fasttorch: `fasttorch.float8.convert(model, recipe, emulate=True, "
        'filter_fqns=("head",))` before `TrainState.create`, the step wrapped in '
        "`with_float8` (outside `with_amp` for bf16). Hand loop: torchao's "
        "`convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("
        "recipe) with emulate=True)`, then the loop of the first table (autocast, "
        "torch.optim.AdamW or torchao's AdamW8bit, the selective policy). Every Linear "
        "but the tied head is converted; the master weights stay float32. Saved: the "
        "bytes the autograd graph keeps for the backward during one step "
        "(`saved_tensors_hooks`, each storage once; a float8 tensor by its data and "
        "scale), the parameters' own storages apart as weights. Under selective AC the "
        "checkpointed blocks keep their saved tensors in `checkpoint`'s own store, "
        "out of these hooks' sight: their saved columns count only what the forward "
        "keeps outside the blocks, and the step peak shows the rest. Under bf16 autocast "
        "the weights are saved as bf16 copies, which count as activations. torchao's "
        "Float8Linear saves its input and weight in high precision and casts them to "
        "float8 again in the backward, so float8 saves what the same model saves "
        "without it; its casts' temporaries show in the step peak.",
        "",
        "| variant | saved activations, fasttorch (MiB) | saved activations, hand loop "
        "(MiB) | saved weights, fasttorch (MiB) | saved weights, hand loop (MiB) "
        "| step peak, fasttorch (MiB) | step peak, hand loop (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v, r in results:
        f, h = r["fasttorch_saved"], r["hand_saved"]
        lines.append(
            f"| {v.name} | {_mib(f['activations'])} | {_mib(h['activations'])} | "
            f"{_mib(f['weights'])} | {_mib(h['weights'])} | {_mib(r['fasttorch_peak'])} | "
            f"{_mib(r['hand_peak'])} |"
        )
    return lines


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
