"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from fasttorch import _checks, _compat
from fasttorch.optim import _base
from fasttorch.optim._base import (
    LearningRate,
    OptState,
    check_hyper,
    check_lr,
    make_hyper,
    params_device,
    scheduled_or_fixed_lr,
)

__all__ = ["SGD", "sgd"]

_foreach_mul = torch._foreach_mul


@attrs.frozen
class SGD:
    """Functional ``torch.optim.SGD`` (built by :func:`sgd`; see it for the algorithm).

    Example:
        >>> SGD(0.1).init({"w": torch.zeros(2)}).slots
        {}
    """

    lr: LearningRate
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __attrs_post_init__(self) -> None:
        check_lr("sgd", self.lr)
        for name in ("momentum", "dampening", "weight_decay"):
            check_hyper("sgd", name, getattr(self, name))
        _checks.flag("sgd", "nesterov", self.nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"sgd: nesterov=True needs momentum > 0 and dampening = 0, got "
                f"momentum={self.momentum!r}, dampening={self.dampening!r}. Pass e.g. "
                "momentum=0.9, dampening=0.0, or nesterov=False."
            )

    @property
    def _has_momentum(self) -> bool:
        # Fixed at construction: it decides the state's shape (a buffer or none).
        return self.momentum > 0

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """Count 0, hyperparameters as 0-d float32 tensors, zero momentum buffers."""
        device = params_device(params)
        values = {"weight_decay": self.weight_decay}
        slots: dict[str, dict[str, Tensor]] = {}
        if self._has_momentum:
            values.update(momentum=self.momentum, dampening=self.dampening)
            slots["momentum_buffer"] = {n: torch.zeros_like(p) for n, p in params.items()}
        hyper = make_hyper(self.lr, device, **values)
        _base.remember(hyper, values)
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
        """One SGD step: new params (same keys, order) and state.

        Out of place by default; ``inplace=True`` overwrites the parameter, buffer and
        gradient tensors and returns them, running the same kernels (same bits). In
        place on a GPU (:data:`~fasttorch.optim._base.FUSED_DEVICES`) the update is
        torch's fused kernel, ``torch.optim.SGD(fused=True)``'s, where it computes the
        same algorithm: without momentum, or with dampening 0 (torch's kernel starts
        the buffer from the gradient when told it is the first step, which a step that
        keeps its count on the device cannot tell it; with dampening 0 a zero buffer
        gives the same).
        """
        names = list(params)
        count = opt_state.count + 1
        if not names:
            return {}, opt_state.replace(count=count)
        hyper = opt_state.hyper
        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            p = [params[n] for n in names]
            g = [grads[n] for n in names]
            lists = self._fused_lists(names, p, g, opt_state) if inplace else None
            fused = None if lists is None else _base.kernel("sgd", lists)
            if fused is not None and lists is not None:
                self._fused(fused, lists, lr, hyper)
                return dict(zip(names, p)), opt_state.replace(count=count)
            if not inplace:
                p, g = [t.clone() for t in p], [t.clone() for t in g]
            # Python numbers where the step may read them (once per change), else tensors.
            host = not (torch.compiler.is_compiling() or _compat.in_functorch_transform())
            # torch's grad.add(param, alpha=weight_decay): one rounding.
            _add_scaled_(g, p, hyper["weight_decay"], host)
            slots = opt_state.slots
            if self._has_momentum:
                momentum = hyper["momentum"]
                # torch copies grad into the buffer on the first step; the buffer starts
                # at zero, so a grad coefficient of 1 there (a tensor select, no sync)
                # gives exactly that.
                first = opt_state.count == 0
                coef = torch.where(first, torch.ones_like(momentum), 1 - hyper["dampening"])
                bufs = [opt_state.slots["momentum_buffer"][n] for n in names]
                if not inplace:
                    bufs = [t.clone() for t in bufs]
                torch._foreach_mul_(bufs, momentum)
                # g * coef is exact where coef is 1 (the first step, or dampening 0):
                # then the sum rounds once, as torch's add(grad, alpha=1 - dampening).
                torch._foreach_add_(bufs, _foreach_mul(g, coef))
                if self.nesterov:
                    _add_scaled_(g, bufs, momentum, host)
                else:
                    g = bufs
                slots = {"momentum_buffer": dict(zip(names, bufs))}
            # p + g * -lr, rounded twice, as torch's SGD with a tensor lr under
            # torch.compile (eagerly it reads the lr to the host for add(alpha=-lr)).
            # lr in the lists' dtype (float32 from a schedule's float64: the cast the op
            # would make, same bits), for CUDA's multi-tensor path.
            lr = lr if torch.compiler.is_compiling() else lr.to(_base.factor_dtype(p[0].dtype))
            torch._foreach_sub_(p, _foreach_mul(g, lr))
        return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)

    def _fused_lists(
        self, names: list[str], p: list[Tensor], g: list[Tensor], opt_state: OptState
    ) -> list[list[Tensor]] | None:
        """(params, grads[, buffers]) for the fused kernel, or None where it does not
        compute this algorithm (momentum with dampening other than 0)."""
        if not self._has_momentum:
            return [p, g]
        # Not for half dtypes: torch's CPU kernel (2.13) gives wrong buffers for a
        # bfloat16 step that is not the first, and the zero buffer relies on it.
        if p[0].dtype not in (torch.float32, torch.float64):
            return None
        if _base.host_float(opt_state.hyper["dampening"]) != 0.0:
            return None
        return [p, g, [opt_state.slots["momentum_buffer"][n] for n in names]]

    def fused_update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        grad_scale: Tensor | None,
        found_inf: Tensor,
    ) -> tuple[dict[str, Tensor], OptState] | None:
        """``update(..., inplace=True)`` through torch's fused kernel, skipped where
        ``found_inf``; ``None`` (nothing done) where the kernel does not apply.

        As ``GradScaler.step`` with a fused optimizer: ``grads`` still carry the loss
        scale ``grad_scale`` (or none), which the kernel divides out, and when
        ``found_inf`` (a bool 0-d tensor) is true the kernel leaves parameters and
        buffers as they are; the count does not advance.
        """
        names = list(params)
        p, g = [params[n] for n in names], [grads[n] for n in names]
        lists = self._fused_lists(names, p, g, opt_state) if names else None
        fused = None if lists is None else _base.kernel("sgd", lists)
        if fused is None or lists is None:
            return None
        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            count = opt_state.count + found_inf.logical_not()
            self._fused(fused, lists, lr, opt_state.hyper, grad_scale, _base.float_flag(found_inf))
        return dict(zip(names, p)), opt_state.replace(count=count)

    def can_fuse(
        self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor], opt_state: OptState
    ) -> bool:
        """Whether :meth:`fused_update` would run torch's fused kernel on these tensors."""
        names = list(params)
        p, g = [params[n] for n in names], [grads[n] for n in names]
        lists = self._fused_lists(names, p, g, opt_state) if names else None
        return lists is not None and _base.kernel("sgd", lists) is not None

    def _fused(
        self,
        fused: Callable[..., Any],
        lists: Sequence[list[Tensor]],
        lr: Tensor,
        hyper: dict[str, Tensor],
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> None:
        """torch's fused SGD over ``lists`` (params, grads[, buffers]), one launch a dtype."""
        momentum = _base.host_float(hyper["momentum"]) if self._has_momentum else 0.0
        wd = _base.host_float(hyper["weight_decay"])
        lr = lr.to(torch.float32)
        for group in _base.by_dtype(lists):
            fused(
                group[0],
                group[1],
                group[2] if self._has_momentum else [],
                weight_decay=wd,
                momentum=momentum,
                lr=lr,
                dampening=0.0,
                nesterov=self.nesterov,
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


def sgd(
    lr: LearningRate,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> SGD:
    """Stochastic gradient descent: bit for bit ``torch.optim.SGD`` with a tensor lr, as
    ``torch.compile`` runs it (dampening 0).

    Per parameter, with ``b`` the momentum buffer::

        g = grad + weight_decay * p
        b = g if first step else momentum * b + (1 - dampening) * g   # when momentum > 0
        g = g + momentum * b if nesterov else b                         # when momentum > 0
        p = p - lr * g

    Equivalent to::

        opt = torch.optim.SGD(params, lr=torch.tensor(lr), momentum=momentum,
                              weight_decay=weight_decay, nesterov=nesterov, foreach=True)
        opt.step = torch.compile(opt.step)
        loss.backward(); opt.step(); opt.zero_grad()

    **Which torch it equals.** SGD has no capturable form. With a tensor lr, torch's
    compiled step writes the last line as ``p + g * -lr`` (two roundings), its eager one
    reads the lr to the host for ``p.add_(g, alpha=-lr)`` (one fused multiply-add);
    fasttorch keeps the lr on the device and computes the former, and rounds the other
    lines as torch does (``add(..., alpha=)``: weight decay, Nesterov's term, and the
    buffer where ``dampening`` is 0). So, given the same values (hyperparameters as the
    state holds them, float32), it equals that twin bit for bit in every path
    (tests/test_optim.py); with ``dampening`` other than 0 the buffer's ``(1 -
    dampening) * g`` is rounded before the sum, one rounding apart. A donated eager step
    on a GPU runs torch's fused kernel and equals ``torch.optim.SGD(fused=True)``. Against
    torch's default eager form with a Python lr (measured, torch 2.13 CPU, four tensors
    up to 3072 x 768, momentum 0.9, lr 1e-2, the same float32 values): 23.5% of the
    parameters differ after one step and 40.0% after ten, by at most 1.4 float32 epsilons
    times the tensor's largest entry. At lr 0 nothing moves, with no NaN.

    Whether there is a momentum buffer is fixed here (``momentum > 0``); the values of
    lr, momentum, dampening and weight_decay live in the state and can be changed with
    :func:`~fasttorch.optim.set_hyperparams` without recompiling.

    Args:
        lr: a float >= 0, or a schedule ``step -> 0-d tensor`` (see ``fasttorch.schedules``).
        momentum: momentum factor, >= 0.
        dampening: dampening of the momentum, in [0, 1].
        nesterov: Nesterov momentum (needs momentum > 0 and dampening 0).
        weight_decay: L2 penalty added to the gradient, >= 0.

    Returns:
        An :class:`SGD` optimizer.

    Raises:
        ValueError: for out-of-range values, as ``torch.optim.SGD`` does.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> opt = optim.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update(params, {"w": torch.ones(2)}, state, torch.tensor(0))
        >>> params["w"], state.count
        (tensor([0.9000, 0.9000]), tensor(1))
    """
    return SGD(lr, momentum, dampening, nesterov, weight_decay)
