"""Adam and AdamW: adaptive moments with L2 or decoupled weight decay."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from fasttorch import _compat
from fasttorch.optim import _fused
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
    opaque: bool = attrs.field(default=False, kw_only=True)

    @property
    def in_place_in_graph(self) -> bool:
        """Whether a donated compiled CPU step updates in place: as one operator, opaque."""
        return self.opaque

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
        if not isinstance(self.opaque, bool):
            raise TypeError(f"{owner}: opaque must be a bool, got {self.opaque!r}")

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """Count 0, hyperparameters as 0-d float32 tensors, zero first and second moments."""
        device = params_device(params)
        values = {
            "beta1": self.betas[0],
            "beta2": self.betas[1],
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        hyper = make_hyper(self.lr, device, **values)
        _fused.remember(hyper, values)
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
        kernels in the same order, so they give the same bits. In place on a GPU
        (:data:`~fasttorch.optim._fused.FUSED_DEVICES`) the update is torch's fused
        kernel, ``torch.optim.AdamW(fused=True)``'s, one launch per dtype. With
        ``opaque=True``, in place in a CPU graph (a donated compiled step) is one
        operator, ``fasttorch::adam_``, that runs the eager in-place form.
        """
        names = list(params)
        p = [params[n] for n in names]
        # In a graph, in place only as one opaque operator (a donated CPU step).
        opaque = inplace and self.opaque and in_cpu_graph(p)
        inplace = inplace and (opaque or not torch.compiler.is_compiling())
        # In place, the count is the state's own tensor too (no allocation at the peak).
        count = opt_state.count.add_(1) if inplace else opt_state.count + 1
        if not names:
            return {}, opt_state.replace(count=count)
        h = opt_state.hyper
        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            g = [grads[n] for n in names]
            m = [opt_state.slots["exp_avg"][n] for n in names]
            v = [opt_state.slots["exp_avg_sq"][n] for n in names]
            if opaque:
                hyper = [h[k] for k in ("beta1", "beta2", "eps", "weight_decay")]
                decoupled = self.decoupled_weight_decay
                torch.ops.fasttorch.adam_(p, g, m, v, lr, count, *hyper, decoupled)
                return dict(zip(names, p)), opt_state.replace(count=count)
            if in_cpu_graph(p) and not inplace:
                p, m, v = self._graph_update(p, g, m, v, lr, count, h)
                slots = {"exp_avg": dict(zip(names, m)), "exp_avg_sq": dict(zip(names, v))}
                return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)
            fused = _fused.kernel(self._kernel_name, (p, g, m, v)) if inplace else None
            if fused is not None:
                self._fused(fused, (p, g, m, v), lr, count, h)
                return dict(zip(names, p)), opt_state.replace(count=count)
            if not inplace:
                p, g, m, v = ([t.clone() for t in ts] for ts in (p, g, m, v))
            self._foreach(p, g, m, v, lr, count, h, inplace=inplace)
        slots = {"exp_avg": dict(zip(names, m)), "exp_avg_sq": dict(zip(names, v))}
        return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)

    @property
    def _kernel_name(self) -> str:
        return "adamw" if self.decoupled_weight_decay else "adam"

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
        moments as they are; the count does not advance.
        """
        names = list(params)
        lists = self._lists(names, params, grads, opt_state)
        fused = _fused.kernel(self._kernel_name, lists)
        if fused is None:
            return None
        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            count = opt_state.count.add_(found_inf.logical_not())
            self._fused(
                fused, lists, lr, count, opt_state.hyper, grad_scale, _fused.float_flag(found_inf)
            )
        return dict(zip(names, lists[0])), opt_state.replace(count=count)

    def can_fuse(
        self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor], opt_state: OptState
    ) -> bool:
        """Whether :meth:`fused_update` would run torch's fused kernel on these tensors."""
        lists = self._lists(list(params), params, grads, opt_state)
        return _fused.kernel(self._kernel_name, lists) is not None

    @staticmethod
    def _lists(
        names: list[str],
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
    ) -> list[list[Tensor]]:
        slots = opt_state.slots
        return [
            [params[n] for n in names],
            [grads[n] for n in names],
            [slots["exp_avg"][n] for n in names],
            [slots["exp_avg_sq"][n] for n in names],
        ]

    def _fused(
        self,
        fused: Callable[..., Any],
        lists: Sequence[list[Tensor]],
        lr: Tensor,
        count: Tensor,
        h: dict[str, Tensor],
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> None:
        """torch's fused Adam(W) over ``lists`` (params, grads, m, v), one launch a dtype.

        ``count`` is already the new count; the kernel reads the step as float32, as
        ``torch.optim``'s per-parameter ``state["step"]`` (the same tensor for all).
        """
        steps = count.to(torch.float32)
        lr = lr.to(torch.float32)
        hyper = {k: _fused.host_float(h[k]) for k in ("beta1", "beta2", "weight_decay", "eps")}
        for p, g, m, v in _fused.by_dtype(lists):
            fused(
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

    def _foreach(
        self,
        p: list[Tensor],
        g: list[Tensor],
        m: list[Tensor],
        v: list[Tensor],
        lr: Tensor,
        count: Tensor,
        h: dict[str, Tensor],
        *,
        inplace: bool,
    ) -> None:
        """``update``'s arithmetic as ``_foreach_*`` calls, in place on ``p``, ``m``, ``v``
        (``g`` is spent).

        The calls of ``torch.optim.Adam(foreach=True, capturable=True)``
        (``_multi_tensor_adam``), in its order and with its operands, so the same bits
        (:func:`adam`). Eager, every call takes CUDA's multi-tensor path: 0-d factors
        in the lists' dtype (float32: the cast from float64 is the one the op itself
        would make, so the same bits), the lerp weight, weight decay and eps as Python
        floats (read once per change, :func:`_fused.host_float`; the same values and
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
            return x if graph else x.to(_fused.factor_dtype(dtype))

        step_size, bias_correction2_sqrt = _bias_corrections(lr, count, beta1, beta2)
        if self.decoupled_weight_decay:
            torch._foreach_mul_(p, factor(1 - lr.to(torch.float32) * wd))
        elif host:
            # torch's add(p, alpha=weight_decay): one rounding (a fused multiply-add)
            alpha = _fused.host_float(wd)
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
            torch._foreach_lerp_(m, g, _host_weight(_fused.host_float(beta1), dtype))
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
            # A Python float, read once per change (_fused.host_float): CPU's kernel
            # reads a 0-d tensor operand to the host on every call.
            torch._foreach_add_(denom, _fused.host_float(eps))
        else:
            # A list: dynamo reads a bare 0-d tensor operand of _foreach_add_ to the host.
            torch._foreach_add_(denom, [eps] * len(denom))
        # denom / step_size = -(sqrt(v_hat) + eps) / lr_t, so that p + m / denom is the
        # step; at lr 0 it is -inf (eps > 0), and m / -inf a zero step, never 0/0.
        torch._foreach_div_(denom, factor(step_size))
        torch._foreach_addcdiv_(p, m, denom)

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
        hold the two to the same bits), with the 0-d factors computed once
        (:func:`computed_once`) instead of inlined into every parameter's expression.
        Each operation is one ``_foreach`` call over all tensors, which inductor lowers
        to the per-tensor expressions a loop would give: dynamo's tracing time grows
        with the calls it traces, so a loop over tensors costs it one call per tensor
        and operation (docs/design.md, "Compile time"). Only ``lerp`` is per tensor:
        inductor has no CPU lowering for ``_foreach_lerp`` with a tensor weight.
        """
        beta1, beta2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
        step_size, bias_correction2_sqrt = _bias_corrections(lr, count, beta1, beta2)
        decay = 1 - lr.to(torch.float32) * wd if self.decoupled_weight_decay else wd
        decay, w, beta2, rest2, step_size, bias_correction2_sqrt, eps = computed_once(
            decay, 1 - beta1, beta2, 1 - beta2, step_size, bias_correction2_sqrt, eps
        )
        if self.decoupled_weight_decay:
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


def _bias_corrections(
    lr: Tensor, count: Tensor, beta1: Tensor, beta2: Tensor
) -> tuple[Tensor, Tensor]:
    """``(-lr / (1 - beta1**t), sqrt(1 - beta2**t))`` at ``t = count`` (the new count),
    as ``torch.optim.Adam(capturable=True)`` computes them: in float32 (its step count
    is a float32 tensor, its lr a float32 tensor), the first as
    ``1 / ((beta1**t - 1) / lr)``, in that order of roundings."""
    t = count.to(torch.float32)
    step_size = beta1.pow(t).sub(1).div(lr.to(torch.float32)).reciprocal()
    bias_correction2_sqrt = beta2.pow(t).sub(1).neg().sqrt()
    return step_size, bias_correction2_sqrt


def _adam_impl(
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
) -> None:
    """``Adam._foreach`` in place: what a donated eager step runs, so the same bits."""
    h = {"beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    opt = Adam(0.0, decoupled_weight_decay=decoupled)
    with torch.no_grad():
        opt._foreach(params, grads, exp_avgs, exp_avg_sqs, lr, count, h, inplace=True)


# Adam's update as one operator the compiler does not look into (``Adam.opaque``):
# inside a donated step inductor calls it on the state's own tensors, and generates
# no code per parameter tensor. torch.library.custom_op is public API.
_adam_op = torch.library.custom_op(
    "fasttorch::adam_", _adam_impl, mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs")
)


@_adam_op.register_fake
def _adam_fake(*args: Any) -> None:
    """Nothing to compute: the operator writes into its arguments and returns nothing."""


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


def adam(
    lr: LearningRate,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    opaque: bool = False,
) -> Adam:
    """Adam: bit for bit ``torch.optim.Adam(foreach=True, capturable=True)`` (amsgrad off).

    Per parameter, at update ``t = count + 1``::

        g = grad + weight_decay * p                 # L2 penalty, coupled
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Equivalent to::

        opt = torch.optim.Adam(params, lr=torch.tensor(lr), betas=betas, eps=eps,
                               weight_decay=weight_decay, foreach=True, capturable=True)
        loss.backward(); opt.step(); opt.zero_grad()

    **Which torch it equals.** The update runs that configuration's operations in its
    order (``_multi_tensor_adam`` with ``capturable=True``, the form with no host sync:
    step count, bias corrections and lr stay float32 tensors on the device, and the
    step is ``p + m / ((sqrt(v) / sqrt(1 - beta2**t) + eps) / (-lr / (1 - beta1**t)))``),
    so on the same device and given the same values (the hyperparameters as the
    state holds them, float32: ``float(torch.tensor(0.9))`` for 0.9; a schedule's rate
    rounded to float32, as a tensor lr holds it) the two agree bit for bit, eagerly, in
    place, compiled and with ``opaque=True`` (tests/test_optim.py). A donated eager step
    on a GPU runs torch's fused kernel instead, and equals
    ``torch.optim.Adam(fused=True)`` bit for bit. torch's default form (no
    ``capturable``, no ``fused``) reads the step count to the host, computes the bias
    corrections in Python doubles and takes ``1 - beta`` from the double ``beta``: it
    differs by roundings. The float32 bias corrections (capturable's and the CUDA fused
    kernel's too) carry their own: ``sqrt(1 - beta2**t)`` is 3.3e-6 relative from the
    double's at t = 2 and 3 for beta2 = 0.999, 1e-7 from t = 10 on (measured). Against
    the default form (torch 2.13 CPU; four tensors up to 3072 x 768, entries ~0.02,
    N(0, 1) gradients, lr 1e-3), measured: with the same float32 hyperparameter
    values 4.8% of the parameters differ after one step and 17.9% after ten, by at most
    1.2 float32 epsilons times the tensor's largest entry; with Python's 0.9 and 0.999,
    18.5% and 36.0%, of the same size. A chaotic loop (a GAN) amplifies those; compare
    against the twin to tell a port's bug from rounding. At lr 0 the step's denominator
    is -inf, not 0/0: parameters stay as they are, as torch's do, with no NaN (with
    ``eps = 0`` a parameter whose gradients were all 0 is 0/0 in every torch form and
    here alike).

    Args:
        lr: a float >= 0, or a schedule ``step -> 0-d tensor`` (see ``fasttorch.schedules``).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
        opaque: in a compiled step that donates its state on a CPU, run the update as
            one operator the compiler does not look into (the eager step's kernels):
            its compile time no longer grows with the parameter tensors, each step's
            update takes what the eager one takes (docs/optimizers.md, "Opaque update").

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
    return Adam(lr, betas, eps, weight_decay, decoupled_weight_decay=False, opaque=opaque)


def adamw(
    lr: LearningRate,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    opaque: bool = False,
) -> Adam:
    """AdamW: bit for bit ``torch.optim.AdamW(foreach=True, capturable=True)``.

    As :func:`adam`, except that the decay shrinks the parameters before the moment
    update instead of entering the gradient: ``p = p * (1 - lr * weight_decay)``, with
    ``lr * weight_decay`` in float32 as torch's tensor lr gives it.

    Equivalent to::

        opt = torch.optim.AdamW(params, lr=torch.tensor(lr), betas=betas, eps=eps,
                                weight_decay=weight_decay, foreach=True, capturable=True)
        loss.backward(); opt.step(); opt.zero_grad()

    The twins, the paths and the measured difference from torch's default
    (host-sync) form are :func:`adam`'s (measured at weight_decay 0.1: 4.8% of the
    parameters after one step, 17.9% after ten, with the same float32 values); a
    donated eager GPU step equals ``torch.optim.AdamW(fused=True)``.

    Args:
        lr: a float >= 0, or a schedule ``step -> 0-d tensor`` (see ``fasttorch.schedules``).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled decay factor, >= 0.
        opaque: as in :func:`adam`.

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
    return Adam(lr, betas, eps, weight_decay, decoupled_weight_decay=True, opaque=opaque)
