"""``ema``: an exponential moving average of the parameters (and buffers), kept in the state."""

from __future__ import annotations

import functools
from typing import ClassVar, Literal

import torch

from fasttorch import _checks, struct
from fasttorch._checks import warn_once
from fasttorch.phases import GradOut, Metrics, Tensors, no_state_read_after_inner
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap
from fasttorch.substates import SubState

__all__ = ["KEY", "EmaState", "ema", "kept_buffers"]

KEY = "ema"
"""The sub-state key of the average (``state.substates[KEY]``)."""

Buffers = Literal["average", "copy"] | None
_BUFFERS: tuple[Buffers, ...] = ("average", "copy", None)


class EmaState(struct.Record):
    """Sub-state ``"ema"``: the averaged parameters, buffers, and how many updates they saw.

    Attributes:
        params: the moving average of each parameter, same names, shapes and dtypes
            as ``state.params``.
        buffers: the module's persistent buffers as the average keeps them (BatchNorm
            running statistics averaged, or copied, see :func:`ema`'s ``buffers``);
            empty with ``buffers=None``.
        count: int64 0-d, the updates of the average applied so far (skipped
            optimizer updates, and those ``every`` passes over, excluded); the
            warm-up and ``copy_first`` read it.
    """

    params: Tensors
    buffers: Tensors
    count: torch.Tensor

    # Read by fasttorch.evaluation: eval_step(step, use_ema=True) evaluates these.
    eval_params: ClassVar[str] = "params"
    eval_buffers: ClassVar[str] = "buffers"


