"""Bounds for numerical comparisons, each from a stated rule (tests/README.md).

Three rules, in order of preference:

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
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from reference import mse, reference_run
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


def _to64(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, (list, tuple)):
        return type(x)(_to64(v) for v in x)
    return x


def fp32_reference_error(
    model: nn.Module,
    windows: Sequence[Sequence[Any]],
    *,
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    loss_fn: Callable[..., torch.Tensor] = mse,
    **kwargs: Any,
) -> dict[str, float]:
    """Each parameter's largest absolute error of the fp32 hand-written loop.

    Runs ``tests/reference.reference_run`` on ``model`` and ``windows`` twice, in
    float32 and in float64 (a deep copy of the model and the batches converted), and
    returns ``{name: max |p32 - p64|}``. ``loss_fn`` must keep its input's dtype (it
    gets float64 batches in the second run).
    """
    ref32, _ = reference_run(model, windows, make_opt=make_opt, loss_fn=loss_fn, **kwargs)
    ref64, _ = reference_run(
        copy.deepcopy(model).double(),
        [_to64(list(w)) for w in windows],
        make_opt=make_opt,
        loss_fn=loss_fn,
        **kwargs,
    )
    p64 = dict(ref64.named_parameters())
    return {
        k: float((p.detach().double() - p64[k].detach()).abs().max())
        for k, p in ref32.named_parameters()
    }


def params_atol(errors: dict[str, float], params: dict[str, torch.Tensor]) -> float:
    """One absolute bound for every parameter: ``FACTOR`` x the largest fp32 error.

    One bound over all parameters, not one per tensor: a tensor whose true update is
    zero (a bias before a normalization) has no meaningful error of its own. The
    floor is one rounding of the largest parameter entry, so an error that happened to
    be 0 does not demand bitwise agreement of two different orders of operations.
    """
    largest = max(float(p.detach().abs().max()) for p in params.values())
    floor = unit_roundoff(torch.float32) * largest
    return FACTOR * max(max(errors.values()), floor)


def relative_reference_error(errors: dict[str, float], params: dict[str, torch.Tensor]) -> float:
    """``max_k errors[k] / max |params[k]|``: the fp32 error in the metric of
    ``dist_worker.max_rel_diff`` (each tensor's difference over its largest entry)."""
    u = unit_roundoff(torch.float32)
    return max(
        max(errors[k], u * float(p.abs().max())) / float(p.abs().max()) for k, p in params.items()
    )
