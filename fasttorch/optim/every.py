"""``every``: an optimizer that steps once every ``k`` training steps."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from fasttorch import _checks
from fasttorch.optim._base import Optimizer, OptState

__all__ = ["Every", "every"]

_COUNT = "every.count"
"""The slot holding the updates this optimizer applied (per parameter, as
``torch.optim``'s ``state[p]["step"]``): inside :func:`~fasttorch.optim.groups` the
shared ``count`` advances with every step, this one only when the wrapped one steps."""


@attrs.frozen
class Every:
    """``inner`` applied on training steps ``k - 1, 2k - 1, ...`` only; built by :func:`every`."""

    inner: Optimizer
    k: int

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """The wrapped optimizer's state, with its own count of applied updates."""
        state = self.inner.init(params)
        counts = {n: torch.zeros((), dtype=torch.int64, device=p.device) for n, p in params.items()}
        return state.replace(slots={**state.slots, _COUNT: counts})

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        """The wrapped optimizer's learning rate."""
        return self.inner.learning_rate(self._inner_state(opt_state), step)

    def _inner_state(self, opt_state: OptState) -> OptState:
        counts = opt_state.slots.get(_COUNT, {})
        count = next(iter(counts.values()), opt_state.count)
        slots = {k: v for k, v in opt_state.slots.items() if k != _COUNT}
        return opt_state.replace(count=count, slots=slots)

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        inplace: bool = False,
    ) -> tuple[dict[str, Tensor], OptState]:
        """The wrapped update where ``(step + 1) % k == 0``; the old values elsewhere.

        Selected with ``torch.where`` (no host read of the step): the wrapped update is
        computed on every step and kept on one in ``k``. Out of place, ``inplace`` or not.
        """
        inner = self._inner_state(opt_state)
        new_params, new_inner = self.inner.update(params, grads, inner, step, inplace=False)
        go = torch.remainder(step + 1, self.k) == 0
        keep = (dict(params), inner.slots)
        chosen_params, chosen_slots = pytree.tree_map(
            lambda old, new: new if new is old else torch.where(go, new, old),
            keep,
            (new_params, new_inner.slots),
        )
        counts = opt_state.slots.get(_COUNT, {})
        new_counts = {n: torch.where(go, c + 1, c) for n, c in counts.items()}
        count = torch.where(go, opt_state.count + 1, opt_state.count)
        out = opt_state.replace(
            count=count, hyper=new_inner.hyper, slots={**chosen_slots, _COUNT: new_counts}
        )
        return chosen_params, out


def every(optimizer: Optimizer, k: int) -> Optimizer:
    """``optimizer``, stepping on one training step in ``k`` (the ``k``-th, ``2k``-th, ...).

    For a second optimizer that updates its parameters less often than the first
    (a critic every ``k`` windows, a slow group), usually inside
    :func:`~fasttorch.optim.groups`. The step uses that window's gradient; windows in
    between leave its parameters and state as they are, and its own count of updates
    (Adam's bias correction) advances only when it steps.

    Equivalent to::

        loss.backward()
        opt_a.step()
        if (i + 1) % k == 0:
            opt_b.step()
        opt_a.zero_grad(); opt_b.zero_grad()

    Args:
        optimizer: any fasttorch optimizer.
        k: steps per update (``1``: ``optimizer`` itself).

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch import optim
        >>> opt = optim.groups(optim.sgd(0.1), [("1.*", optim.every(optim.sgd(0.1), 2))])
        >>> state = fasttorch.TrainState.create(torch.nn.Sequential(
        ...     torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)), opt)
        >>> step = fasttorch.step(lambda apply, x: apply(x).sum())
        >>> before = state.params["1.weight"].clone()
        >>> state, _ = step(state, torch.ones(4, 2))
        >>> bool((state.params["1.weight"] == before).all())
        True
    """
    _checks.count("every", "k", k)
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"every expects a fasttorch optimizer such as optim.adam(1e-3), got "
            f"{type(optimizer).__name__}"
        )
    if k == 1:
        return optimizer
    return Every(optimizer, k)
