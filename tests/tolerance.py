"""Bounds for numerical comparisons, each from a stated rule (tests/README.md).

Four rules, in order of preference:

1. ``EXACT``: the two sides run the same sequence of operations on the same inputs, so
   they agree bit for bit on any machine.
2. ``fp32_reference_error``: the two sides compute the same mathematics in a different
   order (microbatch weights that are not powers of two, a sum split across ranks). The
   bound is ``FACTOR`` times the hand-written fp32 loop's own error against the same
   loop run in float64: measured on the machine running the test, it scales with that
   machine's rounding, whatever its vector width or kernel choice.
3. ``sum_bound``: one reduction of ``n`` terms, where no reference run exists. Higham's
   bound for recursive summation (Accuracy and Stability of Numerical Algorithms, 2nd
   ed., eq. 4.4): ``|error| <= gamma(n-1) * sum(|x_i|)`` with
   ``gamma(k) = k*u / (1 - k*u)`` and ``u = eps/2`` the unit roundoff of the dtype.
   ``split_mean_atol``: one mean summed whole and as weighted parts.
4. ``half_roundoff``: both sides run the same autocast forward, so they round alike
   except where rule 2's fp32 difference flips one rounding to bf16/fp16. A flip moves a
   quantity by one unit roundoff ``u`` of the half dtype relative to itself: a gradient
   norm by ``u``, a squared-error loss by ``2u``, and a normalized (Adam) update, at most
   ``lr`` in size, by ``lr*u`` per step. These add to rule 2's fp32 bound
   (``params_atol``, ``loss_atol``, ``grad_norm_rtol`` with ``precision=``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from reference import DTYPES, mse, reference_run
from torch import nn

EXACT: dict[str, float] = {"rtol": 0.0, "atol": 0.0}

# Two fp32 computations of the same mathematics, each within ``e`` of the exact result
# (estimated by float64), differ by at most ``2e``. A different but equally long order of
# operations has an error of the same size, not the same value: one run's error can be
# the other's doubled without anything being wrong, hence 2 x 2.
FACTOR = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's ``gamma(k) = k*u / (1 - k*u)``: relative error of k chained roundings."""
    ku = k * unit_roundoff(dtype)
    if ku >= 1:
        raise ValueError(f"gamma({k}) is unbounded in {dtype}: k*u = {ku} >= 1")
    return ku / (1 - ku)


