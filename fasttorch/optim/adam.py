"""Adam and AdamW: adaptive moments with L2 or decoupled weight decay.

The algorithm is :func:`adam_math`, one parameter's step, readable; :class:`Adam` keeps
its state and hyperparameters and makes one call into ``_adam_kernels``, which chooses
the kernel that computes the same bits for all parameters at once (torch's fused
kernel, the ``_foreach_*`` calls, their in-graph form or one opaque operator). The
algorithm never sees that choice.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

from fasttorch.optim import _adam_kernels, _base
from fasttorch.optim._base import (
    LearningRate,
    OptState,
    check_hyper,
    check_lr,
    make_hyper,
    params_device,
    scheduled_or_fixed_lr,
)

__all__ = ["Adam", "adam", "adam_math", "adamw"]


def adam_math(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    lr: Tensor,
    count: Tensor,
    h: Mapping[str, Tensor],
    *,
    decoupled: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """One Adam(W) step of one parameter, out of place: the new ``p``, ``m``, ``v``.

    The algorithm as ``torch.optim.Adam(foreach=True, capturable=True)`` computes it
    (``_multi_tensor_adam``, the twin of :func:`adam`): its operations in its order,
    the step count ``count`` (already advanced: ``t``), the bias corrections and ``lr``
    as float32 tensors, the hyperparameters ``h`` (``beta1``, ``beta2``, ``eps``,
    ``weight_decay``) as the state's 0-d float32 tensors. ``decoupled``: AdamW's decay.
    :class:`Adam` runs it through the kernels of ``fasttorch/optim/_adam_kernels.py``,
    over all parameters at once, which give these bits for float32 parameters
    (tests/test_optim.py holds each to it), except torch's fused kernel (a donated
    eager GPU step), which is torch's fused form with its own roundings.

    Example:
        >>> one = torch.ones(2)
        >>> h = {k: torch.tensor(x) for k, x in
        ...      {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}.items()}
        >>> p, m, v = adam_math(one, one, 0 * one, 0 * one, torch.tensor(0.1),
        ...                     torch.tensor(1), h, decoupled=False)
        >>> p
        tensor([0.9000, 0.9000])
    """
    beta1, beta2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
    lr = lr.to(torch.float32)
    t = count.to(torch.float32)
    step_size = beta1.pow(t).sub(1).div(lr).reciprocal()  # -lr / (1 - beta1**t)
    bias_correction2_sqrt = beta2.pow(t).sub(1).neg().sqrt()  # sqrt(1 - beta2**t)
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g.addcmul(p, wd)  # g + wd * p, rounded once
    m = m.lerp(g, (1 - beta1).to(m.dtype))
    v = (v * beta2).addcmul(g * (1 - beta2), g)  # beta2 * v + (1 - beta2) * g * g
    # (sqrt(v_hat) + eps) / -lr_t: p + m / denom is the step; at lr 0 it is -inf
    # (eps > 0) and the step a zero, never 0/0.
    denom = (v.sqrt() / bias_correction2_sqrt + eps) / step_size
    return p.addcdiv(m, denom), m, v


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
    opaque: bool = attrs.field(default=True, kw_only=True)

    @property
    def in_place_in_graph(self) -> bool:
        """Whether a donated CPU step updates in place, with torch's fused kernel: opaque.

        A compiled step then runs its update outside its graphs (a graph that holds it
        calls the kernel as one operator)."""
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
        _base.remember(hyper, values)
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

        Out of place by default, the ``_foreach`` form (``foreach=True,
        capturable=True``'s bits). ``inplace=True`` overwrites the parameter, moment
        and gradient tensors instead and returns them (a donated state): torch's fused
        kernel, ``torch.optim.AdamW(fused=True)``'s, one launch per dtype, on a GPU
        (:data:`~fasttorch.optim._base.FUSED_DEVICES`) and, with ``opaque`` (the
        default), on a CPU (in a graph, the operator ``fasttorch::adam_fused_``);
        otherwise the same ``_foreach`` kernels as out of place, so the same bits.
        """
        names = list(params)
        p, g, m, v = self._lists(names, params, grads, opt_state)
        out = _adam_kernels.update(
            p,
            g,
            m,
            v,
            self.learning_rate(opt_state, step),
            opt_state.count,
            opt_state.hyper,
            decoupled=self.decoupled_weight_decay,
            inplace=inplace,
            opaque=self.opaque,
        )
        new = dict(zip(names, out.p))
        if out.m is None or out.v is None:  # written in place: the state's own tensors
            return new, opt_state.replace(count=out.new_count)
        slots = {"exp_avg": dict(zip(names, out.m)), "exp_avg_sq": dict(zip(names, out.v))}
        return new, opt_state.replace(count=out.new_count, slots=slots)

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

        As ``GradScaler.step`` with a fused optimizer: ``grads`` still carry the factor
        ``grad_scale`` (or none: a loss scale, a window's total weight, a clip's
        coefficient), which the kernel divides out, and when ``found_inf`` (a bool 0-d
        tensor, or none) is true the kernel leaves parameters and moments as they are;
        the count does not advance. With ``opaque=True`` on a CPU the kernel is torch's
        fused CPU kernel (in a graph, the operator ``fasttorch::adam_fused_``).
        """
        names = list(params)
        lists = self._lists(names, params, grads, opt_state)
        count = _adam_kernels.fused_update(
            lists,
            self.learning_rate(opt_state, step),
            opt_state.count,
            opt_state.hyper,
            decoupled=self.decoupled_weight_decay,
            grad_scale=grad_scale,
            found_inf=found_inf,
            opaque=self.opaque,
        )
        if count is None:
            return None
        return dict(zip(names, lists[0])), opt_state.replace(count=count)

    def can_fuse(
        self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor], opt_state: OptState
    ) -> bool:
        """Whether :meth:`fused_update` would run torch's fused kernel on these tensors."""
        lists = self._lists(list(params), params, grads, opt_state)
        kernel = _adam_kernels.fused_kernel(
            lists, decoupled=self.decoupled_weight_decay, cpu=self.opaque
        )
        return kernel is not None

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


