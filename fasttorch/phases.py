"""The phases of a step and the contract between them: what a transform author imports.

A :class:`fasttorch.Step` runs three phases, pure functions that transforms replace one
at a time:

* ``loss(state, params, buffers, batch) -> Loss``: the forward pass through the user's
  loss function (``with_amp`` wraps it in autocast);
* ``grad(loss, state, batch, mult) -> GradOut``: gradients of ``loss * mult`` for one
  (micro)batch (``with_amp`` multiplies in the loss scale);
* ``update(state, grads) -> (state, metrics)``: optimizer update (``clip_scaled`` and
  ``with_amp`` act before it).

:class:`GradOut` carries the gradients from one to the next with what the transforms in
between learned about them (the loss scale they still carry, their true norm, whether
to skip the update); :func:`unscaled_norm` and :func:`mark_skip` are the two things
every transform that inspects gradients does with it. This module is the whole contract
a transform author needs: the records, the default phases, the helpers every transform
shares (:func:`global_norm`, :func:`scale_grads`, ...), the call's scope
(:func:`call_scope`), a device scalar read one call late (:class:`LateRead`) and the
found-inf flag as the fused kernels take it (:func:`float_flag`). They
are defined in the step runtime, ``fasttorch/_core/`` (``phases.py``: the records, the
default phases and how they compute; ``state.py``: the call scope), which no transform
imports.
"""

from __future__ import annotations

from fasttorch._core.late import LateRead
from fasttorch._core.phases import (
    Batch,
    GradOut,
    GradPhase,
    Loss,
    LossFn,
    LossPhase,
    Metrics,
    Tensors,
    UpdatePhase,
    add_weighted_aux,
    as_loss,
    batch_size,
    clipped,
    describe,
    divide_aux,
    global_norm,
    grad_phase,
    loss_phase,
    mark_skip,
    no_state_read_after_inner,
    opaque_update,
    reads_no_state_after_inner,
    reciprocal,
    scale_grads,
    scaled_grads,
    skip_empty_window,
    unscaled_norm,
    update_phase,
)
from fasttorch._core.state import current as call_scope
from fasttorch._core.state import scope as scoped_call
from fasttorch.optim._base import float_flag

__all__ = [
    "Batch",
    "GradOut",
    "GradPhase",
    "LateRead",
    "Loss",
    "LossFn",
    "LossPhase",
    "Metrics",
    "Tensors",
    "UpdatePhase",
    "add_weighted_aux",
    "as_loss",
    "batch_size",
    "call_scope",
    "clipped",
    "describe",
    "divide_aux",
    "float_flag",
    "global_norm",
    "grad_phase",
    "loss_phase",
    "mark_skip",
    "no_state_read_after_inner",
    "opaque_update",
    "reads_no_state_after_inner",
    "reciprocal",
    "scale_grads",
    "scaled_grads",
    "scoped_call",
    "skip_empty_window",
    "unscaled_norm",
    "update_phase",
]
