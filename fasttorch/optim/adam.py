"""Adam and AdamW: adaptive moments with L2 or decoupled weight decay."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

from fasttorch.optim._base import (
    LearningRate,
    OptState,
    check_hyper,
    check_lr,
    computed_once,
    in_cpu_graph,
    make_hyper,
    params_device,
    scheduled_or_fixed_lr,
)

__all__ = ["Adam", "adam", "adamw"]

_foreach_mul = torch._foreach_mul


@attrs.frozen
class Adam:
    """Functional ``torch.optim.Adam`` / ``AdamW`` (built by :func:`adam`, :func:`adamw`).

    ``decoupled_weight_decay=True`` is AdamW, as in ``torch.optim.Adam``'s flag of
    the same name.

    Example:
        >>> sorted(Adam(1e-3).init({"w": torch.zeros(2)}).slots)
        ['exp_avg', 'exp_avg_sq']
    """

    lr: LearningRate
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False

    def __attrs_post_init__(self) -> None:
        owner = "adamw" if self.decoupled_weight_decay else "adam"
        check_lr(owner, self.lr)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ValueError(
                f"{owner}: betas must be a pair (beta1, beta2), got {self.betas!r}. "
                "Pass e.g. betas=(0.9, 0.999)."
            )
        check_hyper(owner, "beta1", self.betas[0])
        check_hyper(owner, "beta2", self.betas[1])
        check_hyper(owner, "eps", self.eps)
        check_hyper(owner, "weight_decay", self.weight_decay)

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """Count 0, hyperparameters as 0-d float32 tensors, zero first and second moments."""
        device = params_device(params)
        hyper = make_hyper(
            self.lr,
            device,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            weight_decay=self.weight_decay,
        )
        slots = {
            slot: {n: torch.zeros_like(p) for n, p in params.items()}
            for slot in ("exp_avg", "exp_avg_sq")
        }
        return OptState(
            count=torch.zeros((), dtype=torch.int64, device=device), hyper=hyper, slots=slots
        )

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        """``self.lr(step)`` for a schedule, else ``opt_state.hyper["lr"]`` (0-d float32)."""
        return scheduled_or_fixed_lr(self.lr, opt_state, step)

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        inplace: bool = False,
    ) -> tuple[dict[str, Tensor], OptState]:
        """One Adam(W) step: new params (same keys, order) and state.

        Out of place by default. ``inplace=True`` overwrites the parameter, moment and
        gradient tensors instead and returns them (for a donated state in eager mode,
        where fresh allocations cost more than the arithmetic); both run the same
        kernels in the same order, so they give the same bits.
        """
        names = list(params)
        # In place, the count is the state's own tensor too (no allocation at the peak).
        count = opt_state.count.add_(1) if inplace else opt_state.count + 1
        if not names:
            return {}, opt_state.replace(count=count)
        h = opt_state.hyper
        beta1, beta2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            p = [params[n] for n in names]
            g = [grads[n] for n in names]
            m = [opt_state.slots["exp_avg"][n] for n in names]
            v = [opt_state.slots["exp_avg_sq"][n] for n in names]
            if in_cpu_graph(p) and not inplace:
                p, m, v = self._graph_update(p, g, m, v, lr, count, h)
                slots = {"exp_avg": dict(zip(names, m)), "exp_avg_sq": dict(zip(names, v))}
                return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)
            if not inplace:
                p, g, m, v = ([t.clone() for t in ts] for ts in (p, g, m, v))
            if self.decoupled_weight_decay:
                torch._foreach_mul_(p, 1 - lr * wd)
            else:
                torch._foreach_add_(g, _foreach_mul(p, wd))
            # torch's exp_avg.lerp_(grad, 1 - beta1), with the weight as a tensor per
            # parameter dtype (a 0-d tensor scalar would be read back to the host).
            if in_cpu_graph(m):
                w = 1 - beta1
                m = [mi.lerp_(gi, w.to(mi.dtype)) for mi, gi in zip(m, g)]
            else:
                torch._foreach_lerp_(m, g, _per_dtype(1 - beta1, m))
            torch._foreach_mul_(v, beta2)
            torch._foreach_mul_(g, g)
            torch._foreach_mul_(g, 1 - beta2)
            torch._foreach_add_(v, g)
            # Scalars in float64, as torch's Python-float math; the tensors they scale
            # cast them to their own dtype.
            t = count.to(torch.float64)
            step_size = lr / (1 - beta1**t)
            bias_correction2_sqrt = (1 - beta2**t).sqrt()
            del t
            if inplace:
                # Eager: the denominator is built in g, which is spent, and m / denom is
                # written over it tensor by tensor, so the update allocates nothing the
                # size of the parameters. The same kernels in the same order: same bits.
                torch._foreach_copy_(g, v)
                torch._foreach_sqrt_(g)
                denom = g
            else:
                denom = list(torch._foreach_sqrt(v))
            torch._foreach_div_(denom, bias_correction2_sqrt)
            # A list: with a bare 0-d tensor, _foreach_add_ reads it with .item() in C++.
            torch._foreach_add_(denom, [eps] * len(denom))
            if inplace:
                for mi, di in zip(m, denom):
                    torch.div(mi, di, out=di)
            elif torch.compiler.is_compiling():
                g = list(torch._foreach_div(m, denom))  # the graph plans its own memory
            else:
                # m / denom * step_size, written over g (spent); a copy is exact.
                torch._foreach_copy_(g, m)
                torch._foreach_div_(g, denom)
            torch._foreach_mul_(g, step_size)
            torch._foreach_sub_(p, g)
        slots = {"exp_avg": dict(zip(names, m)), "exp_avg_sq": dict(zip(names, v))}
        return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)

    def _graph_update(
        self,
        p: list[Tensor],
        g: list[Tensor],
        m: list[Tensor],
        v: list[Tensor],
        lr: Tensor,
        count: Tensor,
        h: dict[str, Tensor],
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """``update``'s arithmetic for a CPU graph: new ``p``, ``m``, ``v``, out of place.

        The same operations on the same values as the ``_foreach`` form (the tests
        hold the two to the same bits), written per tensor, with the 0-d factors
        computed once (:func:`computed_once`) instead of inlined into every
        parameter's expression.
        """
        beta1, beta2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
        t = count.to(torch.float64)
        decay = 1 - lr * wd if self.decoupled_weight_decay else wd
        decay, w, beta2, rest2, step_size, bias_correction2_sqrt, eps = computed_once(
            decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1**t), (1 - beta2**t).sqrt(), eps
        )
        ps, ms, vs = [], [], []
        for pi, gi, mi, vi in zip(p, g, m, v):
            if self.decoupled_weight_decay:
                pi = pi * decay
            else:
                gi = gi + pi * decay
            mi = mi.lerp(gi, w.to(mi.dtype))
            vi = vi * beta2 + gi * gi * rest2
            denom = vi.sqrt() / bias_correction2_sqrt + eps
            ps.append(pi - mi / denom * step_size)
            ms.append(mi)
            vs.append(vi)
        return ps, ms, vs


def _per_dtype(x: Tensor, like: list[Tensor]) -> list[Tensor]:
    """``x`` cast to each tensor's dtype, once per dtype."""
    cast = {t.dtype: x.to(t.dtype) for t in like}
    return [cast[t.dtype] for t in like]


