"""Adam(W)'s kernels: torch's fused kernel, the ``_foreach_*`` forms and one operator.

:mod:`fasttorch.optim.adam` holds the algorithm (:func:`~fasttorch.optim.adam.adam_math`,
readable, per parameter) and makes one call here, :func:`update`, which chooses among
the kernels that compute it over all parameters at once: torch's fused kernel, with its
own roundings, for a donated eager GPU step (:func:`fused`) and for an opaque
optimizer's donated CPU step (:func:`opaque_update`; in a graph the operator
``fasttorch::adam_fused_``, which the compiler does not look into), and to the
algorithm's bits the ``_foreach_*`` calls of ``torch.optim.Adam(foreach=True,
capturable=True)`` eagerly, in place or on copies (:func:`foreach`), and their
out-of-place form in a CPU graph (:func:`graph_update`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fasttorch import _compat
from fasttorch.optim import _base
from fasttorch.optim._base import computed_once, in_cpu_graph

__all__ = [
    "Updated",
    "bias_corrections",
    "foreach",
    "fused",
    "fused_kernel",
    "fused_update",
    "graph_update",
    "opaque_update",
    "update",
]

_foreach_mul = torch._foreach_mul


class Updated(NamedTuple):
    """What :func:`update` returns: the new parameters, moments and step count.

    ``m`` and ``v`` are ``None`` where the kernel wrote the state's own moment tensors
    in place (the fused kernel, the opaque operator): the state keeps them.
    """

    p: list[Tensor]
    m: list[Tensor] | None
    v: list[Tensor] | None
    new_count: Tensor


def update(
    p: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    lr: Tensor,
    count: Tensor,
    h: dict[str, Tensor],
    *,
    decoupled: bool,
    inplace: bool,
    opaque: bool,
) -> Updated:
    """One Adam(W) step over the lists ``p``, ``g``, ``m``, ``v`` by the kernel that fits.

    ``lr``: the learning rate, 0-d. ``inplace``: the caller may overwrite the
    parameter, moment, gradient and count tensors (a donated state). Eagerly in place
    the count is the state's own tensor too (no allocation at the peak). The choice, in
    order: with ``opaque``, in place on a CPU, torch's fused CPU kernel
    (:func:`opaque_update`: eagerly, or traced as the operator
    ``fasttorch::adam_fused_``); in a CPU graph, :func:`graph_update` (out of place:
    a donated state takes its results by the step's commit); eagerly in place on a
    device with torch's fused kernel, :func:`fused`; else :func:`foreach` (on copies
    when out of place: the same kernels as in place, so the same bits).
    """
    if opaque:
        done = opaque_update((p, g, m, v), lr, count, h, decoupled=decoupled, inplace=inplace)
        if done is not None:
            return done
    inplace = inplace and not torch.compiler.is_compiling()
    count = count.add_(1) if inplace else count + 1
    if len(p) == 0:
        return Updated(p, None, None, count)
    with torch.no_grad():
        if in_cpu_graph(p) and not inplace:
            p, m, v = graph_update(p, g, m, v, lr, count, h, decoupled=decoupled)
            return Updated(p, m, v, count)
        kernel = fused_kernel((p, g, m, v), decoupled=decoupled) if inplace else None
        if kernel is not None:
            fused(kernel, (p, g, m, v), lr, count, h)
            return Updated(p, None, None, count)
        if not inplace:
            p, g, m, v = ([t.clone() for t in ts] for ts in (p, g, m, v))
        foreach(p, g, m, v, lr, count, h, decoupled=decoupled, inplace=inplace)
    return Updated(p, m, v, count)


def opaque_update(
    lists: Sequence[list[Tensor]],
    lr: Tensor,
    count: Tensor,
    h: dict[str, Tensor],
    *,
    decoupled: bool,
    inplace: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> Updated | None:
    """An opaque Adam(W)'s step on a CPU in place on a donated state (``inplace``):
    torch's fused CPU kernel, one pass over each tensor; ``None`` where it does not
    apply (out of place, not on a CPU, under ``vmap``, a dtype or layout the kernel
    does not take: the caller's other kernels then run, with the ``_foreach`` bits).

    Eagerly it is :func:`fused`; traced into a graph, the operator
    ``fasttorch::adam_fused_``, whose body is the same call, so a compiled step and an
    eager one give the same bits, those of ``torch.optim.AdamW(fused=True)`` given the
    same float32 values. ``grad_scale``: a factor the gradients still carry, which the
    kernel divides out (a loss scale, a window's total weight, a clip's coefficient
    folded in); ``found_inf`` (a bool 0-d tensor): where true, nothing changes and the
    count does not advance.
    """
    p = lists[0]
    if not inplace or len(p) == 0 or p[0].device.type != "cpu":
        return None
    kernel = fused_kernel(lists, decoupled=decoupled, cpu=True)
    if kernel is None:
        return None
    with torch.no_grad():
        count = count.add_(1 if found_inf is None else found_inf.logical_not())
        if torch.compiler.is_compiling():
            hyper = [h[k] for k in ("beta1", "beta2", "eps", "weight_decay")]
            flag = None if found_inf is None else found_inf.to(torch.float32)
            torch.ops.fasttorch.adam_fused_(*lists, lr, count, *hyper, decoupled, grad_scale, flag)
        else:
            flag = None if found_inf is None else _base.float_flag(found_inf)
            lists = [lists[0], _base.like_params(lists[0], lists[1]), *lists[2:]]
            fused(kernel, lists, lr, count, h, grad_scale, flag)
    return Updated(lists[0], None, None, count)


def fused_kernel(
    lists: Sequence[list[Tensor]], *, decoupled: bool, cpu: bool = False
) -> Callable[..., Any] | None:
    """torch's fused Adam (AdamW with ``decoupled``) kernel where it can update ``lists``
    (params, grads, m, v) in this call, else ``None`` (:func:`_base.kernel`; ``cpu``:
    an opaque optimizer's, on the CPU too)."""
    return _base.kernel("adamw" if decoupled else "adam", lists, cpu=cpu)


def fused_update(
    lists: Sequence[list[Tensor]],
    lr: Tensor,
    count: Tensor,
    h: dict[str, Tensor],
    *,
    decoupled: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    opaque: bool = False,
) -> Tensor | None:
    """torch's fused kernel over ``lists`` in place, skipped where ``found_inf``: the new
    count (advanced in place unless ``found_inf``), or ``None`` (nothing done) where the
    kernel does not apply. ``grad_scale``: the factor the gradients still carry.
    ``opaque``: an opaque optimizer's, on a CPU too (:func:`opaque_update`)."""
    if opaque:
        done = opaque_update(
            lists,
            lr,
            count,
            h,
            decoupled=decoupled,
            inplace=True,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        if done is not None:
            return done.new_count
    kernel = fused_kernel(lists, decoupled=decoupled)
    if kernel is None:
        return None
    with torch.no_grad():
        if found_inf is None:
            count = count.add_(1)
            fused(kernel, lists, lr, count, h, grad_scale, None)
        else:
            count = count.add_(found_inf.logical_not())
            fused(kernel, lists, lr, count, h, grad_scale, _base.float_flag(found_inf))
    return count


def fused(
    kernel: Callable[..., Any],
    lists: Sequence[list[Tensor]],
    lr: Tensor,
    count: Tensor,
    h: dict[str, Tensor],
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """torch's fused Adam(W) ``kernel`` over ``lists`` (params, grads, m, v), one
    launch a dtype.

    ``count`` is already the new count; the kernel reads the step as float32, as
    ``torch.optim``'s per-parameter ``state["step"]`` (the same tensor for all).
    """
    steps = count.to(torch.float32)
    lr = lr.to(torch.float32)
    hyper = {k: _base.host_float(h[k]) for k in ("beta1", "beta2", "weight_decay", "eps")}
    for p, g, m, v in _base.by_dtype(lists):
        kernel(
            p,
            g,
            m,
            v,
            [],
            [steps] * len(p),
            lr=lr,
            **hyper,
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )


def foreach(
    p: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    lr: Tensor,
    count: Tensor,
    h: dict[str, Tensor],
    *,
    decoupled: bool,
    inplace: bool,
) -> None:
    """Adam's update (AdamW's with ``decoupled``) as ``_foreach_*`` calls, in place on
    ``p``, ``m``, ``v`` (``g`` is spent).

    The calls of ``torch.optim.Adam(foreach=True, capturable=True)``
    (``_multi_tensor_adam``), in its order and with its operands, so the same bits
    (:func:`~fasttorch.optim.adam`). Eager, every call takes CUDA's multi-tensor path:
    0-d factors in the lists' dtype (float32: the cast from float64 is the one the op
    itself would make, so the same bits), the lerp weight, weight decay and eps as
    Python floats (read once per change, :func:`_base.host_float`; the same values and
    kernels' results as the tensors), lists of the same shapes. In a graph the
    compiler fuses them and the 0-d factors stay tensors (a float would be a
    constant).
    """
    beta1, beta2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
    graph = torch.compiler.is_compiling()
    # Under torch.func.vmap (a population) a hyperparameter holds one value per
    # member: no host reads, and tensor scalars in lists, as in a graph.
    batched = _compat.in_functorch_transform()
    host = not (graph or batched)
    dtype = p[0].dtype

    def factor(x: Tensor) -> Tensor:
        return x if graph else x.to(_base.factor_dtype(dtype))

    step_size, bias_correction2_sqrt = bias_corrections(lr, count, beta1, beta2)
    if decoupled:
        torch._foreach_mul_(p, factor(1 - lr.to(torch.float32) * wd))
    elif host:
        # torch's add(p, alpha=weight_decay): one rounding (a fused multiply-add)
        alpha = _base.host_float(wd)
        if inplace:
            torch._foreach_add_(g, p, alpha=alpha)
        else:
            g = list(torch._foreach_add(g, p, alpha=alpha))
    else:
        # addcmul with a 0-d factor rounds as add(..., alpha=) does (one rounding).
        g = list(torch._foreach_addcmul(g, p, [wd] * len(p)))
    # torch's exp_avg.lerp_(grad, 1 - beta1), with the weight in each parameter's
    # dtype (as a 0-d tensor in a graph: a tensor scalar would be read to the host).
    if in_cpu_graph(m):
        w = 1 - beta1
        m[:] = [mi.lerp_(gi, w.to(mi.dtype)) for mi, gi in zip(m, g)]
    elif graph or len({t.dtype for t in m}) > 1 or batched:
        torch._foreach_lerp_(m, g, _per_dtype(1 - beta1, m))
    else:
        torch._foreach_lerp_(m, g, _host_weight(_base.host_float(beta1), dtype))
    torch._foreach_mul_(v, factor(beta2))
    scaled = torch._foreach_mul(g, factor(1 - beta2))
    torch._foreach_addcmul_(v, scaled, g)
    del scaled
    if inplace:
        # Eager: the denominator is built in g, which is spent (a copy is exact).
        torch._foreach_copy_(g, v)
        torch._foreach_sqrt_(g)
        denom = g
    else:
        denom = list(torch._foreach_sqrt(v))
    torch._foreach_div_(denom, factor(bias_correction2_sqrt))
    if host:
        # A Python float, read once per change (_base.host_float): CPU's kernel
        # reads a 0-d tensor operand to the host on every call.
        torch._foreach_add_(denom, _base.host_float(eps))
    else:
        # A list: dynamo reads a bare 0-d tensor operand of _foreach_add_ to the host.
        torch._foreach_add_(denom, [eps] * len(denom))
    # denom / step_size = -(sqrt(v_hat) + eps) / lr_t, so that p + m / denom is the
    # step; at lr 0 it is -inf (eps > 0), and m / -inf a zero step, never 0/0.
    torch._foreach_div_(denom, factor(step_size))
    torch._foreach_addcdiv_(p, m, denom)


def graph_update(
    p: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    lr: Tensor,
    count: Tensor,
    h: dict[str, Tensor],
    *,
    decoupled: bool,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Adam's update (AdamW's with ``decoupled``) for a CPU graph: new ``p``, ``m``,
    ``v``, out of place.

    The same operations on the same values as :func:`foreach` (the tests hold the two
    to the same bits), with the 0-d factors computed once (:func:`computed_once`)
    instead of inlined into every parameter's expression. Each operation is one
    ``_foreach`` call over all tensors, which inductor lowers to the per-tensor
    expressions a loop would give: dynamo's tracing time grows with the calls it
    traces, so a loop over tensors costs it one call per tensor and operation
    (docs/design.md, "Compile time"). Only ``lerp`` is per tensor: inductor has no CPU
    lowering for ``_foreach_lerp`` with a tensor weight.
    """
    beta1, beta2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
    step_size, bias_correction2_sqrt = bias_corrections(lr, count, beta1, beta2)
    decay = 1 - lr.to(torch.float32) * wd if decoupled else wd
    decay, w, beta2, rest2, step_size, bias_correction2_sqrt, eps = computed_once(
        decay, 1 - beta1, beta2, 1 - beta2, step_size, bias_correction2_sqrt, eps
    )
    if decoupled:
        p = list(_foreach_mul(p, decay))
    else:
        g = list(torch._foreach_addcmul(g, p, [decay] * len(p)))
    m = [mi.lerp(gi, wi) for mi, gi, wi in zip(m, g, _per_dtype(w, m))]
    v = list(torch._foreach_addcmul(_foreach_mul(v, beta2), _foreach_mul(g, rest2), g))
    denom = torch._foreach_div(torch._foreach_sqrt(v), bias_correction2_sqrt)
    # A list: dynamo reads a bare 0-d tensor operand of _foreach_add to the host.
    denom = torch._foreach_add(denom, [eps] * len(denom))
    denom = torch._foreach_div(denom, step_size)
    return list(torch._foreach_addcdiv(p, m, denom)), m, v


def bias_corrections(
    lr: Tensor, count: Tensor, beta1: Tensor, beta2: Tensor
) -> tuple[Tensor, Tensor]:
    """``(-lr / (1 - beta1**t), sqrt(1 - beta2**t))`` at ``t = count`` (the new count),
    as ``torch.optim.Adam(capturable=True)`` computes them: in float32 (its step count
    is a float32 tensor, its lr a float32 tensor), the first as
    ``1 / ((beta1**t - 1) / lr)``, in that order of roundings.

    Example:
        >>> one = torch.tensor(1.0)
        >>> bias_corrections(one, torch.tensor(1), torch.tensor(0.5), torch.tensor(0.75))
        (tensor(-2.), tensor(0.5000))
    """
    t = count.to(torch.float32)
    step_size = beta1.pow(t).sub(1).div(lr.to(torch.float32)).reciprocal()
    bias_correction2_sqrt = beta2.pow(t).sub(1).neg().sqrt()
    return step_size, bias_correction2_sqrt


def _adam_fused_impl(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    lr: Tensor,
    count: Tensor,
    beta1: Tensor,
    beta2: Tensor,
    eps: Tensor,
    weight_decay: Tensor,
    decoupled: bool,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
) -> None:
    """:func:`fused` in place, torch's fused CPU kernel: what an opaque optimizer's eager
    step runs (:func:`opaque_update`), so the same bits."""
    kernel = _compat.fused_optimizer_kernel("adamw" if decoupled else "adam")
    assert kernel is not None  # fused_kernel said so where the step was traced
    lists = (params, _base.like_params(params, grads), exp_avgs, exp_avg_sqs)
    h = {"beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    fused(kernel, lists, lr, count, h, grad_scale, found_inf)


def _adam_fused_fake(*args: Any) -> None:
    """Nothing to compute: the operator writes into its arguments and returns nothing."""


# The opaque optimizer's update in a compiled CPU step: torch's fused CPU kernel as one
# operator, one pass over each tensor, with no code generated per parameter tensor.
_base.cpu_operator(
    "adam_fused_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
    "Tensor(d!)[] exp_avg_sqs, Tensor lr, Tensor count, Tensor beta1, Tensor beta2, "
    "Tensor eps, Tensor weight_decay, bool decoupled, Tensor? grad_scale, "
    "Tensor? found_inf) -> ()",
    _adam_fused_impl,
    _adam_fused_fake,
)


@functools.lru_cache(maxsize=64)
def _host_weight(beta1: float, dtype: torch.dtype) -> float:
    """``1 - beta1`` as the float32 tensors compute it, then rounded to ``dtype``.

    Cached: the rounding goes through a CPU tensor, which a step should not read
    again for a value it has seen.
    """
    return float(torch.tensor(1 - beta1, dtype=torch.float32).to(dtype))


def _per_dtype(x: Tensor, like: list[Tensor]) -> list[Tensor]:
    """``x`` cast to each tensor's dtype, once per dtype."""
    cast: dict[torch.dtype, Tensor] = {}
    for t in like:
        if t.dtype not in cast:  # a comprehension would cast (and trace) once per tensor
            cast[t.dtype] = x.to(t.dtype)
    return [cast[t.dtype] for t in like]
