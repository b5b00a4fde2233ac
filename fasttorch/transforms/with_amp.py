"""``with_amp``: mixed precision, with a dynamic loss scale for fp16."""

from __future__ import annotations

import warnings
from typing import Literal

import attrs
import torch

from fasttorch import _checks, _compat, struct
from fasttorch._checks import warn_once
from fasttorch.phases import (
    Batch,
    GradOut,
    LateRead,
    Loss,
    LossPhase,
    Metrics,
    Tensors,
    call_scope,
    float_flag,
    mark_skip,
    no_state_read_after_inner,
    unscaled_norm,
)
from fasttorch.state import TrainState
from fasttorch.steps import Step, check_wrap
from fasttorch.substates import SubState
from fasttorch.transforms.skip_nonfinite import SKIP_BUFFERS

__all__ = ["KEY", "LossScaleState", "resolve_precision", "with_amp"]

KEY = "amp"
"""The sub-state key of the fp16 loss scale (``state.substates[KEY]``)."""

Precision = Literal["bf16", "fp16", "auto"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleState(struct.Record):
    """Sub-state ``"amp"`` of an fp16 step: GradScaler's scale and growth counter.

    Attributes:
        scale: the loss scale (float32 0-d).
        growth_tracker: finite steps since the scale last changed (int32 0-d).
        skipped_total: updates skipped for non-finite gradients so far (int64 0-d).
        skipped_in_a_row: consecutive skipped updates up to now (int64 0-d).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    skipped_total: torch.Tensor
    skipped_in_a_row: torch.Tensor


@attrs.frozen
class DynamicLossScale:
    """GradScaler's rule: x backoff and skip on inf/NaN, x growth after ``interval`` good steps.

    Unlike GradScaler's, the backoff stops at ``min_scale``.
    """

    init_scale: float = attrs.field(validator=attrs.validators.gt(0.0))
    growth_factor: float = attrs.field(validator=attrs.validators.gt(1.0))
    backoff_factor: float = attrs.field(
        validator=[attrs.validators.gt(0.0), attrs.validators.lt(1.0)]
    )
    growth_interval: int = attrs.field(validator=attrs.validators.ge(1))
    min_scale: float = attrs.field(default=2.0**-24, validator=attrs.validators.gt(0.0))

    def __attrs_post_init__(self) -> None:
        if self.min_scale > self.init_scale:
            raise ValueError(
                f"with_amp: min_scale={self.min_scale!r} is above init_scale="
                f"{self.init_scale!r}; the floor must be at most the initial scale"
            )

    @property
    def substate(self) -> SubState:
        """This rule's sub-state declaration: ``state.substates[KEY]``, a
        :class:`LossScaleState` starting at ``init_scale``."""
        return SubState(KEY, LossScaleState, self.init)

    def init(self, state: TrainState) -> LossScaleState:
        zero = torch.zeros((), dtype=torch.int64, device=state.device)
        return LossScaleState(
            scale=torch.full((), self.init_scale, dtype=torch.float32, device=state.device),
            growth_tracker=torch.zeros((), dtype=torch.int32, device=state.device),
            skipped_total=zero,
            skipped_in_a_row=zero.clone(),
        )

    def adjust(self, s: LossScaleState, found_inf: torch.Tensor) -> LossScaleState:
        """``torch._amp_update_scale_`` as tensor ops (no host sync, traceable)."""
        successful = s.growth_tracker + 1
        grow = ~found_inf & (successful >= self.growth_interval)
        grown = s.scale * self.growth_factor
        scale = torch.where(
            found_inf,
            torch.clamp(s.scale * self.backoff_factor, min=self.min_scale),
            torch.where(grow & torch.isfinite(grown), grown, s.scale),
        )
        tracker = torch.where(found_inf | grow, torch.zeros_like(successful), successful)
        return LossScaleState(
            scale=scale,
            growth_tracker=tracker,
            skipped_total=s.skipped_total + found_inf.long(),
            skipped_in_a_row=torch.where(found_inf, s.skipped_in_a_row + 1, 0),
        )

    def adjust_in_place(self, s: LossScaleState, found_inf: torch.Tensor) -> LossScaleState:
        """:meth:`adjust` on ``s``'s own tensors (a donated eager step): GradScaler's
        kernel, then the floor; five launches instead of about twenty, the same values."""
        update = _compat.amp_update_scale()
        if update is None:
            return self.adjust(s, found_inf)
        update(
            s.scale,
            s.growth_tracker,
            float_flag(found_inf),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        s.scale.clamp_(min=self.min_scale)  # only a backoff can go below the floor
        s.skipped_total.add_(found_inf)
        s.skipped_in_a_row.mul_(found_inf).add_(found_inf)  # +1, or back to 0
        return s


class _Floor:
    """The call hook that warns once when the loss scale has reached ``min_scale``.

    Host-side, outside any graph, and one call late as ``skip_nonfinite``'s limit: on a
    CPU the scale's memory is read directly; elsewhere from a non-blocking copy started when the
    previous call returned, read only once it has landed. No step waits on the device.
    """

    def __init__(self, min_scale: float) -> None:
        self.min_scale = min_scale
        self.warned = False
        self.scale = LateRead()

    def after(self, step: Step, new: TrainState) -> None:
        if not self.warned and new.device.type != "cpu":
            self.scale.push(new.substates[KEY].scale, new)

    def before(self, step: Step, state: TrainState) -> None:
        if self.warned or KEY not in state.substates:
            return
        if state.device.type == "cpu":
            # Its memory, read directly: on a CPU nothing runs behind the host's back,
            # and no operator (a scalar read) is dispatched on every call.
            seen = [float(state.substates[KEY].scale.detach().numpy())]
        else:
            seen = self.scale.landed(state)
        if seen and min(seen) <= self.min_scale:
            self.warned = True
            self.scale.queue.clear()
            warnings.warn(
                f"step {step.name!r}: the fp16 loss scale fell to its floor "
                f"min_scale={self.min_scale:g} after many non-finite gradients (each one "
                "halves it and skips the update); it stays there, and updates whose "
                "gradients are still inf or NaN keep being skipped. Scaling cannot fix "
                "that: the inf/NaN comes from the forward pass or the data (an fp16 "
                "overflow in an activation, a log/div of zero, NaN inputs). Wrap the step "
                "in skip_nonfinite(step, max_consecutive=...) to stop with an error "
                "instead, or try bf16",
                RuntimeWarning,
                stacklevel=4,
            )


def resolve_precision(precision: str, device_type: str) -> torch.dtype:
    """The autocast dtype for ``precision`` on ``device_type``; ``"auto"`` warns once."""
    if precision in _DTYPES:
        return _DTYPES[precision]
    native, why = _native_bf16(device_type)
    choice = "bf16" if native else "fp16"
    warn_once(
        f"with_amp('auto') chose {choice} on {device_type}: {why}"
        + ("" if native else "; fp16 adds a dynamic loss scale")
    )
    return _DTYPES[choice]


def _native_bf16(device_type: str) -> tuple[bool, str]:
    if device_type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name()} computes bf16 natively"
        return False, "this GPU has no native bf16 (compute capability < 8.0)"
    if device_type == "cpu":
        if _compat.cpu_has_bf16_units():
            return True, "this CPU has AVX512-BF16/AMX bf16 instructions"
        return False, "this CPU has no AVX512-BF16 or AMX instructions, bf16 would be emulated"
    return True, f"assuming {device_type} supports bf16"


def with_amp(
    step: Step,
    precision: Precision = "bf16",
    *,
    device_type: str | None = None,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 2.0**-24,
) -> Step:
    """Run the forward pass in ``precision`` under ``torch.autocast``.

    ``"bf16"`` needs nothing else. ``"fp16"`` also keeps a dynamic loss scale in
    ``state.substates["amp"]`` with ``torch.amp.GradScaler``'s defaults and options: the
    loss is multiplied by the scale before backward; if any gradient is inf/NaN the
    update is skipped (parameters, optimizer state and buffers unchanged, a
    ``torch.where``, no host sync) and the scale multiplied by ``backoff_factor``; after
    ``growth_interval`` finite steps in a row it is multiplied by ``growth_factor``.
    Metrics gain ``loss_scale`` (the scale used this step) and ``skipped``; the sub-state
    counts skipped updates (``skipped_total``, ``skipped_in_a_row``). Unlike
    GradScaler's, the scale stops falling at ``min_scale``, and a ``RuntimeWarning``
    says so once when it gets there (read on the host one call late, no sync).
    ``"auto"``
    picks bf16 where ``device_type`` computes it natively, else fp16, and warns once
    which it chose and why.

    Equivalent to::

        with torch.autocast(device_type, dtype=torch.float16):
            loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed.
        precision: ``"bf16"``, ``"fp16"`` or ``"auto"``.
        device_type: the device ``"auto"`` decides for (default: ``"cuda"`` when
            available, else ``"cpu"``); the state must live on it.
        init_scale, growth_factor, backoff_factor, growth_interval: as
            ``torch.amp.GradScaler``; fp16 only.
        min_scale: the floor of the scale (fp16 only). The default, ``2**-24`` (the
            smallest fp16 subnormal), is 40 halvings below ``init_scale``: a gradient
            that still overflows fp16 at that scale is over ``65504 * 2**24`` (about
            1e12) in true value, which no trainable model produces, so non-finite
            gradients there come from the forward pass or the data and no scale fixes
            them. Above the floor the rule is GradScaler's, bit for bit; without one the
            scale reaches 0 after about 165 non-finite steps and every later step is
            skipped.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).float().pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> amp = fasttorch.with_amp(fasttorch.step(loss_fn), "fp16")
        >>> state, metrics = amp(state, torch.randn(8, 4))
        >>> float(metrics["loss_scale"]), bool(metrics["skipped"])
        (65536.0, False)
    """
    check_wrap(step, "with_amp")
    if precision not in ("bf16", "fp16", "auto"):
        raise ValueError(f"with_amp: precision must be 'bf16', 'fp16' or 'auto', got {precision!r}")
    # Checked for bf16 too (where they are unused): a wrong value is a mistake either way.
    init_scale = _checks.real("with_amp", "init_scale", init_scale, low=0.0, low_open=True)
    growth_factor = _checks.real("with_amp", "growth_factor", growth_factor, low=1.0, low_open=True)
    backoff_factor = _checks.real(
        "with_amp",
        "backoff_factor",
        backoff_factor,
        low=0.0,
        low_open=True,
        high=1.0,
        high_open=True,
    )
    growth_interval = _checks.count("with_amp", "growth_interval", growth_interval)
    min_scale = _checks.real("with_amp", "min_scale", min_scale, low=0.0, low_open=True)
    dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_precision(precision, dev)
    inner_loss = step.loss
    check_device = precision == "auto"

    def loss(state: TrainState, params: Tensors, buffers: Tensors, batch: Batch) -> Loss:
        if check_device and state.device.type != dev:
            raise ValueError(
                f"with_amp('auto') chose {dtype} for {dev!r} but the state is on "
                f"{state.device}; pass device_type={state.device.type!r}"
            )
        with torch.autocast(state.device.type, dtype=dtype):
            return inner_loss(state, params, buffers, batch)

    if dtype == torch.bfloat16:
        return step.with_phases("with_amp", loss=loss)

    rule = DynamicLossScale(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)
    inner_grad, inner_update = step.grad, step.update

    def grad(loss: LossPhase, state: TrainState, batch: Batch, mult: object) -> GradOut:
        scale = state.substates[KEY].scale
        return inner_grad(loss, state, batch, mult * scale).replace(scale=scale)

    @no_state_read_after_inner
    def update(state: TrainState, g: GradOut) -> tuple[TrainState, Metrics]:
        ls: LossScaleState = state.substates[KEY]
        norm = unscaled_norm(g)
        # inf or NaN: a norm is >= 0 otherwise (two operations; isfinite is four)
        found_inf = ~(norm < float("inf"))
        g = mark_skip(g.replace(norm=norm), found_inf)
        new, metrics = inner_update(state, g)
        # A copy: with donation the state's own scale tensor is overwritten next step.
        metrics["loss_scale"] = ls.scale.clone()
        in_place = not torch.compiler.is_compiling() and call_scope().in_place
        adjusted = rule.adjust_in_place(ls, found_inf) if in_place else rule.adjust(ls, found_inf)
        new = new.with_substate(KEY, adjusted)
        metrics["skipped"] = g.skip
        return new, metrics

    return step.with_phases(
        "with_amp",
        loss=loss,
        grad=grad,
        update=update,
        substate=(rule.substate, SKIP_BUFFERS),
        hooks=(*step.hooks, _Floor(rule.min_scale)),
    )
