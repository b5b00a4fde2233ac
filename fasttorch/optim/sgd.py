"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

from fasttorch import _checks
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
        return OptState(
            count=torch.zeros((), dtype=torch.int64, device=device),
            hyper=make_hyper(self.lr, device, **values),
            slots=slots,
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
        gradient tensors and returns them, running the same kernels (same bits).
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
            if not inplace:
                p, g = [t.clone() for t in p], [t.clone() for t in g]
            torch._foreach_add_(g, _foreach_mul(p, hyper["weight_decay"]))
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
                torch._foreach_add_(bufs, _foreach_mul(g, coef))
                if self.nesterov:
                    torch._foreach_add_(g, _foreach_mul(bufs, momentum))
                else:
                    g = bufs
                slots = {"momentum_buffer": dict(zip(names, bufs))}
            torch._foreach_sub_(p, _foreach_mul(g, lr))
        return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)


def sgd(
    lr: LearningRate,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> SGD:
    """Stochastic gradient descent, numerically ``torch.optim.SGD`` (``_single_tensor_sgd``).

    Per parameter, with ``b`` the momentum buffer::

        g = grad + weight_decay * p
        b = g if first step else momentum * b + (1 - dampening) * g   # when momentum > 0
        g = g + momentum * b if nesterov else b                         # when momentum > 0
        p = p - lr * g

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
