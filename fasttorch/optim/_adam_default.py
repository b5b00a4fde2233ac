"""torch's default Adam-family forms (non-capturable), their host arithmetic in tensors.

``torch.optim.Adam()`` with its default flags on a CPU runs ``_single_tensor_adam`` with
``capturable=False``: it reads each parameter's step count to the host
(``_get_value(step)``), computes the bias corrections, the step size and
``bias_correction2 ** 0.5`` as Python floats (IEEE double), and hands them to float32
kernels as scalar operands, which ATen rounds to float32. ``torch.compile`` cannot read
a host number inside a graph without a recompile per step, so the capturable form (float32
bias corrections, another rounding) is what a compiled step usually runs.

:func:`adam` computes the default form's numbers inside the graph: the step count as a
float64 tensor, ``1 - beta ** step``, ``lr / bias_correction1`` and
``bias_correction2 ** 0.5`` in 0-d float64 tensors by the same C ``pow`` and IEEE
operations Python uses, then torch's float32 operations in torch's order. A 0-d float64
tensor beside a float32 tensor is rounded to float32 as a Python scalar is (0-d tensors
do not promote; beside another 0-d tensor it would, so it is rounded first there), so
each kernel sees the operand torch's loop gives it. ``addcdiv_``'s
``value`` must be a number, so ``p.addcdiv_(m, d, value=-s)`` is written as the kernel
computes it: ``p + (-s * m) / d``. ``_multi_tensor_adam`` (``foreach=True``) without
``capturable`` computes the same numbers in the same order (``(lr / bc) * -1`` is
``-(lr / bc)``), so one replica serves both; so does Adamax's. :func:`adamax`,
:func:`nadam` and :func:`radam` do the same for those classes. torch's foreach NAdam
and RAdam order their arithmetic otherwise than its single-tensor forms, so against
``NAdam(foreach=True)`` or ``RAdam(foreach=True)`` the replicas (the single-tensor
form, torch's CPU default) differ in the last bits, by as much as torch's two forms
differ from each other (measured on tests/test_optim_db.py's model, 3 steps: at most
1.9e-9 for NAdam, 2.3e-10 for RAdam, on parameters of size 0.48).

Bit for bit where the graph runs eager's kernels (``backend="aot_eager"``, or eagerly);
a compiler that generates its own kernels (inductor) rounds within its own rules.
tests/test_optim_db.py compares it with torch's eager default loop on torch's own inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["adam", "adamax", "nadam", "radam"]


def adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool = False,
    **ignored: Any,
) -> None:
    """``_single_tensor_adam(capturable=False)``'s update, in place, with no host read.

    ``lr`` is a 0-d tensor: float64 holds a Python float's exact value (torch's loop
    computes with the float); a float32 (or other) lr is torch's tensor lr, whose
    arithmetic torch does in that dtype, as here.

    Equivalent to::

        torch.optim.adam.adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                              state_steps, lr=float(lr), capturable=False, ...)

    Example:
        >>> p, g = [torch.ones(2)], [torch.full((2,), 0.5)]
        >>> m, v, step = [torch.zeros(2)], [torch.zeros(2)], [torch.tensor(0.0)]
        >>> adam(p, g, m, v, [], step, lr=torch.tensor(0.1, dtype=torch.float64),
        ...      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False,
        ...      maximize=False)
        >>> p[0]
        tensor([0.9000, 0.9000])
    """
    float_lr = lr.dtype == torch.float64
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        step_t += 1
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(_s(1 - lr * weight_decay, param))
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        # Out of place: dynamo rewrites the in-place addcmul_ into an fma, which
        # rounds once where ATen's CPU kernel rounds twice.
        exp_avg_sq.copy_(torch.addcmul(exp_avg_sq.mul_(beta2), grad, grad, value=1 - beta2))
        # _get_value(step): the float32 count as a double (an integer, exact).
        step = step_t.to(torch.float64)
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2 = 1 - torch.pow(beta2, step)
        # A tensor lr divides by the float bias correction in its own dtype.
        step_size = lr / (bias_correction1 if float_lr else bias_correction1.to(lr.dtype))
        bias_correction2_sqrt = _pow_half(bias_correction2)
        if amsgrad:
            max_exp_avg_sqs[i].copy_(torch.maximum(max_exp_avg_sqs[i], exp_avg_sq))
            denom = (max_exp_avg_sqs[i].sqrt() / _s(bias_correction2_sqrt, param)).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / _s(bias_correction2_sqrt, param)).add_(eps)
        # addcdiv_(m, d, value=-s): the kernel computes p + (value * m) / d, value in float32.
        param.add_(_s(-step_size, param) * exp_avg / denom)


def _s(x: Tensor, like: Tensor) -> Tensor:
    """The 0-d ``x`` (a Python float of torch's code) as an operand beside ``like``.

    Beside a tensor of one or more dimensions a 0-d tensor does not promote, and ATen
    reads its value as it reads a Python scalar's. Beside a 0-d tensor (a scalar
    parameter, NAdam's ``mu_product``) a float64 ``x`` would promote the operation to
    float64; torch's Python float is rounded to ``like``'s dtype (computed in float32
    for half dtypes), so ``x`` is too.
    """
    if like.dim() > 0:
        return x
    return x.to(torch.promote_types(like.dtype, torch.float32))


def _pow_half(x: Tensor) -> Tensor:
    """Python's ``x ** 0.5`` (C ``pow``) on a 0-d float64 tensor: a tensor exponent, as
    ATen turns a 0.5 scalar exponent into ``sqrt``, which ``pow`` need not equal."""
    return torch.pow(x, torch.full_like(x, 0.5))


def adamax(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_infs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    **ignored: Any,
) -> None:
    """``_single_tensor_adamax(capturable=False)``'s update, in place, with no host read
    (``lr`` as in :func:`adam`).

    Equivalent to::

        torch.optim.adamax.adamax(params, grads, exp_avgs, exp_infs, state_steps,
                                  lr=float(lr), capturable=False, ...)

    Example:
        >>> p, g = [torch.ones(2)], [torch.full((2,), 0.5)]
        >>> adamax(p, g, [torch.zeros(2)], [torch.zeros(2)], [torch.tensor(0.0)],
        ...        lr=torch.tensor(0.1, dtype=torch.float64), beta1=0.9, beta2=0.999,
        ...        eps=1e-8, weight_decay=0.0, maximize=False)
        >>> p[0]
        tensor([0.9000, 0.9000])
    """
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        exp_avg, exp_inf, step_t = exp_avgs[i], exp_infs[i], state_steps[i]
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_inf.copy_(torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps)))
        bias_correction = 1 - torch.pow(beta1, step_t.to(torch.float64))
        clr = lr / bias_correction.to(lr.dtype)
        # addcdiv_(m, u, value=-clr): p + (value * m) / u
        param.add_(_s(-clr, param) * exp_avg / exp_inf)


def nadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    mu_products: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    **ignored: Any,
) -> None:
    """``_single_tensor_nadam(capturable=False)``'s update, in place, with no host read
    (``lr`` as in :func:`adam`; ``mu_product``, read by torch as a Python number, as a
    float64 tensor).

    Equivalent to::

        torch.optim.nadam.nadam(params, grads, exp_avgs, exp_avg_sqs, mu_products,
                                state_steps, lr=float(lr), capturable=False, ...)

    Example:
        >>> p, g = [torch.ones(2)], [torch.full((2,), 0.5)]
        >>> z = torch.zeros
        >>> nadam(p, g, [z(2)], [z(2)], [torch.tensor(1.0)], [torch.tensor(0.0)],
        ...       lr=torch.tensor(0.1, dtype=torch.float64), beta1=0.9, beta2=0.999,
        ...       eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
        ...       decoupled_weight_decay=False, maximize=False)
        >>> p[0]
        tensor([0.8944, 0.8944])
    """

    def scalar(x: Tensor) -> Tensor:  # a Python float beside lr: in lr's dtype
        return x.to(lr.dtype)

    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        mu_product, step_t = mu_products[i], state_steps[i]
        step_t += 1
        step = step_t.to(torch.float64)
        bias_correction2 = 1 - torch.pow(beta2, step)
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(_s(1 - lr * weight_decay, param))
            else:
                grad = grad.add(param, alpha=weight_decay)
        mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))
        mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * momentum_decay))
        mu_product.mul_(_s(mu, mu_product))
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.copy_(torch.addcmul(exp_avg_sq.mul_(beta2), grad, grad, value=1 - beta2))
        denom = exp_avg_sq.div(_s(bias_correction2, param)).sqrt()
        product = mu_product.to(torch.float64)  # _get_value(mu_product)
        mu_product_next = product * mu_next
        denom.add_(eps)
        value = -lr * scalar(1.0 - mu) / scalar(1.0 - product)
        param.add_(_s(value, param) * grad / denom)
        value = (-lr * scalar(mu_next)) / scalar(1.0 - mu_product_next)
        param.add_(_s(value, param) * exp_avg / denom)


def radam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    **ignored: Any,
) -> None:
    """``_single_tensor_radam(capturable=False)``'s update, in place, with no host read
    (``lr`` as in :func:`adam`). Torch branches on the rectification ``rho_t > 5`` in
    Python; here both updates are computed and ``torch.where`` keeps torch's.

    Equivalent to::

        torch.optim.radam.radam(params, grads, exp_avgs, exp_avg_sqs, state_steps,
                                lr=float(lr), capturable=False, ...)

    Example:
        >>> p, g = [torch.ones(2)], [torch.full((2,), 0.5)]
        >>> radam(p, g, [torch.zeros(2)], [torch.zeros(2)], [torch.tensor(0.0)],
        ...       lr=torch.tensor(0.1, dtype=torch.float64), beta1=0.9, beta2=0.999,
        ...       eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False, maximize=False)
        >>> p[0]
        tensor([0.9500, 0.9500])
    """
    rho_inf = 2 / (1 - beta2) - 1
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        step_t += 1
        step = step_t.to(torch.float64)
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(_s(1 - lr * weight_decay, param))
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.copy_(torch.addcmul(exp_avg_sq.mul_(beta2), grad, grad, value=1 - beta2))
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2 = 1 - torch.pow(beta2, step)
        bias_corrected_exp_avg = exp_avg / _s(bias_correction1, param)
        rho_t = rho_inf - 2 * step * torch.pow(beta2, step) / bias_correction2
        rect = _pow_half(
            (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        )
        # (bias_correction2 ** 0.5) / t is Tensor.__rtruediv__: t.reciprocal() * (...)
        root = _s(_pow_half(bias_correction2), param)
        adaptive_lr = exp_avg_sq.sqrt().add_(eps).reciprocal() * root
        rectified = bias_corrected_exp_avg * _s(lr, param) * adaptive_lr * _s(rect, param)
        update = torch.where(rho_t > 5.0, rectified, bias_corrected_exp_avg * _s(lr, param))
        param.add_(update, alpha=-1.0)
