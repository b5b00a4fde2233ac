"""Learning-rate schedules evaluated in-graph from the step tensor.

A schedule is any callable ``step -> lr`` taking the int64 0-d step counter and
returning a 0-d float64 tensor on the same device. The ones here are frozen attrs
objects built (and validated) outside the step; calling one uses torch ops only (no
``.item()``, no Python branching on the step), so a compiled step evaluates it in its
graph and never recompiles as the step advances. Each matches a
``torch.optim.lr_scheduler`` class where torch has one: ``schedule(k)`` is the rate the
torch scheduler gives the optimizer for its ``k``-th ``opt.step()`` (0-indexed).
:func:`hf` gives Hugging Face's ``get_scheduler`` types and :func:`timm_cosine` timm's
``CosineLRScheduler``, value for value; :func:`sequential` chains schedules as
``SequentialLR`` does and :func:`per_epoch` steps any of them once per epoch.
"""

from __future__ import annotations

from fasttorch.schedules._base import Schedule
from fasttorch.schedules._combine import (
    PerEpoch,
    Sequential,
    Warmup,
    per_epoch,
    sequential,
    warmup,
)
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
from fasttorch.schedules._hf_names import hf
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
from fasttorch.schedules._timm import TimmCosine, timm_cosine

__all__ = [
    "Constant",
    "Cosine",
    "HFConstantWithWarmup",
    "HFCosine",
    "HFCosineWarmupWithMinLR",
    "HFCosineWithRestarts",
    "HFInverseSqrt",
    "HFLinear",
    "HFPolynomial",
    "HFWarmupStableDecay",
    "LinearWarmup",
    "OneCycle",
    "PerEpoch",
    "Schedule",
    "Sequential",
    "StepDecay",
    "TimmCosine",
    "Warmup",
    "constant",
    "cosine",
    "hf",
    "linear_warmup",
    "one_cycle",
    "per_epoch",
    "sequential",
    "step_decay",
    "timm_cosine",
    "warmup",
]
