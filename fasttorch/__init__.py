"""fasttorch: pure, composable, compiled training steps for PyTorch."""

import importlib
from typing import TYPE_CHECKING, Any

from fasttorch import (
    data,
    evaluation,
    loop,
    optim,
    schedules,
    struct,
    testing,
    transforms,
)
from fasttorch._version import __version__ as __version__
from fasttorch.data import prefetch
from fasttorch.distributed.sync_on_last import sync_on_last
from fasttorch.evaluation import eval_step
from fasttorch.models import Frozen, Models
from fasttorch.population import create_population, member, member_state_dict, population_size
from fasttorch.several import Several, model_step, several
from fasttorch.state import DonatedStateError, TrainState
from fasttorch.steps import GradOut, Loss, Step, step
from fasttorch.transforms import *  # noqa: F403 (every transform, listed once there)
from fasttorch.transforms.compiled import RecompileLimitError, RecompileWarning
from fasttorch.tuning import tune_device

__all__ = [
    "DonatedStateError",
    "Frozen",
    "GradOut",
    "Loss",
    "Models",
    "RecompileLimitError",
    "RecompileWarning",
    "Several",
    "Step",
    "TrainState",
    "checkpoint",
    "create_population",
    "data",
    "eval_step",
    "evaluation",
    "loop",
    "member",
    "member_state_dict",
    "model_step",
    "optim",
    "population_size",
    "prefetch",
    "schedules",
    "several",
    "step",
    "struct",
    "sync_on_last",
    "testing",
    "transforms",
    "tune_device",
]
__all__ += transforms.__all__

if TYPE_CHECKING:
    from fasttorch import checkpoint


def __getattr__(name: str) -> Any:
    # fasttorch.checkpoint loads torch.distributed.checkpoint (about a second): imported
    # on first use (fasttorch.checkpoint.save), not by `import fasttorch`.
    if name == "checkpoint":
        return importlib.import_module("fasttorch.checkpoint")
    raise AttributeError(f"module 'fasttorch' has no attribute {name!r}")
