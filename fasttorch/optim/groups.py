"""Parameter groups: other hyperparameters (or another optimizer) for some parameters."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from fasttorch import struct
from fasttorch.optim._base import Optimizer, OptState, in_place_in_graph, update_outside_graphs
from fasttorch.optim.selectors import (
    EMBEDDINGS,
    NORMALIZATION,
    ModuleSelector,
    Selector,
    in_module,
    is_bias,
    matches,
    with_module,
)

__all__ = [
    "EMBEDDINGS",
    "NORMALIZATION",
    "Groups",
    "GroupsState",
    "ModuleSelector",
    "Selector",
    "groups",
    "in_module",
    "is_bias",
    "with_module",
]


class GroupsState(OptState):
    """The state of a :class:`Groups` optimizer: an :class:`OptState` that also names
    the parameters of each group, chosen by the selectors when it was created.

    The names are static (not leaves): a compiled step reads them as constants instead
    of running the selectors in its graph (a glob's ``fnmatch`` does not trace), and a
    checkpoint's template brings them back.

    Attributes:
        names: per optimizer of the :class:`Groups` (the default first), the names of
            its parameters, in the parameters' order.
    """

    names: tuple[tuple[str, ...], ...] = struct.field(static=True, default=())


def _is_module(selector: Selector) -> bool:
    return isinstance(selector, ModuleSelector)


def _derive(default: Optimizer, overrides: Mapping[str, Any] | Optimizer) -> Optimizer:
    """``default`` with ``overrides`` applied, or ``overrides`` itself if an optimizer."""
    if not isinstance(overrides, Mapping):
        if not (hasattr(overrides, "init") and hasattr(overrides, "update")):
            raise TypeError(
                "groups: each rule is (selector, overrides) where overrides is a dict of "
                "hyperparameters or a fasttorch optimizer, got "
                f"{type(overrides).__name__}. Pass e.g. ('*.bias', {{'weight_decay': 0.0}})."
            )
        return overrides
    replace = getattr(default, "replace", None)
    try:
        if callable(replace):
            return replace(**overrides)  # type: ignore[no-any-return]
        if attrs.has(type(default)):
            return attrs.evolve(default, **overrides)  # type: ignore[misc]
    except TypeError as e:
        raise TypeError(
            f"groups: cannot override {sorted(overrides)} on {type(default).__name__}: {e}. "
            "Use the optimizer's own argument names (lr, weight_decay, betas, ...)."
        ) from e
    raise TypeError(
        f"groups: {type(default).__name__} has no way to replace hyperparameters (neither "
        "a replace(**overrides) method nor an attrs class); give each rule a whole "
        "optimizer instead of a dict."
    )


@attrs.frozen
class Groups:
    """An optimizer that updates groups of parameters with their own optimizers.

    Built by :func:`groups`; ``optimizers[0]`` is the default, ``optimizers[i + 1]``
    the one of ``selectors[i]``.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> opt = Groups(("*.bias",), (optim.sgd(0.1), optim.sgd(0.01)))
        >>> sorted(opt.init({"a.weight": torch.ones(1), "a.bias": torch.ones(1)}).hyper)
        ['group0.lr', 'group0.weight_decay', 'lr', 'weight_decay']
    """

    selectors: tuple[Selector, ...]
    optimizers: tuple[Optimizer, ...]
    # The globs as anchored regular expressions, translated once: the selectors that a
    # step must run itself (a state that does not name the groups, a group of groups)
    # then trace under compile, which fnmatch does not.
    _patterns: tuple[Selector, ...] = attrs.field(init=False, eq=False, repr=False)

    @property
    def in_place_in_graph(self) -> bool:
        """Whether a group's optimizer updates in place in a donated compiled CPU step
        (``adam(..., opaque=True)``): ``inplace`` is passed on to those only."""
        return any(in_place_in_graph(opt) for opt in self.optimizers)

    @property
    def update_outside_graphs(self) -> bool:
        """Whether a group's optimizer cannot be traced (``from_torch(..., fused=True)``):
        then a compiled CPU step that donates its state runs the whole update outside
        its graphs (``optim._base.update_outside_graphs``)."""
        return any(update_outside_graphs(opt) for opt in self.optimizers)

    @_patterns.default
    def _translate(self) -> tuple[Selector, ...]:
        return tuple(
            re.compile("^" + fnmatch.translate(s)) if isinstance(s, str) else s
            for s in self.selectors
        )

    #: :class:`~fasttorch.TrainState` passes ``module=`` to ``init`` (module selectors).
    init_reads_module = True

    def assign(
        self, params: Mapping[str, Tensor], module: nn.Module | None = None
    ) -> dict[str, int]:
        """Each parameter's optimizer index: the first matching rule's, else 0.

        ``module``: the model the parameters' names come from, which a
        :class:`ModuleSelector` reads (required when there is one).
        """
        out = {}
        for name, p in params.items():
            out[name] = next(
                (i + 1 for i, s in enumerate(self._patterns) if matches(s, name, p, module)), 0
            )
        return out

    def _split(
        self,
        params: Mapping[str, Tensor],
        opt_state: OptState | None = None,
        module: nn.Module | None = None,
    ) -> list[list[str]]:
        """Each optimizer's parameter names: as ``opt_state`` names them when it names
        every one of ``params`` (a subset when unreached ones are skipped), else chosen
        by the selectors now (a state built by hand, a group of groups)."""
        chosen = opt_state.names if isinstance(opt_state, GroupsState) else ()
        if chosen and {n for names in chosen for n in names}.issuperset(params):
            return [[n for n in names if n in params] for names in chosen]
        where = self.assign(params, module)
        return [[n for n in params if where[n] == i] for i in range(len(self.optimizers))]

    @staticmethod
    def _prefix(i: int) -> str:
        return "" if i == 0 else f"group{i - 1}."

    def init(self, params: Mapping[str, Tensor], *, module: nn.Module | None = None) -> GroupsState:
        """Each group's optimizer's state, merged: hyperparameters of rule ``i`` prefixed
        ``"group{i}."``, slots by parameter name, and each group's parameter names.

        ``module``: the model the parameters' names come from, which module selectors
        (:func:`in_module`) read; :meth:`fasttorch.TrainState.create` passes its model.
        """
        parts = self._split(params, module=module)
        for i, names in enumerate(parts[1:]):
            if not names:
                raise ValueError(
                    f"groups: rule {i} (selector {self.selectors[i]!r}) matches no "
                    f"parameter that an earlier rule did not take; parameters: "
                    f"{list(params)[:8]}{' ...' if len(params) > 8 else ''}. Fix the "
                    "selector or drop the rule."
                )
        hyper: dict[str, Tensor] = {}
        slots: dict[str, dict[str, Tensor]] = {}
        count = None
        for i, (opt, names) in enumerate(zip(self.optimizers, parts)):
            sub_params = {n: params[n] for n in names}
            if getattr(opt, "init_reads_module", False):
                sub = opt.init(sub_params, module=module)  # type: ignore[call-arg]
            else:
                sub = opt.init(sub_params)
            count = sub.count if count is None else count
            hyper.update({self._prefix(i) + k: v for k, v in sub.hyper.items()})
            for k, v in sub.slots.items():
                slots.setdefault(k, {}).update(v)
        assert count is not None
        chosen = tuple(tuple(n) for n in parts)
        return GroupsState(count=count, hyper=hyper, slots=slots, names=chosen)

    def _sub_state(self, opt_state: OptState, i: int, names: list[str], count: Tensor) -> OptState:
        prefix = self._prefix(i)
        # The default group's names carry no prefix and no dot; a rule's keep whatever
        # follows its prefix, dots included (a rule whose optimizer is itself groups()
        # has "group0.weight_decay" of its own, stored as "group1.group0.weight_decay").
        hyper = {
            k[len(prefix) :]: v
            for k, v in opt_state.hyper.items()
            if (k.startswith(prefix) if prefix else "." not in k)
        }
        slots = {
            k: {n: v[n] for n in names if n in v}
            for k, v in opt_state.slots.items()
            if any(n in v for n in names)
        }
        return OptState(count=count, hyper=hyper, slots=slots)

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        """The default group's learning rate."""
        return self.optimizers[0].learning_rate(
            self._sub_state(opt_state, 0, [], opt_state.count), step
        )

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        inplace: bool = False,
    ) -> tuple[dict[str, Tensor], OptState]:
        """Each group's update on its own parameters; results in the input's key order."""
        new_params: dict[str, Tensor] = {}
        slots: dict[str, dict[str, Tensor]] = {}
        for i, (opt, names) in enumerate(zip(self.optimizers, self._split(params, opt_state))):
            if not names:
                continue
            # In a graph, in place only for an optimizer written for it (in_place_in_graph).
            own = inplace and (not torch.compiler.is_compiling() or in_place_in_graph(opt))
            # In place, an optimizer may advance the count it is given: each gets a copy.
            count = opt_state.count.clone() if own else opt_state.count
            sub = self._sub_state(opt_state, i, names, count)
            p, s = opt.update(
                {n: params[n] for n in names},
                {n: grads[n] for n in names},
                sub,
                step,
                inplace=own,
            )
            new_params.update(p)
            for k, v in s.slots.items():
                slots.setdefault(k, {}).update(v)
        count = opt_state.count.add_(1) if inplace else opt_state.count + 1
        ordered = {n: new_params[n] for n in params}
        return ordered, opt_state.replace(count=count, slots=slots)

    def fused_update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> tuple[dict[str, Tensor], OptState] | None:
        """Each group's ``fused_update`` (torch's fused kernel, loss scale and skip flag
        inside), when every group's optimizer can take it; else ``None``, nothing done."""
        parts = []
        for i, (opt, names) in enumerate(zip(self.optimizers, self._split(params, opt_state))):
            if not names:
                continue
            sub_params = {n: params[n] for n in names}
            sub_grads = {n: grads[n] for n in names}
            can_fuse = getattr(opt, "can_fuse", None)
            sub = self._sub_state(opt_state, i, names, opt_state.count)
            if can_fuse is None or not can_fuse(sub_params, sub_grads, sub):
                return None
            parts.append((i, opt, names, sub_params, sub_grads))
        for i, opt, names, sub_params, sub_grads in parts:
            # Each advances the count it is given: a copy.
            sub = self._sub_state(opt_state, i, names, opt_state.count.clone())
            done = opt.fused_update(  # type: ignore[attr-defined]
                sub_params, sub_grads, sub, step, grad_scale=grad_scale, found_inf=found_inf
            )
            assert done is not None  # can_fuse said so
        count = opt_state.count.add_(1 if found_inf is None else found_inf.logical_not())
        return dict(params), opt_state.replace(count=count)


