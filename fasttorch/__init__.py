"""fasttorch: pure, composable, compiled training steps for PyTorch."""

from fasttorch import checkpoint, data, evaluation, loop, optim, schedules, struct, testing
from fasttorch.data import prefetch
from fasttorch.evaluation import eval_step
from fasttorch.state import DonatedStateError, TrainState
from fasttorch.steps import GradOut, Loss, Step, step
from fasttorch.transforms import (
    NonFiniteError,
    clip_scaled,
    compiled,
    ema,
    grad_accumulate,
    profiled,
    skip_nonfinite,
    with_amp,
)
from fasttorch.tuning import tune_device

__all__ = [
    "DonatedStateError",
    "GradOut",
    "Loss",
    "NonFiniteError",
    "Step",
    "TrainState",
    "checkpoint",
    "clip_scaled",
    "compiled",
    "data",
    "ema",
    "eval_step",
    "evaluation",
    "grad_accumulate",
    "loop",
    "optim",
    "prefetch",
    "profiled",
    "schedules",
    "skip_nonfinite",
    "step",
    "struct",
    "testing",
    "tune_device",
    "with_amp",
]

__version__ = "0.1.0"
