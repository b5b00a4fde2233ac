"""What a schedule is, and the checks every schedule's fields share.

A schedule is a callable from the int64 0-d step tensor to a 0-d float64 tensor. The
validators here turn a bad field into a ``ValueError`` (or ``TypeError``) naming the
schedule, the field, the value given and what is valid, when the schedule is built.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import attrs
import torch
from torch import Tensor

from fasttorch import _checks

__all__ = ["F64", "Schedule", "choice", "count", "number", "steps"]

Schedule = Callable[[Tensor], Tensor]
"""Any callable from the int64 0-d step tensor to a 0-d float64 tensor."""

F64 = torch.float64

_Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]


def number(
    name: str, *, low: float | None = None, strict: bool = False, high: float | None = None
) -> _Validator:
    """An attrs validator: a finite real number, optionally ``> low`` / ``>= low``, ``<= high``."""

    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        _checks.real(type(inst).__name__, name, value, low=low, low_open=strict, high=high)

    return check


def count(name: str, *, low: int = 1) -> _Validator:
    """An attrs validator: an int ``>= low`` (a number of steps; positive by default)."""
    hint = f"A number of steps: {'a positive int' if low == 1 else f'an int >= {low}'}."

    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        _checks.count(type(inst).__name__, name, value, low=low, hint=hint)

    return check


def choice(name: str, valid: Collection[str]) -> _Validator:
    """An attrs validator: one of the strings ``valid``."""

    def check(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in valid:
            raise ValueError(
                f"{type(inst).__name__}: {name} must be one of {sorted(valid)}, got {value!r}."
            )

    return check


def steps(step: Tensor) -> Tensor:
    """The step counter as float64 (exact below 2**53)."""
    return step.to(F64)
