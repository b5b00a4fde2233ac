"""Transforms: stateless functions ``step -> step``, one module each."""

from fasttorch.transforms.clip_scaled import clip_scaled
from fasttorch.transforms.compiled import compiled
from fasttorch.transforms.grad_accumulate import grad_accumulate
from fasttorch.transforms.with_amp import LossScaleState, with_amp

__all__ = ["LossScaleState", "clip_scaled", "compiled", "grad_accumulate", "with_amp"]