def groups(
    default: Optimizer,
    rules: Sequence[tuple[Selector, Mapping[str, Any] | Optimizer]],
) -> Groups:
    """Parameter groups: some parameters get other hyperparameters, or another optimizer.

    Each rule is ``(selector, overrides)``. ``overrides`` is a dict of hyperparameters
    applied to ``default`` (``{"weight_decay": 0.0}``, ``{"lr": 1e-5}``) or a whole
    optimizer (Muon for matrices, AdamW for the rest). A parameter takes the **first**
    rule whose selector matches it (so put specific rules before general ones); a
    parameter no rule matches takes ``default``. A rule that matches no parameter is an
    error when the state is created (a mistyped pattern). Works with fasttorch's own
    optimizers, :func:`~fasttorch.optim.from_torch` ones and any other.

    The state holds every group's hyperparameters: the default's under their own names
    (``"lr"``), rule ``i``'s as ``"group{i}.lr"`` (``set_hyperparams(state,
    **{"group0.lr": 1e-5})``); ``metrics["lr"]`` is the default group's.

    In a donated CPU step each group whose optimizer is opaque (``adamw``, ``adam`` and
    ``sgd``'s default) runs torch's fused kernel, one call per group, and a compiled
    step runs the update outside its graphs; where a group's optimizer is not opaque,
    the update is traced, and its compile time grows with their
    tensors (docs/optimizers.md, "Opaque update"). Where every group's optimizer can
    take it, the window's mean and the clip's coefficient are folded into each group's
    kernel; else they are one pass over the gradients first.

    Equivalent to ``torch.optim.AdamW([{"params": decay}, {"params": no_decay,
    "weight_decay": 0.0}], lr=lr, weight_decay=0.1)``.

    Args:
        default: the optimizer of unmatched parameters, and the base of dict overrides.
        rules: ``(selector, overrides)`` pairs; a selector is a glob on the name
            (``"*.bias"``), a compiled regular expression (searched), a predicate
            ``(name, tensor) -> bool`` on names, shapes, dtypes (:func:`is_bias`), or a
            module selector that reads the module owning the parameter
            (``in_module(*NORMALIZATION)``, ``in_module(*EMBEDDINGS)``,
            :func:`with_module`), resolved when ``TrainState.create`` builds the state.

    Returns:
        A :class:`Groups` optimizer.

    Raises:
        TypeError: a default that is not an optimizer, an override the optimizer does
            not have, or a rule of another shape.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch import optim
        >>> opt = optim.groups(
        ...     optim.adamw(1e-3, weight_decay=0.1),
        ...     [(lambda name, p: p.ndim < 2, {"weight_decay": 0.0})],
        ... )
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(3, 2), opt)
        >>> opt.assign(state.params), float(state.opt_state.hyper["group0.weight_decay"])
        ({'weight': 0, 'bias': 1}, 0.0)
    """
    if not all(callable(getattr(default, k, None)) for k in ("init", "update")):
        raise TypeError(
            f"groups: default must be an optimizer (with init and update), got "
            f"{default!r}. Pass e.g. fasttorch.optim.adamw(1e-3) or "
            "fasttorch.optim.from_torch(torch.optim.AdamW)."
        )
    if isinstance(rules, Mapping) or not all(isinstance(r, tuple) and len(r) == 2 for r in rules):
        raise TypeError(
            "groups: rules must be a list of (selector, overrides) pairs, got "
            f"{rules!r}. Pass e.g. [('*.bias', {{'weight_decay': 0.0}})]."
        )
    for selector, overrides in rules:
        if not (isinstance(selector, (str, re.Pattern)) or callable(selector)):
            raise TypeError(
                f"groups: a selector is a glob string, a re.Pattern, a predicate "
                f"(name, tensor) -> bool or a module selector (in_module, with_module), "
                f"got {selector!r}."
            )
        if isinstance(overrides, Groups) and any(map(_is_module, overrides.selectors)):
            raise TypeError(
                "groups: a rule's optimizer is groups(...) with a module selector "
                f"({next(s for s in overrides.selectors if _is_module(s))!r}); an inner "
                "groups chooses its parameters inside the step, where the module is not "
                "at hand. Put that rule in this call's list instead (a parameter takes "
                "the first rule that matches it)."
            )
    if isinstance(default, Groups):
        raise TypeError(
            "groups: the default optimizer is itself groups(...), whose rules' "
            "hyperparameters would take the outer rules' names (group0.lr, ...). Put its "
            "rules in this call's list instead, before the rules that should come after "
            "them; a rule's optimizer may be groups(...)"
        )
    return Groups(
        tuple(s for s, _ in rules),
        (default, *(_derive(default, o) for _, o in rules)),
    )
