"""``load_torch_state_dict``: a ``torch.optim`` optimizer's state moved into a state.

The function reads and returns a :class:`~fasttorch.TrainState`, which is built over
the optimizers of this package. It is typed against :class:`TrainStateLike`, the part
of ``TrainState`` it uses, so that the optimizers never import the state (an import
circle: ``fasttorch.state`` imports ``fasttorch.optim``); given a ``TrainState`` it
returns a ``TrainState``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from fasttorch.optim._base import Optimizer, OptState

__all__ = ["TrainStateLike", "load_torch_state_dict"]

TrainStateT = TypeVar("TrainStateT", bound="TrainStateLike")


class TrainStateLike(Protocol):
    """What :func:`load_torch_state_dict` reads of a :class:`~fasttorch.TrainState`."""

    @property
    def params(self) -> Mapping[str, Tensor]: ...
    @property
    def opt_state(self) -> OptState: ...
    @property
    def step(self) -> Tensor: ...
    @property
    def optimizer(self) -> Optimizer: ...
    def replace(self: TrainStateT, **changes: Any) -> TrainStateT: ...


def load_torch_state_dict(
    state: TrainStateT,
    state_dict: Mapping[str, Any],
    *,
    names: Sequence[str] | None = None,
    steps: int | None = None,
) -> TrainStateT:
    """``state`` with a ``torch.optim`` optimizer's ``state_dict()`` loaded into it.

    Moves a run from a plain loop onto fasttorch mid-training: the per-parameter state
    (moments, momentum buffers, step counts) goes into ``state.opt_state``, converted
    to the dtype and device of the state's own tensors, and the number of steps taken
    into ``state.step`` and ``opt_state.count`` (schedules continue where they were).
    With one parameter group its ``lr`` becomes ``opt_state.hyper["lr"]`` (unless the
    learning rate is a schedule). Parameters themselves come from the module, as usual.

    Equivalent to ``opt.load_state_dict(state_dict)`` on the plain loop's optimizer.

    Args:
        state: a ``TrainState`` built with the same algorithm
            (``from_torch(torch.optim.X)``, or fasttorch's ``adam``/``adamw``/``sgd``,
            whose slots have torch's names).
        state_dict: ``opt.state_dict()`` of the torch optimizer.
        names: the parameter name of each of torch's parameter indices (in the order
            the optimizer was given them); default ``list(state.params)``, right for
            ``torch.optim.X(model.parameters())`` when every parameter is trained.
        steps: optimizer steps taken so far; default torch's own ``"step"`` count
            (needed for SGD, whose state has none).

    Returns:
        A new ``TrainState``; ``state`` is unchanged.

    Raises:
        ValueError: the parameter counts differ, torch's state has an entry this
            optimizer does not keep (e.g. ``amsgrad`` on one side only), a shape
            differs, or the step count is unknown.

    Example:
        >>> import torch, fasttorch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> state = fasttorch.TrainState.create(
        ...     model, fasttorch.optim.from_torch(torch.optim.AdamW, 0.1))
        >>> state = fasttorch.optim.load_torch_state_dict(state, opt.state_dict())
        >>> int(state.step), state.opt_state.slots["exp_avg"]["bias"]
        (1, tensor([0.1000]))
    """
    names = list(state.params) if names is None else list(names)
    indices = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(indices) != len(names):
        raise ValueError(
            f"load_torch_state_dict: the torch optimizer has {len(indices)} parameters and "
            f"the state trains {len(names)} ({names[:5]}...). Pass names=[...] giving the "
            "fasttorch parameter name of each torch parameter, in the optimizer's order."
        )
    by_index = dict(zip(indices, names))
    opt_state = state.opt_state
    slots = {k: dict(v) for k, v in opt_state.slots.items()}
    taken: int | None = None
    for index, entries in state_dict["state"].items():
        name = by_index[index]
        for key, value in entries.items():
            if key == "step" and "step" not in slots:
                taken = int(value)
                continue
            if key not in slots or name not in slots[key]:
                raise ValueError(
                    f"load_torch_state_dict: torch's state of {name!r} has {key!r}, which "
                    f"{type(state.optimizer).__name__} does not keep (it keeps "
                    f"{sorted(k for k, v in slots.items() if name in v)}). Build the "
                    "fasttorch optimizer with the same algorithm and options."
                )
            old = slots[key][name]
            value = torch.as_tensor(value)
            if value.shape != old.shape:
                raise ValueError(
                    f"load_torch_state_dict: {key!r} of {name!r} has shape "
                    f"{tuple(value.shape)} in torch's state, {tuple(old.shape)} here."
                )
            slots[key][name] = value.detach().to(dtype=old.dtype, device=old.device).clone()
            if key == "step":
                taken = int(value)
    taken = steps if steps is not None else taken
    if taken is None:
        raise ValueError(
            "load_torch_state_dict: torch's state does not say how many steps were taken "
            "(SGD keeps no count); pass steps=N, the number of optimizer steps so far."
        )
    hyper = dict(opt_state.hyper)
    groups_ = state_dict["param_groups"]
    if len(groups_) == 1 and "lr" in hyper:
        hyper["lr"] = torch.full_like(hyper["lr"], float(groups_[0]["lr"]))
    count = torch.full_like(opt_state.count, taken)
    return state.replace(
        opt_state=opt_state.replace(count=count, hyper=hyper, slots=slots),
        step=torch.full_like(state.step, taken),
    )
