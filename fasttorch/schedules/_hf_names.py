"""``schedules.hf``: a Hugging Face scheduler type by its name, as ``get_scheduler``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fasttorch import _checks
from fasttorch.schedules._base import Schedule
from fasttorch.schedules._hf import (
    HFConstantWithWarmup,
    HFCosine,
    HFCosineWarmupWithMinLR,
    HFCosineWithRestarts,
    HFInverseSqrt,
    HFLinear,
    HFPolynomial,
    HFWarmupStableDecay,
)
from fasttorch.schedules._shapes import Constant

__all__ = ["hf"]


# get_scheduler's name -> (class, whether it takes total_steps, its kwargs -> our fields)
_KWARGS: dict[str, tuple[Callable[..., Schedule], bool, dict[str, str]]] = {
    "linear": (HFLinear, True, {}),
    "cosine": (HFCosine, True, {"num_cycles": "num_cycles"}),
    "cosine_with_restarts": (HFCosineWithRestarts, True, {"num_cycles": "num_cycles"}),
    "polynomial": (HFPolynomial, True, {"lr_end": "lr_end", "power": "power"}),
    "constant_with_warmup": (HFConstantWithWarmup, False, {}),
    "inverse_sqrt": (HFInverseSqrt, False, {"timescale": "timescale"}),
    "cosine_with_min_lr": (
        HFCosine,
        True,
        {"num_cycles": "num_cycles", "min_lr": "", "min_lr_rate": "min_lr_rate"},
    ),
    "cosine_warmup_with_min_lr": (
        HFCosineWarmupWithMinLR,
        True,
        {
            "num_cycles": "num_cycles",
            "min_lr": "",
            "min_lr_rate": "min_lr_rate",
            "warmup_lr_rate": "warmup_lr_rate",
        },
    ),
}
_WSD_KWARGS = (
    "num_decay_steps",
    "num_stable_steps",
    "warmup_type",
    "decay_type",
    "min_lr_ratio",
    "num_cycles",
)
_METRIC_DRIVEN = ("reduce_lr_on_plateau", "greedy")
_NAMES = ("constant", *_KWARGS, "warmup_stable_decay")


def hf(
    name: str,
    peak: float,
    *,
    warmup_steps: int | None = None,
    total_steps: int | None = None,
    **kwargs: Any,
) -> Schedule:
    """The schedule ``transformers.get_scheduler(name, ...)`` builds, as a schedule.

    ``hf(name, lr, warmup_steps=w, total_steps=n, **kw)`` gives the optimizer's rate at
    every step as ``get_scheduler(name, optimizer, num_warmup_steps=w,
    num_training_steps=n, scheduler_specific_kwargs=kw)`` does for an optimizer built
    with ``lr``, its ``LambdaLR`` stepped once per ``opt.step()``. ``name`` is one of
    Hugging Face's ``SchedulerType`` values (``TrainingArguments.lr_scheduler_type``) and
    ``kw`` its ``lr_scheduler_kwargs``:

    - ``"linear"``, ``"cosine"`` (``num_cycles``), ``"cosine_with_restarts"``
      (``num_cycles``), ``"polynomial"`` (``lr_end``, ``power``), ``"cosine_with_min_lr"``
      and ``"cosine_warmup_with_min_lr"`` (``num_cycles``, ``min_lr`` or ``min_lr_rate``;
      the second also ``warmup_lr_rate``): need ``warmup_steps`` and ``total_steps``;
    - ``"constant_with_warmup"``, ``"inverse_sqrt"`` (``timescale``): ``warmup_steps``;
    - ``"warmup_stable_decay"``: ``warmup_steps``, ``num_decay_steps``, and
      ``num_stable_steps`` or ``total_steps`` (the stable phase is then what the
      warm-up and decay leave); ``warmup_type``, ``decay_type`` (``"linear"``,
      ``"cosine"``, ``"1-sqrt"``), ``min_lr_ratio``, ``num_cycles``;
    - ``"constant"``: ``peak`` at every step.

    ``"reduce_lr_on_plateau"`` and ``"greedy"`` follow a metric that the loop measures,
    not the step: give the optimizer a float lr and change it from the loop with
    ``fasttorch.optim.set_hyperparams``.

    Equivalent to::

        opt = torch.optim.AdamW(model.parameters(), lr=peak)
        sched = transformers.get_scheduler(name, opt, num_warmup_steps=warmup_steps,
                                           num_training_steps=total_steps,
                                           scheduler_specific_kwargs=kwargs)
        for batch in loader:                  # the k-th update uses hf(...)(k)
            loss_fn(model, batch).backward()
            opt.step(); sched.step(); opt.zero_grad()

    Args:
        name: the scheduler type, as ``get_scheduler`` spells it.
        peak: the optimizer's learning rate, reached at the end of the warm-up.
        warmup_steps: ``num_warmup_steps``, an int >= 0.
        total_steps: ``num_training_steps``, an int >= 1.
        **kwargs: ``scheduler_specific_kwargs``.

    Returns:
        The schedule: :class:`HFLinear`, :class:`HFCosine`, ...; :class:`Constant` for
        ``"constant"``.

    Example:
        >>> import torch
        >>> from fasttorch import schedules
        >>> s = schedules.hf("linear", 1.0, warmup_steps=2, total_steps=6)
        >>> [float(s(torch.tensor(k))) for k in range(7)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    kind = str(getattr(name, "value", name))
    api = f"schedules.hf({kind!r})"
    if kind in _METRIC_DRIVEN:
        raise ValueError(
            f"{api}: this Hugging Face scheduler follows a metric measured in the loop, not "
            "the step, so it is not a schedule. Give the optimizer a float lr and change it "
            "from the loop with fasttorch.optim.set_hyperparams(state.opt_state, lr=...)."
        )
    if kind not in _NAMES:
        raise ValueError(
            f"schedules.hf: unknown scheduler type {kind!r}; the types are {list(_NAMES)} "
            "(transformers.SchedulerType values)."
        )

    def unknown(valid: tuple[str, ...]) -> None:
        extra = sorted(set(kwargs) - set(valid))
        if extra:
            raise _checks.ArgumentTypeError(
                f"{api}: unexpected scheduler_specific_kwargs {extra}; this type takes "
                f"{list(valid) or 'none'}."
            )

    def need(value: int | None, arg: str, hf_arg: str, low: int) -> int:
        if value is None:
            raise ValueError(f"{api} requires {arg}= (get_scheduler's {hf_arg}).")
        return _checks.count(api, arg, value, low=low, hint="A number of steps.")

    if kind == "constant":
        unknown(())
        if warmup_steps:
            raise ValueError(
                f"{api}: 'constant' has no warm-up (get_scheduler ignores num_warmup_steps "
                f"for it), got warmup_steps={warmup_steps}. Use 'constant_with_warmup', or "
                "leave warmup_steps out."
            )
        return Constant(peak)
    if kind == "warmup_stable_decay":
        unknown(_WSD_KWARGS)
        w = need(warmup_steps, "warmup_steps", "num_warmup_steps", 0)
        if "num_decay_steps" not in kwargs:
            raise ValueError(f"{api} requires num_decay_steps= (a scheduler_specific_kwarg).")
        decay = _checks.count(api, "num_decay_steps", kwargs["num_decay_steps"], low=0)
        stable = kwargs.get("num_stable_steps")
        if stable is None:
            total = need(total_steps, "total_steps", "num_training_steps; or num_stable_steps", 1)
            stable = total - w - decay
            if stable < 0:
                raise ValueError(
                    f"{api}: total_steps={total} is less than warmup_steps + num_decay_steps "
                    f"= {w} + {decay}. Raise total_steps or shorten the phases."
                )
        elif total_steps is not None and w + stable + decay != total_steps:
            raise ValueError(
                f"{api}: warmup_steps + num_stable_steps + num_decay_steps = {w} + {stable} "
                f"+ {decay} is not total_steps={total_steps} (Hugging Face warns and ignores "
                "total_steps). Pass one of num_stable_steps and total_steps."
            )
        fields = {k: kwargs[k] for k in _WSD_KWARGS[2:] if k in kwargs}
        return HFWarmupStableDecay(peak, w, stable, decay, **fields)
    cls, takes_total, names = _KWARGS[kind]
    unknown(tuple(names))
    args: list[Any] = [peak, need(warmup_steps, "warmup_steps", "num_warmup_steps", 0)]
    if takes_total:
        args.append(need(total_steps, "total_steps", "num_training_steps", 1))
    fields = {names[k]: v for k, v in kwargs.items() if names[k]}
    if "min_lr" in names:
        if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise ValueError(f"{api} requires exactly one of min_lr= and min_lr_rate=.")
        if "min_lr" in kwargs:
            min_lr = _checks.real(api, "min_lr", kwargs["min_lr"], low=0.0)
            fields["min_lr_rate"] = min_lr / _checks.real(api, "peak", peak, low=0.0, low_open=True)
    return cls(*args, **fields)
