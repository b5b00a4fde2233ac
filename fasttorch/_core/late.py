"""A device scalar read on the host one call late, so that no step waits on the device.

Host-side policies around a step (``skip_nonfinite``'s limit, ``with_amp``'s loss-scale
floor) need a counter the step computed. Reading it at once would make the host wait for
the device. Instead each call starts a non-blocking copy of the new value into pinned
memory, and the next call reads the copies that have landed.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

__all__ = ["LateRead"]


class LateRead:
    """Copies of one device scalar, started after each call and read when they landed."""

    def __init__(self) -> None:
        self.last: weakref.ref[Any] | None = None
        self.queue: deque[tuple[torch.Tensor, Any]] = deque()

    def push(self, value: torch.Tensor, new: Any) -> None:
        """Start copying ``value`` (a 0-d device tensor of the state ``new``) to the host."""
        host = torch.empty((), dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        event = torch.cuda.Event() if value.device.type == "cuda" else None  # type: ignore[no-untyped-call]
        if event is not None:
            event.record()
        self.queue.append((host, event))
        self.last = weakref.ref(new)

    def landed(self, state: Any) -> list[float]:
        """The values copied so far for ``state``'s run of calls; copies of another
        state's values (the caller switched states) are dropped."""
        if self.last is None or self.last() is not state:
            self.queue.clear()
        seen = []
        while self.queue and (self.queue[0][1] is None or self.queue[0][1].query()):
            seen.append(float(self.queue.popleft()[0]))
        return seen
