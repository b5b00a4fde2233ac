"""fasttorch: pure, composable, compiled training steps for PyTorch."""

from fasttorch import optim, schedules, struct
from fasttorch.state import DonatedStateError, TrainState
from fasttorch.steps import GradOut, Loss, Step, step
from fasttorch.transforms import clip_scaled, compiled, grad_accumulate, with_amp

__all__ = [
    "DonatedStateError",
    "GradOut",
    "Loss",
    "Step",
    "TrainState",
    "clip_scaled",
    "compiled",
    "grad_accumulate",
    "optim",
    "schedules",
    "step",
    "struct",
    "with_amp",
]

__version__ = "0.1.0"
