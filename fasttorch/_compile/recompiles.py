"""Recompiles that explain themselves: what ``compiled`` says when a step recompiles.

Dynamo compiles a function for the exact inputs of its first call and guards that
compiled version (tensor shapes, dtypes, the Python attributes the code read). When a
later call fails a guard, it compiles the function again: a pause of seconds to minutes
that ``torch.compile`` does not mention. ``compiled`` watches each of its functions and
says, once per recompile, which guard failed, in words, and how to avoid it
(:class:`RecompileWarning`). It also holds each function to a budget of compiled
versions: past it dynamo would run the function eagerly, silently; ``compiled`` raises
:class:`RecompileLimitError` instead.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any

import attrs
import torch

from fasttorch import _compat
from fasttorch.state import TrainState

__all__ = ["RecompileLimitError", "RecompileWarning", "Recompiles", "explain"]

# torch.compile's own default (torch._dynamo.config.recompile_limit).
DEFAULT_LIMIT = 8


class RecompileWarning(UserWarning):
    """A compiled step compiled one of its functions again; the message says why.

    Turn it into an error to catch recompiles in a test:
    ``warnings.simplefilter("error", fasttorch.RecompileWarning)``.
    """


class RecompileLimitError(RuntimeError):
    """A compiled step's function needed more compiled versions than its budget."""


@attrs.define
class Recompiles:
    """The recompile record of one compiled function (its own code object)."""

    name: str
    limit: int
    code: Any
    seen: int = 0
    count: int = 0
    reported: set[str] = attrs.field(factory=set)
    history: list[str] = attrs.field(factory=list)

    def check(self, args: tuple[Any, ...]) -> None:
        """Warn once for each recompile dynamo recorded since the last call."""
        reasons = _compat.guard_failures(self.code)
        if reasons is None:
            return
        if len(reasons) < self.seen:  # dynamo was reset: its record starts again
            self.seen = 0
        new = reasons[self.seen :]
        self.seen = len(reasons)
        if not new:
            return
        # One recompile appends one reason per earlier version, newest first: the
        # newest version is the one the previous calls ran, so its reason is the change.
        self.count += 1
        guard = _guard_text(new[0])
        what, fix = explain(guard, args)
        self.history.append(what)
        key = re.sub(r"\d+", "#", guard)
        again = " (again)" if key in self.reported else ""
        self.reported.add(key)
        warnings.warn(
            f"compiled: {self.name} was compiled again{again} (recompile {self.count}; at "
            f"most {self.limit} compiled versions, compiled(..., recompile_limit=)): "
            f"{what}. {fix}. The guard that failed: {guard}",
            RecompileWarning,
            stacklevel=_caller_level(),
        )

    def limit_error(self, err: BaseException) -> RecompileLimitError:
        """The error to raise when dynamo refused one more compiled version."""
        seen = "; ".join(f"{i + 1}. {h}" for i, h in enumerate(self.history)) or "none recorded"
        return RecompileLimitError(
            f"compiled: {self.name} needed more than its budget of {self.limit} compiled "
            f"versions (recompile_limit={self.limit}); past it torch.compile would run it "
            f"eagerly, without a word. Its recompiles: {seen}. Remove their cause (the "
            "fixes were given with each RecompileWarning), mark a changing dimension "
            "dynamic (torch._dynamo.mark_dynamic(x, dim), or compiled(..., dynamic=True)), "
            f"or raise the budget: compiled(..., recompile_limit=N). Dynamo said: {err}"
        )


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel for the first frame outside fasttorch and torch."""
    package = os.path.dirname(os.path.dirname(__file__))  # fasttorch/, above _compile/
    inside = (package + os.sep, os.path.dirname(torch.__file__) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _guard_text(reason: str) -> str:
    """A dynamo reason without its compile id and user stack trace."""
    text = reason.split("\nUser stack trace:", 1)[0]
    text = re.sub(r"^\s*\d+/\d+:\s*", "", text)
    return re.sub(r"\bL\['([A-Za-z_]\w*)'\]", r"\1", text).strip()


def _name(source: str, args: tuple[Any, ...]) -> str:
    """``args[0].module.x`` as ``state.module.x`` where argument 0 is the train state."""

    def one(m: re.Match[str]) -> str:
        i = int(m.group(1))
        return "state" if i < len(args) and isinstance(args[i], TrainState) else m.group(0)

    return re.sub(r"args\[(\d+)\]", one, source)


_SIZE = re.compile(r"tensor '([^']+)' size mismatch at index (\d+)\. expected (\d+), actual (\d+)")
_STRIDE = re.compile(r"tensor '([^']+)' stride mismatch")
_META = re.compile(r"tensor '([^']+)' (dtype|device|requires_grad|dispatch key set) mismatch")
_ATTR = re.compile(r"___dict_contains\('(\w+)', ([\w\[\]'.]+?)\.__dict__\)")
_VALUE = re.compile(r"([\w\[\]'.]+\.\w+) (?:==|is|is not|!=) ")
_OBJ = re.compile(r"___check_(?:obj_id|type_id)\(([\w\[\]'.]+)")
_LEN = re.compile(r"len\(([\w\[\]'.]+)\) ==")

_SHAPE_FIX = (
    "Give every call the same shapes: drop the last, smaller batch of an epoch "
    "(DataLoader(..., drop_last=True)) or pad it, and under grad_accumulate give a batch "
    "size that the number of microbatches divides; where sizes really vary, mark the "
    "dimension dynamic (torch._dynamo.mark_dynamic(x, dim) on the batch before the call, "
    "or compiled(..., dynamic=True)). Dynamo makes a dimension dynamic by itself after "
    "its first change, so one such recompile per dimension is expected"
)
_ATTR_FIX = (
    "The step read a Python attribute that changed between calls, typically one the "
    "model sets on its first forward (Hugging Face models set config.problem_type). "
    "Set it before the first step (e.g. model.config.problem_type = "
    '"single_label_classification"), or keep values that change in the state as tensors'
)


def explain(guard: str, args: tuple[Any, ...]) -> tuple[str, str]:
    """``(what changed, how to avoid it)`` for a dynamo guard, in a user's words."""
    if m := _SIZE.search(guard):
        where, dim, was, now = m.groups()
        return (
            f"{_name(where, args)} changed size in dimension {dim}, from {was} to {now}",
            _SHAPE_FIX,
        )
    if m := _STRIDE.search(guard):
        return (
            f"{_name(m.group(1), args)} has another memory layout (strides) than before",
            "Pass tensors of one layout: call .contiguous() on the batch",
        )
    if m := _META.search(guard):
        return (
            f"the {m.group(2)} of {_name(m.group(1), args)} changed",
            "Give every call tensors of the same dtype, device and requires_grad",
        )
    if m := _ATTR.search(guard):
        owner = _name(m.group(2), args)
        return (f"the attribute {owner}.{m.group(1)} appeared or disappeared", _ATTR_FIX)
    if m := _OBJ.search(guard) or _VALUE.search(guard):
        return (f"the Python value {_name(m.group(1), args)} changed", _ATTR_FIX)
    if m := _LEN.search(guard):
        return (
            f"the number of items in {_name(m.group(1), args)} changed",
            "Give every call containers of the same length (the batch's structure, the "
            "state's parameters)",
        )
    if "global_state" in guard or "grad_mode" in guard:
        return (
            "torch's global settings changed (grad mode, autocast, default dtype, "
            "deterministic algorithms)",
            "Set them once before the first step, not between calls",
        )
    return ("a guard on the inputs failed", "See the guard below for what changed")
