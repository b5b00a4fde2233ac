"""The user's ``data``: checked and stored as JSON, so that loading it never runs code.

Format 1 pickled it in a :class:`_Box`, read only with ``trust_pickled=True``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from fasttorch.checkpoint._errors import CheckpointError


class _Box:
    """The pickled wrapper of ``data`` in format-1 checkpoints (read with trust_pickled)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _check_json(value: Any, where: str) -> None:
    """Raise unless ``value`` comes back from JSON exactly as it is (type included)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(
                f"checkpoint data must be JSON; {where} is {value!r}, which JSON cannot "
                "hold. Store it as a string or None"
            )
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"checkpoint data must be JSON; {where} has the key {k!r} "
                    f"({type(k).__name__}), and JSON keys are strings. Use str keys"
                )
            _check_json(v, f"{where}[{k!r}]")
        return
    hint = "use a list" if isinstance(value, tuple) else "convert it to those types first"
    raise TypeError(
        f"checkpoint data must be JSON (dict with str keys, list, str, int, float, bool, "
        f"None), so that loading it can never run code; {where} is a "
        f"{type(value).__name__}: {hint}"
    )


def _encode_data(data: Any) -> torch.Tensor:
    _check_json(data, "data")
    blob = json.dumps(data, allow_nan=False).encode()
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _decode_data(blob: torch.Tensor, where: str) -> Any:
    try:
        return json.loads(bytes(blob.numpy()).decode())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {where}: its data is not valid JSON: {e}") from e
