"""Learning-rate schedules evaluated in-graph from the step tensor.

A schedule is any callable ``step -> lr`` taking the int64 0-d step counter and
returning a 0-d float64 tensor on the same device. The ones here are frozen attrs
objects built (and validated) outside the step; calling one uses torch ops only (no
``.item()``, no Python branching on the step), so a compiled step evaluates it in its
graph and never recompiles as the step advances. Each matches a
``torch.optim.lr_scheduler`` class where torch has one: ``schedule(k)`` is the rate the
torch scheduler gives the optimizer for its ``k``-th ``opt.step()`` (0-indexed).
"""

from __future__ import annotations

from fasttorch.schedules._base import Schedule
from fasttorch.schedules._combine import Warmup, warmup
from fasttorch.schedules._shapes import (
    Constant,
    Cosine,
    LinearWarmup,
    OneCycle,
    StepDecay,
    constant,
    cosine,
    linear_warmup,
    one_cycle,
    step_decay,
)

__all__ = [
    "Constant",
    "Cosine",
    "LinearWarmup",
    "OneCycle",
    "Schedule",
    "StepDecay",
    "Warmup",
    "constant",
    "cosine",
    "linear_warmup",
    "one_cycle",
    "step_decay",
    "warmup",
]