def adam(
    lr: LearningRate,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    opaque: bool = True,
) -> Adam:
    """Adam: bit for bit ``torch.optim.Adam(fused=True)`` in a step that donates its
    state (the default), ``torch.optim.Adam(foreach=True, capturable=True)`` otherwise
    (amsgrad off).

    Per parameter, at update ``t = count + 1``::

        g = grad + weight_decay * p                 # L2 penalty, coupled
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Equivalent to::

        opt = torch.optim.Adam(params, lr=torch.tensor(lr), betas=betas, eps=eps,
                               weight_decay=weight_decay, fused=True)
        loss.backward(); opt.step(); opt.zero_grad()

    **Which torch it equals.** In a step that donates its state (``fasttorch.step``'s
    default), eager or compiled, on a CPU or a GPU, the update is torch's fused kernel,
    one pass over each tensor, and equals ``torch.optim.Adam(fused=True)`` bit for bit
    given the same values (the hyperparameters as the state holds them, float32:
    ``float(torch.tensor(0.9))`` for 0.9; a schedule's rate rounded to float32, as a
    tensor lr holds it). A compiled CPU step runs it outside its graphs, as the eager
    step does (``opaque``, the default): the update costs no compile time, and the
    window's mean and the clip's coefficient are folded into the factor the kernel divides out, as
    ``GradScaler.step`` hands a loss scale to a fused optimizer (docs/optimizers.md,
    "Opaque update"). Out of place (``donate=False``, under ``vmapped``), in a compiled
    GPU step, and everywhere with ``opaque=False`` on a CPU, the update runs the
    operations of ``torch.optim.Adam(foreach=True, capturable=True)`` in its order
    (``_multi_tensor_adam`` with ``capturable=True``, the form with no host sync: step
    count, bias corrections and lr stay float32 tensors on the device, and the step is
    ``p + m / ((sqrt(v) / sqrt(1 - beta2**t) + eps) / (-lr / (1 - beta1**t)))``) and
    equals that bit for bit (tests/test_optim.py). The fused kernel's roundings differ
    from those by at most a few float32 epsilons a step. torch's default form (no
    ``capturable``, no ``fused``) reads the step count to the host, computes the bias
    corrections in Python doubles and takes ``1 - beta`` from the double ``beta``: it
    differs by roundings. The float32 bias corrections (capturable's and the CUDA fused
    kernel's too) carry their own: ``sqrt(1 - beta2**t)`` is 3.3e-6 relative from the
    double's at t = 2 and 3 for beta2 = 0.999, 1e-7 from t = 10 on (measured). Against
    the default form (torch 2.13 CPU; four tensors up to 3072 x 768, entries ~0.02,
    N(0, 1) gradients, lr 1e-3), measured for the capturable form: with the same
    float32 hyperparameter values 4.8% of the parameters differ after one step and
    17.9% after ten, by at most 1.2 float32 epsilons times the tensor's largest entry;
    with Python's 0.9 and 0.999, 18.5% and 36.0%, of the same size. A chaotic loop (a
    GAN) amplifies those; compare against the twin to tell a port's bug from rounding.
    At lr 0 the step's denominator is -inf, not 0/0: parameters stay as they are, as
    torch's do, with no NaN (with ``eps = 0`` a parameter whose gradients were all 0
    is 0/0 in every torch form and here alike).

    Args:
        lr: a float >= 0, or a schedule ``step -> 0-d tensor`` (see ``fasttorch.schedules``).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
        opaque: in a step that donates its state on a CPU, run torch's fused CPU
            kernel, in a compiled step outside its graphs: the update costs no
            compile time, and it is one pass over each tensor (docs/optimizers.md, "Opaque
            update"). ``False``: the ``_foreach`` form there too, generated by the
            compiler for each model, with ``foreach=True, capturable=True``'s bits.

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
    opaque: bool = True,
) -> Adam:
    """AdamW: bit for bit ``torch.optim.AdamW(fused=True)`` in a step that donates its
    state (the default), ``torch.optim.AdamW(foreach=True, capturable=True)`` otherwise.

    As :func:`adam`, except that the decay shrinks the parameters before the moment
    update instead of entering the gradient: ``p = p * (1 - lr * weight_decay)``, with
    ``lr * weight_decay`` in float32 as torch's tensor lr gives it.

    Equivalent to::

        opt = torch.optim.AdamW(params, lr=torch.tensor(lr), betas=betas, eps=eps,
                                weight_decay=weight_decay, fused=True)
        loss.backward(); opt.step(); opt.zero_grad()

    The twins, the paths and the measured difference from torch's default
    (host-sync) form are :func:`adam`'s (measured at weight_decay 0.1: 4.8% of the
    parameters after one step, 17.9% after ten, with the same float32 values, for the
    capturable form).

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
