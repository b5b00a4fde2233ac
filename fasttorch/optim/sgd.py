"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay.

The algorithm is :func:`sgd_math`, one parameter's step, readable; :class:`SGD` keeps
its state and hyperparameters and makes one call into ``_sgd_kernels``, which chooses
the kernel (torch's fused kernel, or the ``_foreach_*`` calls) for all parameters at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

from fasttorch import _checks
from fasttorch.optim import _base, _sgd_kernels
from fasttorch.optim._base import (
    LearningRate,
    OptState,
    check_hyper,
    check_lr,
    make_hyper,
    params_device,
    scheduled_or_fixed_lr,
)

__all__ = ["SGD", "sgd", "sgd_math"]


def sgd_math(
    p: Tensor,
    g: Tensor,
    buf: Tensor | None,
    lr: Tensor,
    count: Tensor,
    h: Mapping[str, Tensor],
    *,
    nesterov: bool,
) -> tuple[Tensor, Tensor | None]:
    """One SGD step of one parameter, out of place: the new ``p`` and momentum ``buf``.

    The algorithm as ``torch.optim.SGD(foreach=True)`` with a tensor lr computes it
    under ``torch.compile`` (the twin of :func:`sgd`): ``count`` is the step count
    before this update (0 on the first), ``h`` the state's 0-d float32 hyperparameters
    (``weight_decay``, and with a buffer ``momentum``, ``dampening``); ``buf`` is
    ``None`` without momentum. :class:`SGD` runs it through the kernels of
    ``fasttorch/optim/_sgd_kernels.py``, over all parameters at once, which give these
    bits for float32 parameters (tests/test_optim.py), except torch's fused kernel (a
    donated eager GPU step), torch's fused form.

    Example:
        >>> h = {"weight_decay": torch.tensor(0.0)}
        >>> sgd_math(torch.ones(2), torch.ones(2), None, torch.tensor(0.1), torch.tensor(0), h,
        ...          nesterov=False)
        (tensor([0.9000, 0.9000]), None)
    """
    g = g.addcmul(p, h["weight_decay"])  # g + weight_decay * p, rounded once
    if buf is not None:
        momentum = h["momentum"]
        # The first step copies g into the (zero) buffer: a coefficient of 1 there.
        coef = torch.where(count == 0, torch.ones_like(momentum), 1 - h["dampening"])
        buf = buf * momentum + g * coef
        g = g.addcmul(buf, momentum) if nesterov else buf  # g + momentum * buf, rounded once
    return p - g * lr.to(p.dtype), buf


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
    opaque: bool = attrs.field(default=True, kw_only=True)

    @property
    def in_place_in_graph(self) -> bool:
        """Whether a donated CPU step updates in place, with torch's fused kernel: opaque.

        A compiled step then runs its update outside its graphs (a graph that holds it
        calls the kernel as one operator)."""
        return self.opaque

    def __attrs_post_init__(self) -> None:
        check_lr("sgd", self.lr)
        _checks.flag("sgd", "opaque", self.opaque)
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
        with torch.no_grad():
            p, g, bufs = self._lists(names, params, grads, opt_state)
            p, bufs = _sgd_kernels.update(
                p,
                g,
                bufs,
                self.learning_rate(opt_state, step),
                opt_state.count,
                opt_state.hyper,
                nesterov=self.nesterov,
                inplace=inplace,
                opaque=self.opaque,
            )
        if bufs is None:  # no momentum, or written in place: the state's own slots
            return dict(zip(names, p)), opt_state.replace(count=count)
        slots = {"momentum_buffer": dict(zip(names, bufs))}
        return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)

    def _lists(
        self,
        names: list[str],
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None]:
        bufs = None
        if self._has_momentum:
            bufs = [opt_state.slots["momentum_buffer"][n] for n in names]
        return [params[n] for n in names], [grads[n] for n in names], bufs

    def fused_update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> tuple[dict[str, Tensor], OptState] | None:
        """``update(..., inplace=True)`` through torch's fused kernel, skipped where
        ``found_inf``; ``None`` (nothing done) where the kernel does not apply.

        As ``GradScaler.step`` with a fused optimizer: ``grads`` still carry the loss
        scale ``grad_scale`` (or none), which the kernel divides out, and when
        ``found_inf`` (a bool 0-d tensor) is true the kernel leaves parameters and
        buffers as they are; the count does not advance.
        """
        names = list(params)
        p, g, bufs = self._lists(names, params, grads, opt_state)
        with torch.no_grad():
            ran = _sgd_kernels.fused_update(
                p,
                g,
                bufs,
                self.learning_rate(opt_state, step),
                opt_state.hyper,
                nesterov=self.nesterov,
                grad_scale=grad_scale,
                found_inf=found_inf,
                count=opt_state.count,
                opaque=self.opaque,
            )
        if not ran:
            return None
        count = opt_state.count + (1 if found_inf is None else found_inf.logical_not())
        return dict(zip(names, p)), opt_state.replace(count=count)

    def can_fuse(
        self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor], opt_state: OptState
    ) -> bool:
        """Whether :meth:`fused_update` would run torch's fused kernel on these tensors."""
        names = list(params)
        p, g, bufs = self._lists(names, params, grads, opt_state)
        half = bufs is not None and p[0].dtype not in (torch.float32, torch.float64)
        if self.opaque and names and p[0].device.type == "cpu" and not half:
            mine = [p, g] if bufs is None else [p, g, bufs]
            if torch.compiler.is_compiling() or self.dampening == 0:
                return _sgd_kernels.fused_kernel(mine, cpu=True) is not None
        lists = _sgd_kernels.fused_lists(p, g, bufs, opt_state.hyper) if names else None
        return lists is not None and _sgd_kernels.fused_kernel(lists) is not None


def sgd(
    lr: LearningRate,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    opaque: bool = True,
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
    dampening) * g`` is rounded before the sum, one rounding apart. A donated step on a
    GPU (eager) or a CPU (eager or compiled, ``opaque``, the default) runs torch's fused
    kernel and equals ``torch.optim.SGD(fused=True)``. Against
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
        opaque: in a step that donates its state on a CPU, run torch's fused CPU
            kernel, in a compiled step outside its graphs (as
            :func:`~fasttorch.optim.adam`'s): ``torch.optim.SGD(fused=True)``'s
            bits, where the dampening is 0 and the parameters are not half precision
            with momentum (torch's CPU kernel gives wrong buffers for bfloat16 there);
            elsewhere, and with ``False``, the ``_foreach`` form above.

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
    return SGD(lr, momentum, dampening, nesterov, weight_decay, opaque=opaque)
