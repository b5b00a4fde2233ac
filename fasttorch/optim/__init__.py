"""Functional optimizers: pure ``init`` / ``update`` pairs matching ``torch.optim``.

Each optimizer is a frozen configuration object; its state is an :class:`OptState`
pytree whose hyperparameters are 0-d tensors, so a compiled step never recompiles when
they change. Updates use torch's ``_foreach_*`` kernels and never modify their inputs.
"""

from fasttorch.optim._base import LearningRate, Optimizer, OptState, set_hyperparams
from fasttorch.optim.adam import Adam, adam, adamw
from fasttorch.optim.sgd import SGD, sgd

__all__ = [
    "SGD",
    "Adam",
    "LearningRate",
    "OptState",
    "Optimizer",
    "adam",
    "adamw",
    "set_hyperparams",
    "sgd",
]
