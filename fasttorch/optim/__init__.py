"""Functional optimizers: pure ``init`` / ``update`` pairs matching ``torch.optim``.

Each optimizer is a frozen configuration object; its state is an :class:`OptState`
pytree whose hyperparameters are 0-d tensors, so a compiled step never recompiles when
they change. Updates use torch's ``_foreach_*`` kernels and never modify their inputs.
:func:`from_torch` runs the gradient-only ``torch.optim`` algorithms through torch's own
functional kernels; :func:`groups` gives groups of parameters their own
hyperparameters; :func:`from_torchao` runs torchao's low-bit Adam/AdamW (8-bit, 4-bit,
float8 states), :func:`cpu_offload` keeps a GPU model's optimizer state in host memory,
and :func:`state_bytes` counts a state's bytes; docs/optimizers.md
shows how to write a new optimizer.
"""

from fasttorch.optim._base import LearningRate, Optimizer, OptState, set_hyperparams
from fasttorch.optim.adam import Adam, adam, adamw
from fasttorch.optim.every import Every, every
from fasttorch.optim.groups import Groups, GroupsState, groups
from fasttorch.optim.lowbit import TorchaoOptimizer, from_torchao, state_bytes
from fasttorch.optim.offload import CpuOffload, cpu_offload
from fasttorch.optim.selectors import (
    EMBEDDINGS,
    NORMALIZATION,
    ModuleSelector,
    Selector,
    in_module,
    is_bias,
    with_module,
)
from fasttorch.optim.sgd import SGD, sgd
from fasttorch.optim.torch_optim import TorchOptimizer, from_torch, load_torch_state_dict

__all__ = [
    "EMBEDDINGS",
    "NORMALIZATION",
    "SGD",
    "Adam",
    "CpuOffload",
    "Every",
    "Groups",
    "GroupsState",
    "LearningRate",
    "ModuleSelector",
    "OptState",
    "Optimizer",
    "Selector",
    "TorchOptimizer",
    "TorchaoOptimizer",
    "adam",
    "adamw",
    "cpu_offload",
    "every",
    "from_torch",
    "from_torchao",
    "groups",
    "in_module",
    "is_bias",
    "load_torch_state_dict",
    "set_hyperparams",
    "sgd",
    "state_bytes",
    "with_module",
]
