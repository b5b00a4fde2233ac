"""A compiled step's error of the user's own code, reported as the eager call reports it.

An error in the traced code (a float label to ``cross_entropy``, a shape mismatch, a
``raise`` in the loss function) reaches the caller wrapped by dynamo: forty lines of
tracer output with the cause and the user's line buried in them. :func:`user_error`
gives back the user's own exception type and message, with the user's file and line
in a note, to be raised ``from`` dynamo's error, which stays on the chain.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import torch

from fasttorch import _compat

__all__ = ["user_error"]

# Frames under these directories are the library's or torch's, not the user's.
_NOT_USER = (str(Path(__file__).resolve().parents[1]), os.path.dirname(torch.__file__))


def user_error(err: BaseException) -> BaseException | None:
    """The user's error inside dynamo's ``err``, as a fresh exception of its own type.

    ``None`` when ``err`` is not dynamo's, holds no error of the traced code, or its
    type cannot be rebuilt from a message. For what dynamo refuses itself (a construct
    it cannot trace), ``err`` gains a note naming the user's line instead.
    """
    traced = _compat.traced_error(err)
    if traced is None:
        return None
    frame = _user_frame(traced.frames)
    if traced.kind is None:
        if frame is not None:
            err.add_note(f"fasttorch: compiled could not trace the step at {frame}")
        return None
    try:
        new = traced.kind(_unrepr(traced.message, traced.kind))
    except Exception:  # a type whose constructor wants more than a message
        return None
    if frame is not None:
        new.add_note(f"fasttorch: raised at {frame}")
    new.add_note(
        "fasttorch: found while compiled traced the step (the error an eager call of the "
        "step raises); the compiler's own report is the exception above"
    )
    return new


def _user_frame(frames: list[Any]) -> str | None:
    """``File "...", line n, in f: source`` of the innermost frame outside the library
    and torch, as a traceback shows it."""
    for f in reversed(frames):
        name = os.path.abspath(str(f.filename))
        if not name.startswith(_NOT_USER):
            line = (f.line or "").strip()
            return f'File "{f.filename}", line {f.lineno}, in {f.name}' + (
                f": {line}" if line else ""
            )
    return None


def _unrepr(text: str, kind: type[BaseException]) -> str:
    """The message of an exception dynamo only kept as its repr (``ValueError('x')``)."""
    head = f"{kind.__name__}("
    if not (text.startswith(head) and text.endswith(")")):
        return text
    try:
        value = ast.literal_eval(text[len(head) : -1])
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, str) else text
