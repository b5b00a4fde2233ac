"""SGD's kernels: torch's fused kernel and the ``_foreach_*`` form, and the choice.

:mod:`fasttorch.optim.sgd` holds the algorithm (:func:`~fasttorch.optim.sgd.sgd_math`,
readable, per parameter) and makes one call here, :func:`update`, which chooses: torch's
fused kernel, ``torch.optim.SGD(fused=True)``'s, for a donated eager step on a device
that has it (:func:`fused`), where it computes the same algorithm; else the
``_foreach_*`` calls (:func:`foreach`), in place or on copies, eagerly and in a graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fasttorch import _compat
from fasttorch.optim import _base

__all__ = [
    "foreach",
    "fused",
    "fused_kernel",
    "fused_lists",
    "fused_update",
    "opaque_update",
    "update",
]

_foreach_mul = torch._foreach_mul


def update(
    p: list[Tensor],
    g: list[Tensor],
    bufs: list[Tensor] | None,
    lr: Tensor,
    count: Tensor,
    hyper: dict[str, Tensor],
    *,
    nesterov: bool,
    inplace: bool,
    opaque: bool = False,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """One SGD step over the lists ``p``, ``g`` (and the momentum buffers ``bufs``, or
    ``None`` without momentum) by the kernel that fits: the new parameters and buffers
    (``None``: the state's own, unchanged or written in place by the fused kernel).

    ``count``: the step count before this update (0 on the first). ``inplace``: the
    caller may overwrite the parameter, buffer and gradient tensors (a donated state);
    out of place the same kernels run on copies, so the same bits. ``opaque``: in place
    on a CPU, torch's fused CPU kernel (:func:`opaque_update`).
    """
    if opaque and inplace and opaque_update(p, g, bufs, lr, count, hyper, nesterov=nesterov):
        return p, None
    lists = fused_lists(p, g, bufs, hyper) if inplace else None
    kernel = None if lists is None else fused_kernel(lists)
    if kernel is not None and lists is not None:
        fused(kernel, lists, lr, hyper, nesterov=nesterov)
        return p, None
    if not inplace:
        p, g = [t.clone() for t in p], [t.clone() for t in g]
        bufs = None if bufs is None else [t.clone() for t in bufs]
    return foreach(p, g, bufs, lr, count, hyper, nesterov=nesterov)


def foreach(
    p: list[Tensor],
    g: list[Tensor],
    bufs: list[Tensor] | None,
    lr: Tensor,
    count: Tensor,
    hyper: dict[str, Tensor],
    *,
    nesterov: bool,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """SGD's update as ``_foreach_*`` calls, in place on ``p`` and ``bufs`` (``g`` is
    spent): the operations of ``torch.optim.SGD(foreach=True)`` with a tensor lr, as
    ``torch.compile`` runs it. Returns ``p`` and ``bufs``."""
    # Python numbers where the step may read them (once per change), else tensors.
    host = not (torch.compiler.is_compiling() or _compat.in_functorch_transform())
    # torch's grad.add(param, alpha=weight_decay): one rounding.
    _add_scaled_(g, p, hyper["weight_decay"], host)
    if bufs is not None:
        momentum = hyper["momentum"]
        # torch copies grad into the buffer on the first step; the buffer starts
        # at zero, so a grad coefficient of 1 there (a tensor select, no sync)
        # gives exactly that.
        first = count == 0
        coef = torch.where(first, torch.ones_like(momentum), 1 - hyper["dampening"])
        torch._foreach_mul_(bufs, momentum)
        # g * coef is exact where coef is 1 (the first step, or dampening 0):
        # then the sum rounds once, as torch's add(grad, alpha=1 - dampening).
        torch._foreach_add_(bufs, _foreach_mul(g, coef))
        if nesterov:
            _add_scaled_(g, bufs, momentum, host)
        else:
            g = bufs
    # p + g * -lr, rounded twice, as torch's SGD with a tensor lr under
    # torch.compile (eagerly it reads the lr to the host for add(alpha=-lr)).
    # lr in the lists' dtype (float32 from a schedule's float64: the cast the op
    # would make, same bits), for CUDA's multi-tensor path.
    lr = lr if torch.compiler.is_compiling() else lr.to(_base.factor_dtype(p[0].dtype))
    torch._foreach_sub_(p, _foreach_mul(g, lr))
    return p, bufs


def fused_lists(
    p: list[Tensor], g: list[Tensor], bufs: list[Tensor] | None, hyper: dict[str, Tensor]
) -> list[list[Tensor]] | None:
    """(params, grads[, buffers]) for the fused kernel, or None where it does not
    compute this algorithm (momentum with dampening other than 0), or in a graph,
    where it never runs (the dampening is read on the host)."""
    if torch.compiler.is_compiling():
        return None
    if bufs is None:
        return [p, g]
    # Not for half dtypes: torch's CPU kernel (2.13) gives wrong buffers for a
    # bfloat16 step that is not the first, and the zero buffer relies on it.
    if p[0].dtype not in (torch.float32, torch.float64):
        return None
    if _base.host_float(hyper["dampening"]) != 0.0:
        return None
    return [p, g, bufs]


def fused_kernel(lists: Sequence[list[Tensor]], *, cpu: bool = False) -> Callable[..., Any] | None:
    """torch's fused SGD kernel where it can update ``lists`` in this call, else None
    (``cpu``: an opaque optimizer's, on the CPU too)."""
    return _base.kernel("sgd", lists, cpu=cpu)


def opaque_update(
    p: list[Tensor],
    g: list[Tensor],
    bufs: list[Tensor] | None,
    lr: Tensor,
    count: Tensor,
    hyper: dict[str, Tensor],
    *,
    nesterov: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> bool:
    """An opaque SGD's step on a CPU, in place on a donated state: torch's fused CPU
    kernel, one pass over each tensor; whether it ran (``False``: not on a CPU, under
    ``vmap``, a dtype or layout it does not take; the caller's other kernels run).

    Eagerly :func:`fused` (with the dampening read to the host: where it is not 0 the
    ``_foreach`` form runs instead, :func:`fused_lists`); traced into a graph, the
    operator ``fasttorch::sgd_fused_``, whose body makes the same choice at run time, so
    a compiled step and an eager one give the same bits, ``torch.optim.SGD(fused=True)``'s
    given the same float32 values. ``grad_scale``, ``found_inf``: as
    ``GradScaler.step`` gives them to the fused kernel.
    """
    if len(p) == 0 or p[0].device.type != "cpu":
        return False
    lists = [p, g] if bufs is None else [p, g, bufs]
    # Not for half dtypes with momentum: torch's CPU kernel (2.13) gives wrong buffers
    # for a bfloat16 step that is not the first.
    if bufs is not None and p[0].dtype not in (torch.float32, torch.float64):
        return False
    if fused_kernel(lists, cpu=True) is None:
        return False
    if torch.compiler.is_compiling():
        zero = [] if bufs is None else bufs
        h = [hyper.get(k, hyper["weight_decay"]) for k in ("weight_decay", "momentum", "dampening")]
        torch.ops.fasttorch.sgd_fused_(
            p,
            g,
            zero,
            lr,
            count,
            *h,
            bufs is not None,
            nesterov,
            grad_scale,
            None if found_inf is None else found_inf.to(torch.float32),
        )
        return True
    if fused_lists(p, g, bufs, hyper) is None:
        return False
    flag = None if found_inf is None else _base.float_flag(found_inf)
    lists[1] = _base.like_params(p, g)
    fused(_KERNEL, lists, lr, hyper, nesterov=nesterov, grad_scale=grad_scale, found_inf=flag)
    return True


def _sgd_fused_impl(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    lr: Tensor,
    count: Tensor,
    weight_decay: Tensor,
    momentum: Tensor,
    dampening: Tensor,
    has_momentum: bool,
    nesterov: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
) -> None:
    """:func:`opaque_update`'s eager choice, at run time: torch's fused CPU kernel, or
    the ``_foreach`` form in place where the dampening is not 0 (then the gradients
    are unscaled first and a skip keeps the old values, as the kernel would)."""
    hyper = {"weight_decay": weight_decay}
    if has_momentum:
        hyper.update(momentum=momentum, dampening=dampening)
    b = bufs if has_momentum else None
    lists = fused_lists(params, _base.like_params(params, grads), b, hyper)
    if lists is not None:
        fused(
            _KERNEL, lists, lr, hyper, nesterov=nesterov, grad_scale=grad_scale, found_inf=found_inf
        )
        return
    if found_inf is not None and _base.host_float(found_inf) != 0.0:
        return
    if grad_scale is not None:
        torch._foreach_div_(grads, grad_scale)
    foreach(params, grads, b, lr, count, hyper, nesterov=nesterov)


def _sgd_fused_fake(*args: Any) -> None:
    """Nothing to compute: the operator writes into its arguments and returns nothing."""


_KERNEL: Any = _compat.fused_optimizer_kernel("sgd")
# The opaque SGD's update in a compiled CPU step: torch's fused CPU kernel as one
# operator, with no code generated per parameter tensor.
_base.cpu_operator(
    "sgd_fused_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] bufs, Tensor lr, "
    "Tensor count, Tensor weight_decay, Tensor momentum, Tensor dampening, "
    "bool has_momentum, bool nesterov, Tensor? grad_scale, Tensor? found_inf) -> ()",
    _sgd_fused_impl,
    _sgd_fused_fake,
)


def fused_update(
    p: list[Tensor],
    g: list[Tensor],
    bufs: list[Tensor] | None,
    lr: Tensor,
    hyper: dict[str, Tensor],
    *,
    nesterov: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    count: Tensor | None = None,
    opaque: bool = False,
) -> bool:
    """torch's fused kernel in place, skipped where ``found_inf``; whether it ran
    (``False``: nothing done, the kernel does not apply). ``grad_scale``: the factor
    the gradients still carry. ``opaque``: an opaque optimizer's, on a CPU too
    (:func:`opaque_update`; ``count``: the step count before this update)."""
    if opaque and count is not None:
        done = opaque_update(
            p,
            g,
            bufs,
            lr,
            count,
            hyper,
            nesterov=nesterov,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        if done:
            return True
    lists = fused_lists(p, g, bufs, hyper) if len(p) > 0 else None
    kernel = None if lists is None else fused_kernel(lists)
    if kernel is None or lists is None:
        return False
    with torch.no_grad():
        fused(
            kernel,
            lists,
            lr,
            hyper,
            nesterov=nesterov,
            grad_scale=grad_scale,
            found_inf=None if found_inf is None else _base.float_flag(found_inf),
        )
    return True


def fused(
    kernel: Callable[..., Any],
    lists: Sequence[list[Tensor]],
    lr: Tensor,
    hyper: dict[str, Tensor],
    *,
    nesterov: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """torch's fused SGD over ``lists`` (params, grads[, buffers]), one launch a dtype."""
    has_momentum = len(lists) == 3
    momentum = _base.host_float(hyper["momentum"]) if has_momentum else 0.0
    wd = _base.host_float(hyper["weight_decay"])
    lr = lr.to(torch.float32)
    for group in _base.by_dtype(lists):
        kernel(
            group[0],
            group[1],
            group[2] if has_momentum else [],
            weight_decay=wd,
            momentum=momentum,
            lr=lr,
            dampening=0.0,
            nesterov=nesterov,
            maximize=False,
            is_first_step=False,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )


def _add_scaled_(a: list[Tensor], b: list[Tensor], s: Tensor, host: bool) -> None:
    """``a += s * b`` rounded once, as torch's ``a.add_(b, alpha=s)`` (a fused
    multiply-add on CPU and CUDA): with ``s`` as a Python float read once per change
    (:func:`_base.host_float`) where ``host``, else as ``addcmul`` with the 0-d tensor,
    which rounds the same way."""
    if host:
        torch._foreach_add_(a, b, alpha=_base.host_float(s))
    else:
        torch._foreach_addcmul_(a, b, [s] * len(a))
