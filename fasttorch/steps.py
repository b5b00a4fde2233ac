"""A training step: the :class:`Step` record, :func:`step`, wrap checks and the driver.

A :class:`Step` is ``(state, batch) -> (state, metrics)``: three phases
(:mod:`fasttorch.phases`) that transforms replace one at a time, its accumulation
window (:mod:`fasttorch.window`), and three hooks (``runner``, ``jit``, ``hooks``)
through which a transform changes how a call runs. Defined in the step runtime
(``fasttorch/_core/step.py``: the record, the driver and the window's loop, one call
of a step read top to bottom); this is its public face.
"""

from __future__ import annotations

from fasttorch._checks import warn_once
from fasttorch._core.phases import GradOut, Loss, global_norm, scale_grads
from fasttorch._core.step import (
    CallHook,
    Runner,
    Step,
    apply_update,
    check_wrap,
    eager,
    step,
)

__all__ = [
    "CallHook",
    "GradOut",
    "Loss",
    "Runner",
    "Step",
    "apply_update",
    "check_wrap",
    "eager",
    "global_norm",
    "scale_grads",
    "step",
    "warn_once",
]
