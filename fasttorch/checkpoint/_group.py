"""The ranks of a ``torch.distributed`` job agree: on a problem before a collective
would hang, on a value of rank 0, and on the gloo group that background saves use.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _rank_world(pg: Any = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(pg), dist.get_world_size(pg)
    return 0, 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_async_groups: dict[int, Any] = {}


def _async_group() -> Any:
    """A gloo group of its own for background saves, so they never interleave with the
    collectives of training steps on the default group. Created collectively, once."""
    if not _distributed():
        return None
    key = id(dist.group.WORLD)
    if key not in _async_groups:
        _async_groups[key] = dist.new_group(backend="gloo")
    return _async_groups[key]


def _agree(problem: Exception | None, api: str) -> None:
    """Raise on every rank if any rank found a problem, before a collective would hang."""
    if not _distributed():
        if problem is not None:
            raise problem
        return
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if problem is None else (type(problem), str(problem)))
    for r, item in enumerate(found):
        if item is not None:
            cls, msg = item
            if problem is not None:
                raise problem
            raise cls(f"{api} failed on rank {r}: {msg}")


def _broadcast(value: Any, pg: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=pg)
    return box[0]
