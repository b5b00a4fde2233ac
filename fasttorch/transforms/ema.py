"""``ema``: an exponential moving average of the parameters, kept in the state."""

from __future__ import annotations

from typing import ClassVar

import torch

from fasttorch import _checks, struct
from fasttorch.phases import GradOut, Metrics, Tensors, no_state_read_after_inner
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap
from fasttorch.substates import SubState

__all__ = ["KEY", "EmaState", "ema"]

KEY = "ema"
"""The sub-state key of the average (``state.substates[KEY]``)."""


class EmaState(struct.Record):
    """Sub-state ``"ema"``: the averaged parameters and how many updates they have seen.

    Attributes:
        params: the moving average of each parameter, same names, shapes and dtypes
            as ``state.params``.
        count: int64 0-d, the EMA updates applied so far (skipped steps excluded);
            the warm-up reads it.
    """

    params: Tensors
    count: torch.Tensor

    # Read by fasttorch.evaluation: eval_step(step, use_ema=True) evaluates these.
    eval_params: ClassVar[str] = "params"


def _init(state: TrainState) -> EmaState:
    return EmaState(
        params={k: p.detach().clone() for k, p in state.params.items()},
        count=torch.zeros((), dtype=torch.int64, device=state.device),
    )


SUBSTATE = SubState(KEY, EmaState, _init)
"""The declaration of the average: a copy of the parameters when it is added."""


def ema(step: Step, decay: float, *, warmup: float | None = None) -> Step:
    """Keep an exponential moving average of the parameters in ``state.substates["ema"]``.

    After every optimizer update, each averaged parameter moves towards the new
    parameter: ``ema_p = decay * ema_p + (1 - decay) * p``, one ``torch._foreach_lerp``
    for all of them, inside the step (and its compiled graph). The average starts as a
    copy of the parameters when the sub-state is added (``step.init`` or the first
    call). A skipped fp16 update (non-finite gradients) does not advance the average
    or its ``count``. Evaluate with it through
    ``fasttorch.evaluation.eval_step(step, use_ema=True)``.

    With ``warmup=w``, update ``t`` (counting from 0) uses
    ``min(decay, (1 + t) / (w + t))``: the ``num_updates`` rule of TensorFlow's
    ``ExponentialMovingAverage`` (``w = 10``), so early averages do not stay
    anchored at the random initialization.

    Equivalent to::

        ema_model = copy.deepcopy(model)
        ...
        scaler.step(opt)  # the update; skipped on inf/NaN gradients
        if not skipped:
            for ema_p, p in zip(ema_model.parameters(), model.parameters()):
                ema_p.lerp_(p, 1 - decay)

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed (not
            compiled: apply ``compiled`` last).
        decay: the weight of the old average, in ``[0, 1)``; ``0.999`` is common.
        warmup: ``None`` (constant ``decay``) or ``w > 1`` for the rule above.

    Returns:
        The step that also updates ``state.substates["ema"]`` (an :class:`EmaState`).

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> averaged = fasttorch.ema(fasttorch.step(loss_fn), 0.9)
        >>> state, metrics = averaged(state, torch.randn(8, 4))
        >>> sorted(state.substates), int(state.substates["ema"].count)
        (['ema'], 1)
    """
    check_wrap(step, "ema")
    _checks.real(
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
        _checks.real("ema", "warmup", warmup, low=1.0, low_open=True, kind=valid, rule=valid)
    inner = step.update
    rate = 1.0 - float(decay)

    @no_state_read_after_inner
    def update(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
        old: EmaState = state.substates[KEY]
        new, metrics = inner(state, g)
        # The update phase reports the final skip flag (fasttorch.phases.update_phase),
        # whichever transforms set it and in whatever order they wrap this one.
        skip = metrics.get("skipped")
        weight: float | torch.Tensor = rate
        if warmup is not None:
            t = old.count.double()
            d = torch.clamp((1.0 + t) / (warmup + t), max=float(decay))
            weight = (1.0 - d).float()
        if skip is not None:
            # Weight 0 leaves the average exactly as it was (params stay finite when
            # an update is skipped): a tensor op, no host sync.
            weight = torch.where(skip, 0.0, weight)
        names = list(old.params)
        olds = list(old.params.values())
        news = [new.params[k] for k in names]
        if isinstance(weight, torch.Tensor):
            averaged = torch._foreach_lerp(olds, news, [weight.to(o.dtype) for o in olds])
        else:
            averaged = torch._foreach_lerp(olds, news, weight)
        count = old.count + 1 if skip is None else old.count + (~skip).long()
        sub = EmaState(params=dict(zip(names, averaged)), count=count)
        return new.with_substate(KEY, sub), metrics

    return step.with_phases("ema", update=update, substate=SUBSTATE)
