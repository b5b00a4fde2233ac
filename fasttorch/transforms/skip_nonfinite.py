"""``skip_nonfinite``: skip updates with inf/NaN gradients, and stop after too many.

Its sub-states: :class:`NonFiniteState` (the counters) and :class:`SkipBuffers` (the
module's buffers as the window began, put back where an update is skipped; declared by
:data:`SKIP_BUFFERS`, which ``with_amp`` declares too, kept once).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fasttorch import _checks, struct
from fasttorch.phases import (
    GradOut,
    LateRead,
    Metrics,
    Tensors,
    mark_skip,
    no_state_read_after_inner,
    unscaled_norm,
)
from fasttorch.state import TrainState, check_alive
from fasttorch.steps import Step, check_wrap
from fasttorch.substates import SubState

__all__ = [
    "BUFFERS_KEY",
    "SKIP_BUFFERS",
    "NonFiniteError",
    "NonFiniteState",
    "SkipBuffers",
    "skip_nonfinite",
]

KEY = "nonfinite"

BUFFERS_KEY = "skip_buffers"
"""The sub-state key of the module's buffers as they were when the window began."""


class NonFiniteError(FloatingPointError):
    """Too many updates in a row had non-finite gradients (see :func:`skip_nonfinite`)."""


class NonFiniteState(struct.Record):
    """Sub-state ``"nonfinite"``: updates skipped for inf/NaN gradients.

    Attributes:
        skipped_total: updates skipped so far (int64 0-d).
        skipped_in_a_row: consecutive skipped updates up to now (int64 0-d); an
            applied update resets it to 0.
    """

    skipped_total: torch.Tensor
    skipped_in_a_row: torch.Tensor


def _init(state: TrainState) -> NonFiniteState:
    zero = torch.zeros((), dtype=torch.int64, device=state.device)
    return NonFiniteState(skipped_total=zero, skipped_in_a_row=zero.clone())


SUBSTATE = SubState(KEY, NonFiniteState, _init)


class SkipBuffers(struct.Record):
    """Sub-state ``"skip_buffers"``: the module's buffers as they were when the window began.

    The forward updates buffers (BatchNorm's running statistics) in place before the
    update phase learns whether to skip; where an update is skipped the default update
    phase puts these back (:meth:`restore`), and every update refreshes them. A copy of
    the module's buffers, not of frozen parameters; replicated in a checkpoint, under
    ``substates/skip_buffers/<name>`` (the field is inline: the keys of the plain dict
    this sub-state was before, so those checkpoints load).

    Attributes:
        buffers: a copy of each of the module's buffers, same names as ``state.buffers``.
    """

    buffers: Tensors = struct.field(inline=True)

    # Read by the default update phase (fasttorch.substates): where an update is
    # skipped, the module's buffers are put back to these.
    restores_buffers: ClassVar[bool] = True

    def restore(self, buffers: Tensors, skip: torch.Tensor) -> tuple[Tensors, SkipBuffers]:
        """``buffers`` with the kept ones put back where ``skip``, and the next snapshot.

        Equivalent to::

            if skipped:  # a torch.where, no host sync
                module.load_state_dict(kept_buffers, strict=False)
            kept_buffers = {k: b.clone() for k, b in module.named_buffers()}
        """
        if not self.buffers:
            return buffers, self
        out = dict(buffers)
        for k, old in self.buffers.items():
            out[k] = torch.where(skip, old, out[k])
        # A copy, not the buffer itself: the next forward may update the buffer in place.
        return out, SkipBuffers({k: out[k].clone() for k in self.buffers})


def _snapshot_buffers(state: TrainState) -> SkipBuffers:
    names = {n for n, _ in state.module.named_buffers()}
    return SkipBuffers({k: b.clone() for k, b in state.buffers.items() if k in names})


SKIP_BUFFERS = SubState(BUFFERS_KEY, SkipBuffers, _snapshot_buffers)
"""The buffer snapshot a transform that marks skips declares (``substate=``; kept once)."""


