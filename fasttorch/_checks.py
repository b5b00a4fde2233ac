"""Argument checks shared by every public function, and :func:`warn_once`.

Each check is made where the mistake is made (construction or wrap time, never inside
a step) and its error names the API, the argument, what was given and what is valid.
Python's ``bool`` is an ``int``, and ``10**400`` is an ``int`` that no float holds:
both are refused here in words rather than computed with (``True`` as a scale of 1)
or left to a bare ``OverflowError`` deep inside.

A value of the wrong type raises :class:`ArgumentTypeError`, a ``TypeError`` that is
also a ``ValueError`` so that callers catching either keep working; a value of the
right type out of its range raises ``ValueError``.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import TypeGuard

__all__ = ["ArgumentTypeError", "count", "flag", "is_int", "is_real", "real", "warn_once"]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError``, and a ``ValueError``)."""


def is_real(value: object) -> TypeGuard[numbers.Real]:
    """Whether ``value`` is a real number and not a bool (``True`` is an ``int``).

    For code that sorts values rather than refusing them (which metrics to log, what a
    file holds); an argument is checked with :func:`real`.

    Example:
        >>> is_real(0.5), is_real(3), is_real(True), is_real("1")
        (True, True, False, False)
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a bool; an argument is checked with :func:`count`.

    Example:
        >>> is_int(3), is_int(3.0), is_int(False)
        (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object) -> str:
    """``repr(value)``, shortened: ``10**400`` has 401 digits."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:25]}...{text[-10:]} ({len(text)} characters)"


def _given(value: object) -> str:
    return f"{_shown(value)} of type {type(value).__name__}"


def real(
    api: str,
    name: str,
    value: object,
    *,
    low: float | None = None,
    low_open: bool = False,
    high: float | None = None,
    high_open: bool = False,
    finite: bool = True,
    kind: str = "a number (an int or a float, not a bool)",
    rule: str = "",
    hint: str = "",
) -> float:
    """``float(value)`` once it is checked to be a real number (not a bool) in range.

    ``low``/``high`` bound it (inclusive unless ``low_open``/``high_open``); ``finite``
    refuses inf and NaN (NaN also fails any bound). ``kind`` says what a value of the
    wrong type should have been, ``rule`` what a value out of range should have been
    (default: the bounds, "finite and >= 0"); ``hint`` ends the error message.

    Example:
        >>> real("sgd", "lr", 3)
        3.0
        >>> real("sgd", "lr", -1, low=0.0)
        Traceback (most recent call last):
        ...
        ValueError: sgd: lr must be finite and >= 0, got lr=-1.
        >>> real("sgd", "lr", True)
        Traceback (most recent call last):
        ...
        fasttorch._checks.ArgumentTypeError: sgd: lr must be a number (an int or a float...
    """
    end = f" {hint}" if hint else ""
    if not is_real(value):
        raise ArgumentTypeError(f"{api}: {name} must be {kind}, got {_given(value)}.{end}")
    rule = rule or _rule(low, low_open, high, high_open, finite)
    try:
        x = float(value)
    except OverflowError:
        raise ValueError(
            f"{api}: {name} must be {rule}, got {name}={_shown(value)}, too large for a float.{end}"
        ) from None
    bounded = low is not None or high is not None
    bad = (
        (finite and not math.isfinite(x))
        or (bounded and math.isnan(x))
        or (low is not None and (x <= low if low_open else x < low))
        or (high is not None and (x >= high if high_open else x > high))
    )
    if bad:
        raise ValueError(f"{api}: {name} must be {rule}, got {name}={_shown(value)}.{end}")
    return x


def _rule(
    low: float | None, low_open: bool, high: float | None, high_open: bool, finite: bool
) -> str:
    parts = ["finite"] if finite else []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    return " and ".join(parts) or "a number"


def count(
    api: str, name: str, value: object, *, low: int = 1, kind: str = "", hint: str = ""
) -> int:
    """``value`` once it is checked to be an ``int`` (not a bool) ``>= low``.

    ``kind`` words what is valid (default "an integer >= low"); ``hint`` ends the error
    message.

    Example:
        >>> count("grad_accumulate", "n", 4)
        4
        >>> count("grad_accumulate", "n", "4")
        Traceback (most recent call last):
        ...
        fasttorch._checks.ArgumentTypeError: grad_accumulate: n must be an integer >= 1, got '4'...
    """
    end = f" {hint}" if hint else ""
    kind = kind or f"an integer >= {low}"
    message = f"{api}: {name} must be {kind}, got {_given(value)}.{end}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(message)
    if value < low:
        raise ValueError(message)
    return int(value)


def flag(api: str, name: str, value: object) -> bool:
    """``value`` once it is checked to be a ``bool`` (``'no'`` and ``1`` are not).

    Example:
        >>> flag("fasttorch.step", "donate", "no")
        Traceback (most recent call last):
        ...
        fasttorch._checks.ArgumentTypeError: fasttorch.step: donate must be a bool...
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(
            f"{api}: {name} must be a bool (True or False), got {_given(value)}."
        )
    return value


@functools.cache
def warn_once(message: str) -> None:
    """``warnings.warn(message)`` the first time this process says ``message``."""
    warnings.warn(message, UserWarning, stacklevel=4)
