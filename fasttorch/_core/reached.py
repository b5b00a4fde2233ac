"""Whether a loss trained the state's parameters: the checks read from its graph.

A loss function that calls the model itself (``model(x)``) instead of ``apply(x)``
trains the module's own tensors, which only a donated eager state shares: under
``compiled`` or ``donate=False`` nothing would train, silently. :func:`check_reached`
raises instead, from facts about the backward's graph (no tensor is read), and
:func:`unreached_error` recovers its message from a compiler's wrapped error.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["NO_PARAMETER_REACHED", "check_reached", "unreached", "unreached_error"]

NO_PARAMETER_REACHED = "the loss function reached none of the state's parameters"
_USE_APPLY = (
    "the step would train nothing. If it calls the model itself (model(x), "
    "model.head(h)) or a copy of it (copy.deepcopy(model)), call apply(x) instead: "
    "apply runs the model with the state's parameters, which are not the model's own "
    "tensors under compiled or donate=False. A loss that uses no parameter cannot be "
    "trained"
)


def unreached(detail: str) -> ValueError:
    """The error for a loss that reached none of the state's parameters; ``detail``: how."""
    return ValueError(f"{NO_PARAMETER_REACHED} ({detail}): {_USE_APPLY}")


def unreached_error(error: BaseException) -> ValueError | None:
    """The :func:`check_reached` error that a compiler's trace wrapped in its own, if any.

    Raised while a graph is traced, the ``ValueError`` reaches the caller as the
    compiler's "unsupported: observed exception" with the message inside its text.
    """
    text = str(error)
    start = text.find(NO_PARAMETER_REACHED)
    if isinstance(error, ValueError) or start < 0:
        return None
    end = text.find(_USE_APPLY, start)
    if end < 0:  # the message cut short: the one without the detail
        return ValueError(f"{NO_PARAMETER_REACHED}: {_USE_APPLY}")
    return ValueError(text[start : end + len(_USE_APPLY)])


# Per module: the (loss phase, unused parameters) pairs whose graph was found clean.
_CHECKED: weakref.WeakKeyDictionary[Any, set[tuple[Any, frozenset[str]]]] = (
    weakref.WeakKeyDictionary()
)


def check_reached(
    value: torch.Tensor,
    module: Any,
    params: dict[str, torch.Tensor],
    unused: frozenset[str],
    loss: Any = None,
) -> None:
    """Raise if the loss trained the module's own tensors instead of the state's.

    ``apply`` runs the module with the state's parameters (``functional_call``); a loss
    that calls the module itself (``model(x)``) reaches the module's own parameters,
    which only a donated eager state shares: under ``compiled`` or ``donate=False``
    nothing would train, silently. Two signs, both read from the graph, not from
    values: no parameter of the state reached (checked in a graph too), or one of the
    module's own parameters in the backward's graph (eager; once per module, loss
    phase and set of unused parameters).
    """
    if len(unused) == len(params):
        raise unreached(f"it has {len(params)}")
    if torch.compiler.is_compiling():
        return
    seen = _CHECKED.setdefault(module, set())
    if (loss, unused) in seen:
        return
    own = {id(p): n for n, p in module.named_parameters() if n in params}
    hit = _reached_leaf(value, own)
    if hit is not None:
        raise ValueError(
            f"the loss function used the model's own parameter {hit!r} instead of the "
            "state's: it calls the model (or a part of it) directly, as model(x) or "
            "model.head(h). Those tensors are not trained under compiled or donate=False "
            "(the state's parameters are). Call the forward through apply: apply(x) for "
            "the whole model; for a part, return it from the model's forward"
        )
    seen.add((loss, unused))


def backward_leaves(value: torch.Tensor) -> Iterator[torch.Tensor]:
    """The leaves the backward of ``value`` accumulates into, walking its graph once."""
    seen: set[Any] = set()
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            yield variable
        stack.extend(fn for fn, _ in node.next_functions)


def _reached_leaf(value: torch.Tensor, leaves: dict[int, str]) -> str | None:
    """The name of a leaf in ``leaves`` (by id) the backward of ``value`` reaches, if any."""
    return next((leaves[id(v)] for v in backward_leaves(value) if id(v) in leaves), None)