def sum_bound(terms: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """Absolute error bound of summing ``terms`` in ``dtype`` in any order."""
    n = terms.numel()
    return gamma(max(n - 1, 1), dtype) * float(terms.double().abs().sum())


def split_mean_atol(terms: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """Rule 3 for a mean computed whole and as a weighted mean of parts: each order is
    within ``sum_bound(terms)`` of the exact sum, and the weighting (a product, a sum, a
    division) rounds three more times: ``2 sum_bound + gamma(3) |mean|``. ``terms`` are
    the summands already divided by the count, so that they sum to the mean."""
    mean = abs(float(terms.double().sum()))
    return 2 * sum_bound(terms, dtype) + gamma(3, dtype) * mean


def _to64(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, (list, tuple)):
        return type(x)(_to64(v) for v in x)
    return x


@dataclass(frozen=True)
class LoopError:
    """How far the fp32 hand-written loop lands from the same loop run in float64."""

    params: dict[str, float]  # per parameter: max |p32 - p64|
    buffers: dict[str, float]  # per floating buffer (BatchNorm statistics): max |b32 - b64|
    loss: float  # max over steps of |loss32 - loss64|
    grad_norm: float  # max over clipped steps of |n32 - n64| / n64 (0 without clip)


def reference_error(
    model: nn.Module,
    windows: Sequence[Sequence[Any]],
    *,
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[..., torch.Tensor] = mse,
    **kwargs: Any,
) -> LoopError:
    """Run ``tests/reference.reference_run`` on ``model`` and ``windows`` in float32 and
    in float64 (a deep copy of the model and the batches converted) and measure the
    float32 run's error. ``kwargs`` go to both runs (``clip``, ``weight``, ``lr_at``;
    no ``precision``: rule 2 is about the fp32 loop). ``loss_fn`` must keep its input's
    dtype (it gets float64 batches in the second run)."""
    ref32, log32 = reference_run(model, windows, make_opt=make_opt, loss_fn=loss_fn, **kwargs)
    ref64, log64 = reference_run(
        copy.deepcopy(model).double(),
        [_to64(list(w)) for w in windows],
        make_opt=make_opt,
        loss_fn=loss_fn,
        **kwargs,
    )

    def err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
        return {
            k: float((v.detach().double() - b[k].detach()).abs().max())
            for k, v in a.items()
            if v.is_floating_point()
        }

    norms = [
        abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
        for a, b in zip(log32, log64)
        if math.isfinite(b["grad_norm"]) and b["grad_norm"] > 0
    ]
    return LoopError(
        params=err(dict(ref32.named_parameters()), dict(ref64.named_parameters())),
        buffers=err(dict(ref32.named_buffers()), dict(ref64.named_buffers())),
        loss=max(abs(a["loss"] - b["loss"]) for a, b in zip(log32, log64)),
        grad_norm=max(norms, default=0.0),
    )


def fp32_reference_error(
    model: nn.Module,
    windows: Sequence[Sequence[Any]],
    *,
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[..., torch.Tensor] = mse,
    **kwargs: Any,
) -> dict[str, float]:
    """Each parameter's largest absolute error of the fp32 hand-written loop
    (``reference_error(...).params``)."""
    return reference_error(model, windows, make_opt=make_opt, loss_fn=loss_fn, **kwargs).params


def half_roundoff(precision: str) -> float:
    """Rule 4's ``u``: the unit roundoff of the autocast dtype ``"bf16"``/``"fp16"``, 0
    for ``"fp32"``."""
    dtype = DTYPES.get(precision)
    return 0.0 if dtype is None else unit_roundoff(dtype)


def params_atol(
    errors: dict[str, float],
    params: dict[str, torch.Tensor],
    *,
    precision: str = "fp32",
    steps: int = 0,
    lr: float = 0.0,
    roundings: int = 1,
    half_roundings: int = 1,
) -> float:
    """One absolute bound for every parameter (or every buffer): ``FACTOR`` x the
    largest fp32 error, plus rule 4's ``steps * lr * u`` for a half-precision forward.

    One bound over all parameters, not one per tensor: a tensor whose true update is
    zero (a bias before a normalization) has no meaningful error of its own. The
    floor is ``gamma(roundings)`` of the largest entry (one rounding unless told), so an
    error that happened to be 0 does not demand bitwise agreement of two different
    orders of operations. ``half_roundings``: how many half-precision roundings of the
    chain may differ rather than flip (1: the same autocast kernels on both sides).
    """
    largest = max(float(p.detach().abs().max()) for p in params.values() if p.is_floating_point())
    floor = gamma(roundings) * largest
    half = steps * lr * half_roundings * half_roundoff(precision)
    return FACTOR * max(max(errors.values()), floor) + half


def loss_atol(error: LoopError, losses: torch.Tensor, precision: str = "fp32") -> float:
    """Bound for reported losses: ``FACTOR`` x the fp32 loop's loss error (floor: one
    rounding of the largest loss), plus rule 4's ``2u`` of the largest loss."""
    largest = float(losses.detach().abs().max())
    fp32 = FACTOR * max(error.loss, unit_roundoff(torch.float32) * largest)
    return fp32 + 2 * half_roundoff(precision) * largest


def grad_norm_rtol(error: LoopError, precision: str = "fp32") -> float:
    """Relative bound for clipped gradient norms: ``FACTOR`` x the fp32 loop's relative
    norm error (floor: one rounding), plus rule 4's ``u``."""
    fp32 = FACTOR * max(error.grad_norm, unit_roundoff(torch.float32))
    return fp32 + half_roundoff(precision)


def relative_reference_error(errors: dict[str, float], params: dict[str, torch.Tensor]) -> float:
    """``max_k errors[k] / max |params[k]|``: the fp32 error in the metric of
    ``dist_worker.max_rel_diff`` (each tensor's difference over its largest entry)."""
    u = unit_roundoff(torch.float32)
    return max(
        max(errors[k], u * float(p.abs().max())) / float(p.abs().max()) for k, p in params.items()
    )
