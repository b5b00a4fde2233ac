"""What :func:`~fasttorch.optim.from_torch` knows of each ``torch.optim`` algorithm.

One record per class: its functional form, the state lists that form takes, torch's
fresh per-parameter state, and how the parameter group's entries become the form's
keyword arguments. Torch's ``_init_group`` signatures differ per class, so the fresh
state is written here per algorithm; the bit-for-bit tests against ``torch.optim``
(tests/test_optim_torch.py) check every record.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from fasttorch.optim import _adam_default

__all__ = ["ALGORITHMS", "CONTROL", "REFUSED", "Algorithm"]

# Group entries that are switches of the call, not hyperparameters.
CONTROL = ("foreach", "fused", "capturable", "differentiable")

REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure several times per step, which "
    "a pure (state, batch) step cannot offer; fasttorch computes one gradient per step",
    "SparseAdam": "it updates from sparse gradients (nn.Embedding(sparse=True)), and "
    "fasttorch's gradients are dense; use torch.optim.Adam or AdamW",
}

# A group entry holding two of the functional form's keyword arguments.
_BETAS = (("betas", ("beta1", "beta2")),)

Slots = Callable[[Tensor, Mapping[str, Any], float], dict[str, Tensor]]


@attrs.frozen
class Algorithm:
    """One ``torch.optim`` class as :class:`~fasttorch.optim.TorchOptimizer` runs it.

    Attributes:
        module, function: where its functional form lives (``torch.optim.adam.adam``).
        state_args: the state lists the form takes after ``(params, grads)``, under
            torch's state keys.
        slots: ``(p, group, lr) -> {key: tensor}``, torch's fresh state for ``p``.
        missing_as_none: a state list torch's ``_init_group`` fills with
            ``state.get(key)`` (one ``None`` per parameter) rather than leaving empty.
        pairs: group entries split into two keyword arguments (``betas``).
        fixed: keyword arguments the class passes itself (AdamW's decoupled decay).
        eager_only: why the form cannot be compiled, or ``""``.
        check: raises for a group fasttorch cannot run, or ``None``.
        nan_at_zero_lr: the capturable single-tensor form divides by lr, so at lr 0
            it writes NaN where the moments are 0 (torch's eager form does not):
            ``TorchOptimizer`` keeps the old parameters there. Found for each class
            by tests/test_optim_torch.py's lr-0 test.
        traced: the class's default (non-capturable) form with its host arithmetic in
            tensors, run in a compiled step instead of the capturable form (the same
            arguments, ``lr`` a 0-d tensor), or ``None``.
    """

    module: str
    function: str
    state_args: tuple[str, ...]
    slots: Slots
    missing_as_none: bool = False
    pairs: tuple[tuple[str, tuple[str, str]], ...] = _BETAS
    fixed: tuple[tuple[str, Any], ...] = ()
    eager_only: str = ""
    check: Callable[[Mapping[str, Any]], None] | None = None
    nan_at_zero_lr: bool = False
    traced: Callable[..., None] | None = None

    def kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The group's hyperparameters under the functional form's keyword names."""
        out = {k: v for k, v in group.items() if k not in ("params", "lr", *CONTROL)}
        for key, (first, second) in self.pairs:
            if key in out:
                out[first], out[second] = out.pop(key)
        out.update(self.fixed)
        return out

    def missing(self, n: int) -> list[None]:
        """The list passed for a state key this group keeps no tensor of."""
        return [None] * n if self.missing_as_none else []


def _scalar(value: float, like: Tensor) -> Tensor:
    """A 0-d float32 tensor on ``like``'s device (torch's ``_get_scalar_dtype()``)."""
    return torch.tensor(float(value), dtype=torch.float32, device=like.device)


def _zeros_and_step(
    keys: tuple[str, ...], p: Tensor, group: object, lr: float
) -> dict[str, Tensor]:
    return {**{k: torch.zeros_like(p) for k in keys}, "step": _scalar(0.0, p)}


def _zeros(*keys: str) -> Slots:
    """Zeros like ``p`` under ``keys``, then a 0-d ``step`` (a partial: it pickles)."""
    return functools.partial(_zeros_and_step, keys)


def _adam(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    s = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if group["amsgrad"]:
        s["max_exp_avg_sq"] = torch.zeros_like(p)
    return {**s, "step": _scalar(0.0, p)}


def _sgd(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    return {"momentum_buffer": torch.zeros_like(p)} if group["momentum"] != 0 else {}


def _sgd_check(group: Mapping[str, Any]) -> None:
    if group["momentum"] != 0 and group["dampening"] != 0:
        raise ValueError(
            "from_torch(SGD): momentum with dampening != 0 is not supported: torch "
            "starts the buffer as a copy of the first gradient, a choice made on the "
            f"host (got dampening={group['dampening']!r}). Use "
            "fasttorch.optim.sgd(lr, momentum=..., dampening=...), which matches "
            "torch.optim.SGD there, or dampening=0."
        )


def _rmsprop(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    s = {"square_avg": torch.zeros_like(p)}
    if group["centered"]:
        s["grad_avg"] = torch.zeros_like(p)
    if group["momentum"] > 0:
        s["momentum_buffer"] = torch.zeros_like(p)
    return {**s, "step": _scalar(0.0, p)}


def _adagrad(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    return {"sum": torch.full_like(p, group["initial_accumulator_value"]), "step": _scalar(0.0, p)}


def _nadam(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    z = torch.zeros_like
    return {
        "exp_avg": z(p),
        "exp_avg_sq": z(p),
        "mu_product": _scalar(1.0, p),
        "step": _scalar(0.0, p),
    }


def _asgd(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    z = torch.zeros_like
    return {"ax": z(p), "mu": _scalar(1.0, p), "eta": _scalar(lr, p), "step": _scalar(0.0, p)}


def _rprop(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    return {
        "prev": torch.zeros_like(p),
        "step_size": torch.full_like(p, lr),
        "step": _scalar(0.0, p),
    }


def _adafactor(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    # Torch keeps Adafactor's step on the CPU and reads it with .item() each update.
    cpu_step = torch.tensor(0.0, dtype=torch.float32)
    if p.dim() > 1:
        row = p.new_zeros((*p.shape[:-1], 1))
        col = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
        return {"row_var": row, "col_var": col, "step": cpu_step}
    return {"variance": torch.zeros_like(p), "step": cpu_step}


def _muon(p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    return {"momentum_buffer": torch.zeros_like(p)}


_ADAM_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")

ALGORITHMS: dict[str, Algorithm] = {
    "Adam": Algorithm(
        "torch.optim.adam",
        "adam",
        _ADAM_STATE,
        _adam,
        nan_at_zero_lr=True,
        traced=_adam_default.adam,
    ),
    "AdamW": Algorithm(
        "torch.optim.adam",
        "adam",
        _ADAM_STATE,
        _adam,
        fixed=(("decoupled_weight_decay", True),),
        nan_at_zero_lr=True,
        traced=_adam_default.adam,
    ),
    "SGD": Algorithm("torch.optim.sgd", "sgd", ("momentum_buffer",), _sgd, True, check=_sgd_check),
    "RMSprop": Algorithm(
        "torch.optim.rmsprop",
        "rmsprop",
        ("square_avg", "grad_avg", "momentum_buffer", "step"),
        _rmsprop,
    ),
    "Adagrad": Algorithm("torch.optim.adagrad", "adagrad", ("sum", "step"), _adagrad),
    "Adadelta": Algorithm(
        "torch.optim.adadelta",
        "adadelta",
        ("square_avg", "acc_delta", "step"),
        _zeros("square_avg", "acc_delta"),
    ),
    "Adamax": Algorithm(
        "torch.optim.adamax",
        "adamax",
        ("exp_avg", "exp_inf", "step"),
        _zeros("exp_avg", "exp_inf"),
        traced=_adam_default.adamax,
    ),
    "NAdam": Algorithm(
        "torch.optim.nadam",
        "nadam",
        ("exp_avg", "exp_avg_sq", "mu_product", "step"),
        _nadam,
        traced=_adam_default.nadam,
    ),
    "RAdam": Algorithm(
        "torch.optim.radam",
        "radam",
        ("exp_avg", "exp_avg_sq", "step"),
        _zeros("exp_avg", "exp_avg_sq"),
        traced=_adam_default.radam,
    ),
    "ASGD": Algorithm("torch.optim.asgd", "asgd", ("ax", "mu", "eta", "step"), _asgd),
    "Rprop": Algorithm(
        "torch.optim.rprop",
        "rprop",
        ("prev", "step_size", "step"),
        _rprop,
        pairs=(
            *_BETAS,
            ("etas", ("etaminus", "etaplus")),
            ("step_sizes", ("step_size_min", "step_size_max")),
        ),
    ),
    "Adafactor": Algorithm(
        "torch.optim._adafactor",
        "adafactor",
        ("row_var", "col_var", "variance", "step"),
        _adafactor,
        True,
        pairs=(*_BETAS, ("eps", ("eps1", "eps2"))),
        eager_only="torch's Adafactor reads the step count and parameter norms with "
        ".item() in every update",
    ),
    "Muon": Algorithm("torch.optim._muon", "muon", ("momentum_buffer",), _muon),
}