def adam(
    lr: LearningRate,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Adam:
    """Adam, numerically ``torch.optim.Adam`` (``_single_tensor_adam``, amsgrad off).

    Per parameter, at update ``t = count + 1``::

        g = grad + weight_decay * p                 # L2 penalty, coupled
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Args:
        lr: a float >= 0, or a schedule ``step -> 0-d tensor`` (see ``fasttorch.schedules``).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.

    Returns:
        An :class:`Adam` optimizer.

    Raises:
        ValueError: for out-of-range values, as ``torch.optim.Adam`` does.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> opt = optim.adam(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update(params, {"w": torch.ones(2)}, state, torch.tensor(0))
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    return Adam(lr, betas, eps, weight_decay, decoupled_weight_decay=False)


def adamw(
    lr: LearningRate,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> Adam:
    """AdamW, numerically ``torch.optim.AdamW`` (``_single_tensor_adam``, decoupled decay).

    As :func:`adam`, except that the decay shrinks the parameters before the moment
    update instead of entering the gradient: ``p = p * (1 - lr * weight_decay)``.

    Args:
        lr: a float >= 0, or a schedule ``step -> 0-d tensor`` (see ``fasttorch.schedules``).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled decay factor, >= 0.

    Returns:
        An :class:`Adam` optimizer with ``decoupled_weight_decay=True``.

    Raises:
        ValueError: for out-of-range values, as ``torch.optim.AdamW`` does.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> opt = optim.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update(params, {"w": torch.ones(2)}, state, torch.tensor(0))
        >>> params["w"]
        tensor([0.8500, 0.8500])
    """
    return Adam(lr, betas, eps, weight_decay, decoupled_weight_decay=True)
