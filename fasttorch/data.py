"""Input pipeline: copy the next batches to the device while the current step runs.

:func:`prefetch` overlaps host-to-device copies with compute (pinned memory,
``non_blocking=True``, a side CUDA stream) and, over a resumable loader, saves its
position for a checkpoint (:class:`Prefetcher`, :func:`to_json`);
:func:`loader_defaults` gives the ``DataLoader`` settings that keep the device fed.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from fasttorch import _checks

__all__ = ["Prefetcher", "from_json", "loader_defaults", "prefetch", "to_json"]


def prefetch(loader: Iterable[Any], device: torch.device | str, *, depth: int = 2) -> Prefetcher:
    """Iterate over ``loader`` with its batches on ``device``, ``depth`` batches ahead.

    On CUDA each batch's tensors are pinned (unless the loader already pins them,
    ``pin_memory=True``) and copied with ``non_blocking=True`` on a side stream while
    the current step runs on the main stream. Before a batch is handed out the main
    stream waits for its copy, and each tensor is ``record_stream``-ed on the main
    stream so its memory is not reused while the step still reads it. Elsewhere (CPU)
    the batches are moved with ``.to(device)`` and yielded as they come: there is no
    copy to overlap. Non-tensor leaves pass through.

    When ``loader`` has ``state_dict()`` / ``load_state_dict()`` (torchdata's
    ``StatefulDataLoader``, or your own iterable), so does the returned iterator: its
    :meth:`Prefetcher.state_dict` is the loader's position *before the next batch it
    will hand out* (not the ``depth`` batches already read ahead), made
    JSON-serializable, for ``checkpoint.save(..., data=...)``; see
    :class:`Prefetcher`.

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
        A :class:`Prefetcher`: an iterator of the batches on ``device``.

    Example:
        >>> import torch
        >>> from fasttorch.data import prefetch
        >>> batches = [(torch.ones(2, 3), torch.zeros(2)) for _ in range(3)]
        >>> [x.device.type for x, y in prefetch(batches, "cpu")]
        ['cpu', 'cpu', 'cpu']
    """
    _checks.count("prefetch", "depth", depth)
    if not isinstance(loader, Iterable):
        raise TypeError(f"prefetch: loader must be iterable, got {type(loader).__name__}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return Prefetcher(loader, dev, depth)


class Prefetcher:
    """The iterator :func:`prefetch` returns; resumable when its loader is.

    ``state_dict()`` gives the position of the next batch this iterator will hand out,
    as JSON-serializable values (tensors in the loader's state, such as a sampler's
    generator state, become ``{"__tensor__": dtype, "shape": [...], "data": [...]}``),
    so it can go in a checkpoint's ``data``. ``load_state_dict(d)`` restores it; call
    it before the first batch is taken (on a new ``prefetch`` over a new loader). A
    resumed run then sees exactly the batches the interrupted one would have seen.

    Equivalent to, without read-ahead::

        position = loader.state_dict()   # before taking the next batch
        ...
        loader.load_state_dict(position)  # in the new process, before iterating

    Example:
        >>> import json
        >>> from fasttorch.data import prefetch
        >>> class Counter:  # any iterable with state_dict / load_state_dict
        ...     def __init__(self): self.i = 0
        ...     def __iter__(self): return self
        ...     def __next__(self): self.i += 1; return self.i
        ...     def state_dict(self): return {"i": self.i}
        ...     def load_state_dict(self, d): self.i = d["i"]
        >>> it = prefetch(Counter(), "cpu")
        >>> next(it), next(it)
        (1, 2)
        >>> saved = json.dumps(it.state_dict())  # e.g. checkpoint.save(..., data=...)
        >>> resumed = prefetch(Counter(), "cpu")
        >>> resumed.load_state_dict(json.loads(saved))
        >>> next(resumed)
        3
    """

    def __init__(self, loader: Iterable[Any], device: torch.device, depth: int) -> None:
        self.loader = loader
        self.device = device
        self.depth = depth
        self._stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )
        self._it: Iterator[Any] | None = None
        # CUDA: batches read ahead, each with its copy's event and the loader's
        # position before it was read (what state_dict reports while it waits).
        self._queue: collections.deque[tuple[Any, Any, Any]] = collections.deque()
        self._side: Any = None

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = iter(self.loader)
            if self.device.type == "cuda":
                self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                for _ in range(self.depth):
                    self._load()
        if self.device.type != "cuda":
            batch = next(self._it)
            return _map(lambda t: t.to(self.device), batch)
        if not self._queue:
            raise StopIteration
        moved, done, _ = self._queue.popleft()
        main = torch.cuda.current_stream(self.device)
        main.wait_event(done)
        for t in pytree.tree_leaves(moved):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                # Allocated on the side stream, used on the main one: without this the
                # caching allocator could hand the memory out again mid-step.
                t.record_stream(main)
        self._load()  # start the next copy before the step runs on this batch
        return moved

    def _load(self) -> None:
        assert self._it is not None
        position = self._position() if self._stateful else None
        try:
            batch = next(self._it)
        except StopIteration:
            return
        with torch.cuda.stream(self._side):
            moved = _map(lambda t: _pinned(t).to(self.device, non_blocking=True), batch)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._side)
        self._queue.append((moved, done, position))

    def _position(self) -> Any:
        return to_json(self.loader.state_dict(), "prefetch: the loader's state_dict()")  # type: ignore[attr-defined]

    def _require_state(self, method: str) -> None:
        if not self._stateful:
            raise TypeError(
                f"Prefetcher.{method}: the loader ({type(self.loader).__name__}) has no "
                "state_dict() / load_state_dict(), so its position cannot be saved; use "
                "torchdata.stateful_dataloader.StatefulDataLoader in place of DataLoader, "
                "or give your iterable those two methods"
            )

    def state_dict(self) -> dict[str, Any]:
        """The loader's position before the next batch handed out, JSON-serializable."""
        self._require_state("state_dict")
        if self._queue:
            return {"loader": self._queue[0][2]}
        return {"loader": self._position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position from :meth:`state_dict`; before the first batch is taken."""
        self._require_state("load_state_dict")
        if self._it is not None:
            raise RuntimeError(
                "Prefetcher.load_state_dict: batches were already taken from this iterator; "
                "call it on a new prefetch(loader, device) before the first next()"
            )
        if not isinstance(state, dict) or "loader" not in state:
            raise ValueError(
                "Prefetcher.load_state_dict: expected the dict Prefetcher.state_dict() "
                f"returns, with a 'loader' key; got {type(state).__name__}"
            )
        self.loader.load_state_dict(from_json(state["loader"]))  # type: ignore[attr-defined]


def _map(fn: Any, batch: Any) -> Any:
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, batch)


_TENSOR = "__tensor__"


def to_json(obj: Any, where: str = "to_json") -> Any:
    """``obj`` (dicts, lists, tuples, numbers, strings, ``None``, CPU tensors) as JSON values.

    A tensor becomes ``{"__tensor__": "uint8", "shape": [...], "data": [...]}`` (a
    generator state from ``torch.Generator.get_state()`` or a sampler's state);
    tuples become lists. :func:`from_json` turns it back; nothing in it is code, so
    reading it back executes nothing. Anything else raises ``TypeError``.

    Example:
        >>> import json, torch
        >>> from fasttorch.data import from_json, to_json
        >>> g = torch.Generator().manual_seed(0)
        >>> saved = json.dumps(to_json({"gen": g.get_state(), "epoch": 2}))
        >>> back = from_json(json.loads(saved))
        >>> torch.equal(back["gen"], g.get_state()), back["epoch"]
        (True, 2)
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.is_complex() or t.is_quantized:
            raise TypeError(f"{where}: cannot store a {t.dtype} tensor as JSON")
        return {
            _TENSOR: str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": t.flatten().tolist(),
        }
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: JSON keys must be strings, got {k!r}")
            out[k] = to_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(
        f"{where}: a {type(obj).__name__} cannot be stored as JSON; a data position may "
        "hold dicts, lists, numbers, strings, None and CPU tensors"
    )


def from_json(obj: Any) -> Any:
    """Undo :func:`to_json`: ``{"__tensor__": ...}`` entries become tensors again."""
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return _tensor_from_json(obj)
        return {k: from_json(v) for k, v in obj.items()}
    return obj


def _tensor_from_json(obj: dict[str, Any]) -> torch.Tensor:
    """A ``{"__tensor__": dtype, "shape": [...], "data": [...]}`` entry as a tensor, every
    field checked first (a hand-edited or truncated entry gives a clear ValueError)."""
    name = obj[_TENSOR]
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"from_json: unknown tensor dtype {name!r}")
    shape, data = obj.get("shape"), obj.get("data")
    if not isinstance(shape, list) or not all(_checks.is_int(d) and d >= 0 for d in shape):
        raise ValueError(
            f"from_json: a {_TENSOR!r} entry needs 'shape', a list of integers >= 0 (as "
            f"to_json writes it), got {shape!r}"
        )
    if not isinstance(data, list) or len(data) != math.prod(shape):
        got = f"{len(data)} values" if isinstance(data, list) else repr(data)
        raise ValueError(
            f"from_json: a {_TENSOR!r} entry of shape {shape} needs 'data', a list of "
            f"{math.prod(shape)} values (as to_json writes it), got {got}"
        )
    try:
        return torch.tensor(data, dtype=dtype).reshape(shape)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(
            f"from_json: the 'data' of a {name} tensor entry must be a flat list of numbers: {e}"
        ) from e


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
    _checks.count("loader_defaults", "max_workers", max_workers, low=0)
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
