"""Transforms: stateless functions ``step -> step``, one module each.

A new transform is its module, its test file, and its entry here (the import and the
name in ``__all__``); the top-level package exports everything listed here.
"""

from fasttorch.transforms.clip_scaled import clip_scaled
from fasttorch.transforms.compiled import compiled
from fasttorch.transforms.ema import EmaState, ema
from fasttorch.transforms.grad_accumulate import grad_accumulate
from fasttorch.transforms.profiled import Profiled, profiled
from fasttorch.transforms.scale_loss import scale_loss
from fasttorch.transforms.skip_nonfinite import NonFiniteError, NonFiniteState, skip_nonfinite
from fasttorch.transforms.vmapped import vmapped, vmapped_eval
from fasttorch.transforms.with_amp import LossScaleState, with_amp

__all__ = [
    "EmaState",
    "LossScaleState",
    "NonFiniteError",
    "NonFiniteState",
    "Profiled",
    "clip_scaled",
    "compiled",
    "ema",
    "grad_accumulate",
    "profiled",
    "scale_loss",
    "skip_nonfinite",
    "vmapped",
    "vmapped_eval",
    "with_amp",
]
