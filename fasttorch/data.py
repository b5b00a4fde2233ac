"""Input pipeline: copy the next batches to the device while the current step runs.

:func:`prefetch` overlaps host-to-device copies with compute (pinned memory,
``non_blocking=True``, a side CUDA stream); :func:`loader_defaults` gives the
``DataLoader`` settings that keep the device fed.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["loader_defaults", "prefetch"]


def prefetch(loader: Iterable[Any], device: torch.device | str, *, depth: int = 2) -> Iterator[Any]:
    """Iterate over ``loader`` with its batches on ``device``, ``depth`` batches ahead.

    On CUDA each batch's tensors are pinned (unless the loader already pins them,
    ``pin_memory=True``) and copied with ``non_blocking=True`` on a side stream while
    the current step runs on the main stream. Before a batch is handed out the main
    stream waits for its copy, and each tensor is ``record_stream``-ed on the main
    stream so its memory is not reused while the step still reads it. Elsewhere (CPU)
    the batches are moved with ``.to(device)`` and yielded as they come: there is no
    copy to overlap. Non-tensor leaves pass through.

    Equivalent to, with the copy of batch ``i + 1`` overlapping step ``i``::

        for batch in loader:
            batch = [t.to(device, non_blocking=True) for t in batch]
            state, metrics = step(state, batch)

    Args:
        loader: any iterable of batches (pytrees of tensors), e.g. a ``DataLoader``.
        device: where the step runs.
        depth: how many batches to copy ahead (``>= 1``); 2 hides one copy behind
            one step with room for jitter.

    Returns:
        An iterator of the batches on ``device``.

    Example:
        >>> import torch
        >>> from fasttorch.data import prefetch
        >>> batches = [(torch.ones(2, 3), torch.zeros(2)) for _ in range(3)]
        >>> [x.device.type for x, y in prefetch(batches, "cpu")]
        ['cpu', 'cpu', 'cpu']
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"prefetch: depth must be an integer >= 1, got {depth!r}")
    if not isinstance(loader, Iterable):
        raise TypeError(f"prefetch: loader must be iterable, got {type(loader).__name__}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return _cuda_prefetch(iter(loader), dev, depth)
    return _plain(iter(loader), dev)


def _plain(it: Iterator[Any], device: torch.device) -> Iterator[Any]:
    for batch in it:
        yield _map(lambda t: t.to(device), batch)


def _map(fn: Any, batch: Any) -> Any:
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, batch)


def _cuda_prefetch(it: Iterator[Any], device: torch.device, depth: int) -> Iterator[Any]:
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    queue: collections.deque[tuple[Any, torch.cuda.Event]] = collections.deque()

    def load() -> None:
        try:
            batch = next(it)
        except StopIteration:
            return
        with torch.cuda.stream(side):
            moved = _map(lambda t: _pinned(t).to(device, non_blocking=True), batch)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        queue.append((moved, done))

    for _ in range(depth):
        load()
    while queue:
        moved, done = queue.popleft()
        main = torch.cuda.current_stream(device)
        main.wait_event(done)
        for t in pytree.tree_leaves(moved):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                # Allocated on the side stream, used on the main one: without this the
                # caching allocator could hand the memory out again mid-step.
                t.record_stream(main)
        load()  # start the next copy before the step runs on this batch
        yield moved


def _pinned(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def loader_defaults(device: torch.device | str, *, max_workers: int = 8) -> dict[str, Any]:
    """``DataLoader`` keyword arguments that keep ``device`` fed; override any of them.

    * ``num_workers``: worker processes that load and collate batches in parallel with
      the step: ``min(max_workers, usable CPUs - 1)`` (one core left for the training
      process itself), ``0`` on a one-core machine (load in the main process).
    * ``pin_memory``: ``True`` for CUDA: page-locked host buffers make the copy to the
      device asynchronous (``non_blocking=True``, as :func:`prefetch` does) and faster.
      ``False`` elsewhere, where pinning only costs a copy.
    * ``persistent_workers``: ``True`` when there are workers, so they are not killed
      and re-forked (re-importing, re-opening files) at every epoch.
    * ``prefetch_factor``: ``2`` batches queued per worker (torch's default), only set
      when there are workers (``DataLoader`` rejects it otherwise).

    Args:
        device: where the training step runs.
        max_workers: upper bound on ``num_workers``.

    Returns:
        A dict for ``DataLoader(dataset, batch_size=..., **loader_defaults(device))``.

    Example:
        >>> from fasttorch.data import loader_defaults
        >>> d = loader_defaults("cpu", max_workers=0)
        >>> d
        {'num_workers': 0, 'pin_memory': False, 'persistent_workers': False}
    """
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 0:
        raise ValueError(
            f"loader_defaults: max_workers must be an integer >= 0, got {max_workers!r}"
        )
    dev = torch.device(device)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    workers = max(0, min(max_workers, cpus - 1))
    out: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": dev.type == "cuda",
        "persistent_workers": workers > 0,
    }
    if workers > 0:
        out["prefetch_factor"] = 2
    return out
