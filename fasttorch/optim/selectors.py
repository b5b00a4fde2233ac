"""Parameter selectors: which parameters a group of :func:`~fasttorch.optim.groups` takes."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

import attrs
from torch import Tensor, nn

__all__ = [
    "EMBEDDINGS",
    "NORMALIZATION",
    "ModuleSelector",
    "Selector",
    "in_module",
    "is_bias",
    "matches",
    "with_module",
]

NORMALIZATION: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)
"""torch's normalization layers: the classes torchvision's ``set_weight_decay`` gives
``norm_weight_decay`` (every batch and instance norm, ``LayerNorm``, ``GroupNorm``,
``LocalResponseNorm``), named by their public classes, and ``RMSNorm``. Subclasses
match too (``isinstance``)."""

EMBEDDINGS: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
"""torch's embedding layers."""


@attrs.frozen
class ModuleSelector:
    """A selector that also reads the module that owns each parameter (built by
    :func:`in_module` or :func:`with_module`).

    ``predicate(name, tensor, module)``: ``name`` the parameter's full name, ``module``
    the submodule it is registered on (``model.get_submodule`` of the name's prefix).
    The module is the one :meth:`Groups.init` is given (``TrainState.create`` gives
    its model).
    """

    predicate: Callable[[str, Tensor, nn.Module], bool]
    description: str

    def __call__(self, name: str, tensor: Tensor, module: nn.Module) -> bool:
        """Whether the parameter ``name`` (``tensor``), registered on ``module``, is taken."""
        return bool(self.predicate(name, tensor, module))

    def __repr__(self) -> str:
        return self.description


Selector = str | re.Pattern[str] | Callable[[str, Tensor], bool] | ModuleSelector
"""Which parameters a group takes: a glob on the name (``"*.bias"``, ``fnmatch``), a
compiled regular expression (``re.compile(r"blocks\\.[0-3]\\.")``, searched in the
name), a predicate ``(name, tensor) -> bool`` that reads names, shapes and dtypes
(not values), or a :class:`ModuleSelector` that also reads the module owning the
parameter (:func:`in_module`, :func:`with_module`). Selectors run once, when the state
is created (:meth:`Groups.init`): a step, compiled or not, reads the parameter names
they chose."""


def in_module(*types: type[nn.Module]) -> ModuleSelector:
    """Selects the parameters registered on a module of one of ``types`` (``isinstance``).

    ``in_module(*NORMALIZATION)`` is torchvision's ``norm_classes`` rule,
    ``in_module(*EMBEDDINGS)`` takes embedding tables.

    Args:
        types: ``nn.Module`` classes, at least one.

    Returns:
        A :class:`ModuleSelector`.

    Raises:
        TypeError: no types, or one that is not an ``nn.Module`` class.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch import optim
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> opt = optim.groups(optim.adamw(1e-3), [(optim.in_module(*optim.NORMALIZATION),
        ...                                         {"weight_decay": 0.0})])
        >>> fasttorch.TrainState.create(model, opt).opt_state.names
        (('0.weight', '0.bias'), ('1.weight', '1.bias'))
    """
    if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(
            f"in_module takes nn.Module classes, got {types!r}. Pass e.g. "
            "in_module(torch.nn.LayerNorm) or in_module(*fasttorch.optim.NORMALIZATION)."
        )
    names = ", ".join(t.__name__ for t in types)
    return ModuleSelector(lambda name, p, m: isinstance(m, types), f"in_module({names})")


def with_module(predicate: Callable[[str, Tensor, nn.Module], bool]) -> ModuleSelector:
    """A selector from a predicate ``(name, tensor, module) -> bool``, where ``module``
    is the submodule the parameter is registered on (its type, its attributes).

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> heads = optim.with_module(lambda n, p, m: getattr(m, "out_features", 0) == 1)
        >>> heads("0.weight", torch.ones(1, 4), torch.nn.Linear(4, 1))
        True
    """
    if not callable(predicate) or isinstance(predicate, nn.Module) or _is_module_class(predicate):
        raise TypeError(
            f"with_module takes a predicate (name, tensor, module) -> bool, got {predicate!r}."
            " To select by the owning module's type, use in_module(torch.nn.LayerNorm, ...)."
        )
    return ModuleSelector(predicate, f"with_module({getattr(predicate, '__name__', predicate)})")


def _is_module_class(x: object) -> bool:
    return isinstance(x, type) and issubclass(x, nn.Module)


def is_bias(name: str, tensor: Tensor) -> bool:
    """Selects parameters registered under the attribute name ``bias`` (``"fc.bias"``,
    ``"bias"``; not ``"attn_bias"``): torchvision's custom key ``"bias"``, timm's
    ``name.endswith(".bias")``.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> [optim.is_bias(n, torch.ones(1)) for n in ("fc.bias", "bias", "fc.attn_bias")]
        [True, True, False]
    """
    return name.rpartition(".")[2] == "bias"


def matches(selector: Selector, name: str, tensor: Tensor, module: nn.Module | None) -> bool:
    """Whether ``selector`` takes the parameter ``name`` (``tensor``); ``module`` is the
    model the name comes from, which a :class:`ModuleSelector` reads (required then).

    Example:
        >>> import torch
        >>> matches("*.bias", "fc.bias", torch.ones(1), None)
        True
    """
    if isinstance(selector, str):
        return fnmatch.fnmatchcase(name, selector)
    if isinstance(selector, re.Pattern):
        return selector.search(name) is not None
    if isinstance(selector, ModuleSelector):
        return selector(name, tensor, _owner(module, selector, name))
    return bool(selector(name, tensor))


def _owner(module: nn.Module | None, selector: ModuleSelector, name: str) -> nn.Module:
    """The submodule of ``module`` that registers the parameter ``name``."""
    if module is None:
        raise ValueError(
            f"groups: the selector {selector!r} reads the module that owns each "
            "parameter, and no module was given to choose the groups (an optimizer "
            "state built from parameters alone, or a state that names no groups). Build "
            "the state with fasttorch.TrainState.create(model, opt), which gives the "
            "model, or call opt.init(params, module=model)."
        )
    prefix = name.rpartition(".")[0]
    try:
        return module.get_submodule(prefix)
    except AttributeError as e:
        raise ValueError(
            f"groups: the selector {selector!r} looks for the module that owns parameter "
            f"{name!r}, and {type(module).__name__} has no submodule {prefix!r}. Give "
            "init the module whose named_parameters() the parameters came from."
        ) from e
