"""Functional optimizers: pure ``init`` / ``update`` pairs matching ``torch.optim``.

Each optimizer is a frozen configuration object; its state is an :class:`OptState`
pytree whose hyperparameters are 0-d tensors, so a compiled step never recompiles when
they change. Updates use torch's ``_foreach_*`` kernels and never modify their inputs.
:func:`from_torch` runs the gradient-only ``torch.optim`` algorithms through torch's own
functional kernels; :func:`groups` gives groups of parameters their own
hyperparameters; docs/optimizers.md shows how to write a new optimizer.
"""

from fasttorch.optim._base import LearningRate, Optimizer, OptState, set_hyperparams
from fasttorch.optim.adam import Adam, adam, adamw
from fasttorch.optim.every import Every, every
from fasttorch.optim.groups import Groups, GroupsState, Selector, groups
from fasttorch.optim.sgd import SGD, sgd
from fasttorch.optim.torch_optim import TorchOptimizer, from_torch, load_torch_state_dict

__all__ = [
    "SGD",
    "Adam",
    "Every",
    "Groups",
    "GroupsState",
    "LearningRate",
    "OptState",
    "Optimizer",
    "Selector",
    "TorchOptimizer",
    "adam",
    "adamw",
    "every",
    "from_torch",
    "groups",
    "load_torch_state_dict",
    "set_hyperparams",
    "sgd",
]