def kept_buffers(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s persistent buffers: those its ``state_dict`` saves.

    What ``buffers="average"`` or ``"copy"`` keeps, as timm's ``ModelEmaV3`` walks
    ``state_dict()``. A non-persistent buffer (a precomputed table, a mask) is derived
    from the configuration, not trained, so the average would hold a second copy of a
    constant; frozen parameters (carried in ``state.buffers``) do not change either.
    """
    own = {name for name, _ in module.named_buffers()}
    return [k for k in module.state_dict(keep_vars=True) if k in own]


def _init(state: TrainState, *, buffers: Buffers) -> EmaState:
    names = kept_buffers(state.module)
    if buffers is None:
        floating = [k for k in names if state.buffers[k].is_floating_point()]
        if floating:
            warn_once(
                f"ema(buffers=None): the model has buffers ({', '.join(floating[:3])}"
                f"{', ...' if len(floating) > 3 else ''}) that the average does not keep, "
                "so eval_step(step, use_ema=True) evaluates the averaged parameters with "
                "the live buffers (BatchNorm statistics of the trained parameters, not of "
                "the average). Set buffers='average' (timm ModelEmaV3's default) or "
                "buffers='copy' to keep them with the average"
            )
        names = []
    return EmaState(
        params={k: p.detach().clone() for k, p in state.params.items()},
        buffers={k: state.buffers[k].detach().clone() for k in names},
        count=torch.zeros((), dtype=torch.int64, device=state.device),
    )


_DECLARATIONS = {b: SubState(KEY, EmaState, functools.partial(_init, buffers=b)) for b in _BUFFERS}
"""The declaration of the average, per ``buffers`` choice: a copy of the parameters (and
of the kept buffers) when it is added."""


def ema(
    step: Step,
    decay: float,
    *,
    warmup: float | None = None,
    warmup_power: float | None = None,
    warmup_gamma: float = 1.0,
    min_decay: float = 0.0,
    copy_first: int = 0,
    every: int = 1,
    buffers: Buffers = "average",
) -> Step:
    """Keep an exponential moving average of the parameters in ``state.substates["ema"]``.

    After an optimizer update, each averaged parameter moves towards the new
    parameter: ``ema_p = d * ema_p + (1 - d) * p``, one ``torch._foreach_lerp`` for all
    of them, inside the step (and its compiled graph). The average starts as a copy
    of the parameters when the sub-state is added (``step.init`` or the first call).
    An update that did not happen (skipped on non-finite fp16 gradients, or a call on
    which ``fasttorch.optim.every`` did not step: the optimizer's update count did not
    advance) does not advance the average or its ``count``. Evaluate with it through
    ``fasttorch.evaluation.eval_step(step, use_ema=True)``, which also uses its buffers.

    The decay ``d`` of the average's update ``t`` (its ``count``, from 0):

    * ``t < copy_first``: ``d = 0``, the average becomes a copy of the parameters;
    * otherwise ``d = decay``, or with a warm-up ``d = max(min(decay, w_t), min_decay)``:

      - ``warmup=w``: ``w_t = (1 + t) / (w + t)``, the ``num_updates`` rule of
        TensorFlow's ``ExponentialMovingAverage`` (``w = 10``);
      - ``warmup_power=p``: ``w_t = 1 - (1 + s / warmup_gamma) ** -p`` with
        ``s = t + 1 - copy_first``, timm ``ModelEmaV3``'s ``use_warmup`` rule (after
        @crowsonkb; ``p = 2/3`` for long runs, ``3/4`` for shorter ones).

    Buffers (``buffers``), updated at the same times as the parameters:

    * ``"average"`` (default): floating buffers (BatchNorm ``running_mean``,
      ``running_var``) averaged with the same ``d``, integer ones
      (``num_batches_tracked``) copied, as timm ``ModelEmaV3`` does by default;
    * ``"copy"``: every buffer copied from the model, as ``ModelEmaV3(...,
      exclude_buffers=True)`` and ``AveragedModel(use_buffers=False)`` do;
    * ``None``: none kept: evaluation reads the live buffers (it warns when the model
      has floating buffers).

    Only persistent buffers (:func:`kept_buffers`) are kept.

    Recipes:

    * timm, ``ModelEmaV3(model, decay, use_warmup=True, warmup_gamma=g,
      warmup_power=p, min_decay=m, update_after_step=a)`` updated as its
      ``train.py`` does, ``model_ema.update(model, step=num_updates)``:
      ``ema(step, decay, warmup_power=p, warmup_gamma=g, min_decay=m,
      copy_first=a + 1)``; without ``use_warmup``: ``ema(step, decay,
      copy_first=a + 1)``; updated without ``step=``: ``ema(step, decay)``.
    * torchvision's classification reference, ``ExponentialMovingAverage(model,
      decay=1 - alpha)`` (``AveragedModel(use_buffers=True)``) updated when
      ``i % model_ema_steps == 0``, and copying while ``epoch < lr_warmup_epochs``:
      ``ema(step, 1 - alpha, every=model_ema_steps, copy_first=lr_warmup_epochs *
      ceil(steps_per_epoch / model_ema_steps) + 1)``. It averages
      ``num_batches_tracked`` too (truncating the mean to an integer); here it is
      copied, which only BatchNorm with ``momentum=None`` reads.

    Equivalent to::

        ema_model = copy.deepcopy(model)
        t = 0
        for i, batch in enumerate(loader):
            ...
            scaler.step(opt)  # the update; skipped on inf/NaN gradients
            if not skipped and i % every == 0:
                d = 0.0 if t < copy_first else decay  # or the warm-up's
                with torch.no_grad():
                    for ema_v, v in zip(ema_model.state_dict().values(),
                                        model.state_dict().values()):
                        if v.is_floating_point():  # buffers="average"
                            ema_v.lerp_(v, 1 - d)
                        else:
                            ema_v.copy_(v)
                t += 1

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed (not
            compiled: apply ``compiled`` last).
        decay: the weight of the old average, in ``[0, 1)``; ``0.999`` is common.
        warmup: ``None`` or ``w > 1`` for TensorFlow's rule above.
        warmup_power: ``None`` or ``p > 0`` for timm's rule above (not with ``warmup``).
        warmup_gamma: ``> 0``, timm's ``warmup_gamma`` (with ``warmup_power`` only).
        min_decay: the warm-up's smallest decay, in ``[0, decay]`` (with a warm-up only).
        copy_first: how many of the average's first updates copy the parameters.
        every: update the average on the optimizer updates where ``state.step``
            (counting from 0) is a multiple of ``every``: the 1st, ``every + 1``-th, ...
        buffers: ``"average"``, ``"copy"`` or ``None``, see above.

    Returns:
        The step that also updates ``state.substates["ema"]`` (an :class:`EmaState`).

    Raises:
        ValueError: an argument out of its range, or two that do not go together
            (named in the message); ``ema`` already applied, or ``compiled`` inside.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> averaged = fasttorch.ema(fasttorch.step(loss_fn), 0.9)
        >>> state, metrics = averaged(state, torch.randn(8, 4))
        >>> sorted(state.substates), int(state.substates["ema"].count)
        (['ema'], 1)
        >>> timm = fasttorch.ema(fasttorch.step(loss_fn), 0.9998, warmup_power=2 / 3, copy_first=1)
    """
    check_wrap(step, "ema")
    decay = _checks.real(
        "ema",
        "decay",
        decay,
        low=0.0,
        high=1.0,
        high_open=True,
        kind="a number in [0, 1)",
        rule="in [0, 1) (0.999 is common)",
    )
    if warmup is not None:
        valid = "None or a finite number > 1 (10 gives TensorFlow's min(decay, (1 + t) / (10 + t)))"
        warmup = _checks.real(
            "ema", "warmup", warmup, low=1.0, low_open=True, kind=valid, rule=valid
        )
    if warmup_power is not None:
        warmup_power = _checks.real(
            "ema",
            "warmup_power",
            warmup_power,
            low=0.0,
            low_open=True,
            hint="timm uses 2/3 or 3/4.",
        )
        if warmup is not None:
            raise ValueError(
                f"ema: warmup={warmup:g} (TensorFlow's rule) and warmup_power={warmup_power:g} "
                "(timm's) are two warm-up rules; give one of them"
            )
    gamma = _checks.real("ema", "warmup_gamma", warmup_gamma, low=0.0, low_open=True)
    if gamma != 1.0 and warmup_power is None:
        raise ValueError(
            f"ema: warmup_gamma={warmup_gamma!r} scales timm's warm-up, which warmup_power "
            "turns on; give warmup_power too (timm: use_warmup=True, warmup_power=2/3)"
        )
    floor = _checks.real(
        "ema", "min_decay", min_decay, low=0.0, high=decay, rule=f"in [0, decay={decay:g}]"
    )
    if floor > 0.0 and warmup is None and warmup_power is None:
        raise ValueError(
            f"ema: min_decay={min_decay!r} bounds a warm-up's decay from below, but no "
            "warm-up is set (the decay is constant); give warmup= or warmup_power=, or "
            "drop min_decay (timm ignores it without use_warmup)"
        )
    copies = _checks.count("ema", "copy_first", copy_first, low=0)
    k = _checks.count(
        "ema", "every", every, hint="It counts optimizer updates per update of the average."
    )
    if buffers not in _BUFFERS:
        raise ValueError(
            f"ema: buffers must be 'average' (floating buffers averaged, integer ones "
            f"copied), 'copy' or None (not kept), got buffers={buffers!r}"
        )
    inner = step.update

    def decay_at(t: torch.Tensor) -> torch.Tensor | float:
        """The decay of the average's update ``t`` (int64 0-d), in float64 as timm's."""
        if warmup is None and warmup_power is None and copies == 0:
            return decay
        x = t.double()
        if warmup is not None:
            d = torch.clamp((1.0 + x) / (warmup + x), min=floor, max=decay)
        elif warmup_power is not None:
            s = x + float(1 - copies)
            d = torch.clamp(1.0 - (1.0 + s / gamma) ** -warmup_power, min=floor, max=decay)
        else:
            d = torch.full_like(x, decay)
        if copies:
            d = torch.where(t < copies, 0.0, d)
        return d

    @no_state_read_after_inner  # reads its own sub-state, which the inner update leaves
    def update(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
        old: EmaState = state.substates[KEY]
        # The optimizer's own count of applied updates: unchanged where the update was
        # skipped (non-finite gradients, whichever transform found them) or where
        # optim.every did not step. A copy: an in-place update advances the tensor.
        seen = state.opt_state.count.clone()
        new, metrics = inner(state, g)
        on = new.opt_state.count != seen
        if k > 1:
            on = on & (torch.remainder(new.step - 1, k) == 0)
        d = decay_at(old.count)
        # Weight 0 leaves the average exactly as it was; 1 (d = 0) makes it a copy.
        weight = torch.where(on, 1.0 - d, 0.0)
        if isinstance(d, torch.Tensor):
            weight = weight.float()  # 1 - d in float64 first, rounded once, as timm's
        params = _lerp(old.params, new.params, weight)
        kept = old.buffers
        if buffers == "average":
            floating = {n: b for n, b in kept.items() if b.is_floating_point()}
            averaged = _lerp(floating, new.buffers, weight)
            kept = {
                n: averaged[n] if n in averaged else torch.where(on, new.buffers[n], b)
                for n, b in kept.items()
            }
        elif buffers == "copy":
            kept = {n: torch.where(on, new.buffers[n], b) for n, b in kept.items()}
        sub = EmaState(params=params, buffers=kept, count=old.count + on.long())
        return new.with_substate(KEY, sub), metrics

    return step.with_phases("ema", update=update, substate=_DECLARATIONS[buffers])


def _lerp(olds: Tensors, news: Tensors, weight: torch.Tensor) -> Tensors:
    """``olds[k].lerp(news[k], weight)`` for each ``k`` of ``olds``, one foreach call."""
    if not olds:
        return {}
    names = list(olds)
    a = [olds[k] for k in names]
    weights = [weight.to(t.dtype) for t in a]
    return dict(zip(names, torch._foreach_lerp(a, [news[k] for k in names], weights)))
