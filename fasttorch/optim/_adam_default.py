"""torch's default Adam(W) form (non-capturable), its host arithmetic moved into tensors.

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
do not promote), so each kernel sees the operand torch's loop gives it. ``addcdiv_``'s
``value`` must be a number, so ``p.addcdiv_(m, d, value=-s)`` is written as the kernel
computes it: ``p + (-s * m) / d``. ``_multi_tensor_adam`` (``foreach=True``) without
``capturable`` computes the same numbers in the same order (``(lr / bc) * -1`` is
``-(lr / bc)``), so one replica serves both.

Bit for bit where the graph runs eager's kernels (``backend="aot_eager"``, or eagerly);
a compiler that generates its own kernels (inductor) rounds within its own rules.
tests/test_optim_db.py compares it with torch's eager default loop on torch's own inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["adam"]


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
                param.mul_(1 - lr * weight_decay)
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
        # Python's ``x ** 0.5`` is C pow(x, 0.5); ATen turns a 0.5 exponent into sqrt,
        # a correctly rounded function that pow need not equal: a tensor exponent keeps pow.
        bias_correction2_sqrt = torch.pow(bias_correction2, torch.full_like(step, 0.5))
        if amsgrad:
            max_exp_avg_sqs[i].copy_(torch.maximum(max_exp_avg_sqs[i], exp_avg_sq))
            denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        # addcdiv_(m, d, value=-s): the kernel computes p + (value * m) / d, value in float32.
        param.add_((-step_size) * exp_avg / denom)