class _Limit:
    """The call hook of the policy: counter values copied off the device one call late.

    Host-side, around each call and outside any graph (``Step.hooks``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counter = LateRead()

    def after(self, step: Step, new: TrainState) -> None:
        if new.device.type != "cpu":
            self.counter.push(new.substates[KEY].skipped_in_a_row, new)

    def before(self, step: Step, state: TrainState) -> None:
        check_alive(state, step.name)
        if KEY not in state.substates:
            return
        limit = self.limit
        if state.device.type == "cpu":
            # The CPU has finished the previous step when it returns: no wait.
            seen = [int(state.substates[KEY].skipped_in_a_row)]
        else:
            seen = [int(v) for v in self.counter.landed(state)]
        if seen and max(seen) >= limit:
            sub: NonFiniteState = state.substates[KEY]
            total = int(sub.skipped_total) if state.device.type == "cpu" else "?"
            raise NonFiniteError(
                f"step {step.name!r}: the last {max(seen)} updates in a row had non-finite "
                f"gradients (inf or NaN) and were skipped, reaching "
                f"max_consecutive={limit} ({total} skipped in all, at step "
                f"{int(state.step)}). The state passed to this call is the last one "
                "(parameters as of the last finite update); it was not changed and can "
                "be saved or inspected. Usual causes: a learning rate too high, "
                "NaN/inf in the data, a log/div of zero in the loss, or an fp16 "
                "overflow in the forward pass. Raise max_consecutive (or pass None) to "
                "keep skipping"
            )


def skip_nonfinite(step: Step, *, max_consecutive: int | None = 20) -> Step:
    """Skip updates whose gradients hold inf or NaN, count them, and stop after too many.

    Works in every precision (fp32, bf16, fp16): when the global gradient norm is not
    finite, the update is not applied (parameters, optimizer state and the module's
    buffers, such as BatchNorm's running statistics, stay as they were, a
    ``torch.where``, no host sync), ``state.step`` still advances, and
    ``state.substates["nonfinite"]`` (:class:`NonFiniteState`) counts
    ``skipped_total`` and ``skipped_in_a_row``; these are the counters the policy
    reads, whatever the precision (fp16 ``with_amp`` keeps its own too, and its skips
    are counted here as well). Metrics gain ``skipped``. With ``grad_accumulate`` a
    skip is one whole window.

    When ``skipped_in_a_row`` reaches ``max_consecutive`` the next call raises
    :class:`NonFiniteError` before running, leaving the state it was given intact,
    instead of training on nothing forever. The counter is read outside the step and
    one call late (on a GPU from a non-blocking copy started when the previous call
    returned, read only once it has landed), so no step waits on the device. It
    composes with every transform in any order, ``compiled`` outermost; the check
    stays outside the compiled graph.

    Equivalent to::

        for batch in loader:
            if in_a_row >= max_consecutive:  # checked before the call runs
                raise FloatingPointError(...)
            loss_fn(model, batch).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            if torch.isfinite(grad_norm):
                opt.step(); in_a_row = 0
            else:
                in_a_row += 1; total += 1
            opt.zero_grad(set_to_none=True)
            step += 1  # skipped updates count: a schedule reads the step

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed.
        max_consecutive: how many skipped updates in a row to allow; ``None`` never
            raises (skip and count only).

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
        >>> guarded = fasttorch.skip_nonfinite(fasttorch.step(loss_fn), max_consecutive=2)
        >>> bad = torch.full((4, 2), float("nan"))
        >>> state, metrics = guarded(state, bad)
        >>> state, metrics = guarded(state, bad)
        >>> bool(metrics["skipped"]), int(state.substates["nonfinite"].skipped_in_a_row)
        (True, 2)
        >>> guarded(state, bad)
        Traceback (most recent call last):
        ...
        fasttorch.transforms.skip_nonfinite.NonFiniteError: step 'loss_fn': the last 2 updates ...
    """
    check_wrap(step, "skip_nonfinite")
    if max_consecutive is not None:
        _checks.count(
            "skip_nonfinite",
            "max_consecutive",
            max_consecutive,
            kind="an integer >= 1, or None to never raise",
        )
    inner = step.update

    @no_state_read_after_inner
    def update(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
        counts: NonFiniteState = state.substates[KEY]
        norm = unscaled_norm(g)
        g = mark_skip(g.replace(norm=norm), ~torch.isfinite(norm))
        skip = g.skip
        assert skip is not None
        new, metrics = inner(state, g)
        counts = NonFiniteState(
            skipped_total=counts.skipped_total + skip.long(),
            skipped_in_a_row=torch.where(skip, counts.skipped_in_a_row + 1, 0),
        )
        new = new.with_substate(KEY, counts)
        metrics["skipped"] = skip
        return new, metrics

    hooks = step.hooks if max_consecutive is None else (*step.hooks, _Limit(max_consecutive))
    return step.with_phases(
        "skip_nonfinite",
        update=update,
        substate=(SUBSTATE, SKIP_BUFFERS),
        hooks=hooks,
    )
