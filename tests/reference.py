"""The hand-written PyTorch loop every fasttorch step is checked against (docs/design.md).

autocast around the forward; the loss divided by the number of microbatches (or
weighted by each microbatch's share of the window's samples when sizes differ);
``scaler.scale(loss).backward()`` per microbatch; ``scaler.unscale_`` once;
``clip_grad_norm_``; ``scaler.step``; ``scaler.update``; ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LayerNormNet(nn.Module):
    """A small MLP with LayerNorm: the default model of the equivalence tests."""

    def __init__(self, d_in: int = 8, width: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        return self.out(torch.tanh(self.hidden(h)))


class BatchNormNet(nn.Module):
    """A small MLP with BatchNorm, for buffers (running statistics) in the state."""

    def __init__(self, d_in: int = 8, width: int = 16, d_out: int = 4) -> None:
        super().__init__()
        # No bias before BatchNorm: its true gradient is zero, and Adam would turn the
        # rounding noise left in it into lr-sized steps of random sign.
        self.inp = nn.Linear(d_in, width, bias=False)
        self.bn = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


def mse(apply: Callable[..., torch.Tensor], batch: Sequence[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    # In y's dtype: float32 under autocast, float64 in tests/tolerance.py's float64 run.
    return nn.functional.mse_loss(apply(x).to(y.dtype), y)


def batches(n: int, size: int, *, d_in: int = 8, d_out: int = 4, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, d_in, generator=g), torch.randn(size, d_out, generator=g))
        for _ in range(n)
    ]


def reference_run(
    model: nn.Module,
    windows: Iterable[Sequence[Any]],
    *,
    loss_fn: Callable[..., torch.Tensor] = mse,
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    precision: str = "fp32",
    clip: float | None = None,
    weight: Callable[[Any], float] | None = None,
    lr_at: Callable[[int], float] | None = None,
    scaler_kwargs: dict[str, Any] | None = None,
) -> tuple[nn.Module, list[dict[str, float]]]:
    """Train a deep copy of ``model``; each window is the list of its microbatches.

    ``weight(mb)`` gives a microbatch's sample/token count; when given, each
    microbatch's loss is weighted by ``count / window_count`` instead of ``1 / n``.
    """
    model = copy.deepcopy(model)
    model.train()
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **(scaler_kwargs or {}))
    log = []
    for i, window in enumerate(windows):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(i)
        total = sum(weight(mb) for mb in window) if weight else None
        losses = []
        for mb in window:
            with torch.autocast(
                "cpu", dtype=DTYPES.get(precision, torch.float32), enabled=precision != "fp32"
            ):
                loss = loss_fn(model, mb)
            losses.append(loss.detach())
            if weight is not None:
                assert total is not None
                loss = loss * (weight(mb) / total)
            else:
                loss = loss / len(window)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = None
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        log.append(
            {
                "loss": float(sum(losses) / len(losses)),
                "scale": scale,
                "grad_norm": float(norm) if norm is not None else float("nan"),
            }
        )
    return model, log


def assert_params_close(state: Any, model: nn.Module, *, rtol: float, atol: float) -> None:
    """Every parameter within the bound given (``tolerance.EXACT`` or a rule's atol)."""
    ref = dict(model.named_parameters())
    assert set(state.params) == set(ref)
    for name, p in state.params.items():
        torch.testing.assert_close(
            p, ref[name].detach(), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


def assert_buffers_close(state: Any, model: nn.Module, *, atol: float) -> None:
    """Floating buffers within ``atol`` (tests/tolerance.py), integer ones equal."""
    for name, b in model.named_buffers():
        bound = atol if b.is_floating_point() else 0.0
        torch.testing.assert_close(
            state.buffers[name], b, rtol=0, atol=bound, msg=lambda m, name=name: f"{name}: {m}"
        )


# ------------------------------------------------- the torch twin of adam / adamw


def f32(x: float) -> float:
    """``x`` as a float32 hyperparameter tensor of a fasttorch state holds it."""
    return float(torch.tensor(x, dtype=torch.float32))


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """Let torch's ``capturable=True`` Adam run on CPU tensors outside torch.compile.

    torch refuses it with a check of the device type only (made for CUDA graphs; the
    kernels are the device-generic ``_foreach_*`` calls)."""
    module = importlib.import_module("torch.optim.adam")  # torch.optim.adam is a function
    with mock.patch.object(
        module, "_get_capturable_supported_devices", lambda supports_xla=True: ["cpu"]
    ):
        yield


def adam_twin(
    cls: type[torch.optim.Optimizer],
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | None = None,
    fused: bool = False,
) -> Callable[[Any], torch.optim.Optimizer]:
    """``make_opt`` for the torch twin of fasttorch's ``adam``/``adamw``: ``cls`` (Adam
    or AdamW) with ``foreach=True, capturable=True``, a float32 tensor lr and the other
    hyperparameters' float32 values, which fasttorch equals bit for bit given the same
    gradients (docs/optimizers.md). Its ``step`` runs inside :func:`capturable_on_cpu`.
    Its float32 bias corrections differ from the default form's doubles by up to 3.3e-6
    relative in the first steps (beta2 0.999), more than rule 2's bound at a large lr:
    compare fasttorch with it, not with the default form. ``fused``: the twin of an
    opaque ``adam(..., opaque=True)`` in a donated CPU step, ``fused=True`` instead."""
    kw: dict[str, Any] = {"betas": (f32(betas[0]), f32(betas[1])), "eps": f32(eps)}
    if weight_decay is not None:
        kw["weight_decay"] = f32(weight_decay)

    def make(params: Any) -> torch.optim.Optimizer:
        if fused:
            return cls(params, lr=torch.tensor(lr), fused=True, **kw)
        opt = cls(params, lr=torch.tensor(lr), foreach=True, capturable=True, **kw)
        step = opt.step

        def step_on_any_device(*args: Any, **kwargs: Any) -> Any:
            with capturable_on_cpu():
                return step(*args, **kwargs)

        opt.step = step_on_any_device  # type: ignore[method-assign]
        return opt

    return make
