"""The gradient reducer: bucketed, asynchronous all-reduce started from backward hooks.

``DistributedDataParallel`` cannot sync gradients of tensors swapped in with
``functional_call`` (docs/design.md), so fasttorch reduces its own. Parameters are grouped in
buckets of about ``bucket_mb`` in a fixed order (reverse definition order, roughly the
order backward produces them). During the window's last backward each parameter's hook
adds its gradient to the window's accumulated one, copies the sum into its bucket, and
when a bucket is full its ``all_reduce`` starts, asynchronously, while backward goes on.
Buckets launch strictly in index order on every rank, since collectives pair up by order.

Alongside, one small SUM all-reduce carries the window's counts: total weight (samples or
tokens) and loss, so the result is the mean over the global batch, plus ``n``, ``n**2``,
``step`` and ``step**2``, from which every rank can tell whether all ranks are at the same
optimizer step with the same number of microbatches (equal iff ``R * sum(x**2) ==
sum(x)**2``): a mismatch is an error, not silently averaged windows.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist

from fasttorch import _compat
from fasttorch.phases import GradOut, Loss, Tensors, skip_empty_window

__all__ = [
    "DistributedStepError",
    "SyncConfig",
    "WindowReduction",
    "check_agreement",
    "wait",
    "window_counts",
]


class DistributedStepError(RuntimeError):
    """Ranks disagree, or a collective did not complete within the timeout."""


@attrs.frozen
class SyncConfig:
    """How ``sync_on_last`` reduces: the process group, bucket size and timeout."""

    group: Any = None
    bucket_mb: float = attrs.field(default=25.0, validator=attrs.validators.gt(0.0))
    timeout: datetime.timedelta = datetime.timedelta(minutes=5)
    # Layouts by parameter signature, and the bucket buffers reused window after window
    # (fresh multi-MB buffers each step cost page faults): memos, not training state.
    _layouts: dict[Any, list[list[str]]] = attrs.field(factory=dict, eq=False, repr=False)
    _buffers: dict[Any, list[torch.Tensor]] = attrs.field(factory=dict, eq=False, repr=False)
    # Collectives the host did not wait for (NCCL: the stream waits), with when each
    # was waited on and what it reduced; checked without blocking by the next waits.
    _pending: list[tuple[Any, float, str]] = attrs.field(factory=list, eq=False, repr=False)
    # The used-parameter flags by set of unused names (see WindowReduction.flags).
    _flags: dict[Any, torch.Tensor] = attrs.field(factory=dict, eq=False, repr=False)

    def bucket_buffers(
        self, names: list[list[str]], params: Mapping[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """One flat buffer per bucket, allocated once per layout.

        The last bucket has one more element per parameter at its end: the flags of
        the parameters this rank used, summed over the ranks with the gradients (so
        knowing which parameters no rank used costs no collective of its own).
        """
        key = (
            tuple(tuple(b) for b in names),
            tuple(
                (tuple(params[k].shape), params[k].dtype, params[k].device)
                for b in names
                for k in b
            ),
        )
        if key not in self._buffers:
            self._buffers[key] = [
                torch.empty(
                    sum(params[k].numel() for k in b)
                    + (sum(map(len, names)) if i == len(names) - 1 else 0),
                    dtype=params[b[0]].dtype,
                    device=params[b[0]].device,
                )
                for i, b in enumerate(names)
            ]
        return self._buffers[key]

    def used_flags(
        self, order: list[str], unused: frozenset[str], like: torch.Tensor
    ) -> torch.Tensor:
        """1 per parameter of ``order`` this rank used, 0 per ``unused`` one; made once."""
        key = (tuple(order), unused, like.dtype, like.device)
        if key not in self._flags:
            values = [0.0 if k in unused else 1.0 for k in order]
            self._flags[key] = torch.tensor(values, dtype=like.dtype, device=like.device)
        return self._flags[key]

    def buckets(self, params: Mapping[str, torch.Tensor]) -> list[list[str]]:
        """Parameter names per bucket, in launch order (deterministic on every rank)."""
        key = tuple((k, tuple(p.shape), p.dtype, p.device) for k, p in params.items())
        if key not in self._layouts:
            limit = self.bucket_mb * 2**20
            out: list[list[str]] = []
            size = 0.0
            for name in reversed(list(params)):
                p = params[name]
                if (
                    out
                    and size + p.numel() * p.element_size() <= limit
                    and _same_kind(params[out[-1][0]], p)
                ):
                    out[-1].append(name)
                    size += p.numel() * p.element_size()
                else:
                    out.append([name])
                    size = p.numel() * p.element_size()
            self._layouts[key] = out
        return self._layouts[key]


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


def _timed_out(error: BaseException, elapsed: float, timeout: datetime.timedelta) -> bool:
    """Whether a failed wait is the timeout (a late rank) rather than a broken collective.

    Backends word a timeout differently ("Timed out waiting ...", NCCL's watchdog
    "timeout"), so the elapsed time decides when the words do not: a failure long
    before the timeout is not one.
    """
    text = str(error).lower()
    return "timed out" in text or "timeout" in text or elapsed >= 0.9 * timeout.total_seconds()


class WindowReduction:
    """The reduction of one accumulation window's gradients (one per optimizer step)."""

    def __init__(
        self,
        config: SyncConfig,
        params: Mapping[str, torch.Tensor],
        acc: Any,
        n: int,
        step: torch.Tensor,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedStepError(
                "sync_on_last needs torch.distributed: launch with torchrun and call "
                "fasttorch.distributed.setup() (or dist.init_process_group) first"
            )
        self.config, self.acc, self.n, self.step = config, acc, n, step
        self.names = config.buckets(params)
        self.bucket_of = {k: i for i, names in enumerate(self.names) for k in names}
        self.flats: list[torch.Tensor | None] = [None] * len(self.names)
        self.slots: dict[str, torch.Tensor] = {}
        self.done: set[str] = set()
        self.filled = [0] * len(self.names)
        self.work: list[Any] = []
        self.launched = 0
        self.weight: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.counts_work: Any = None
        self.params = params
        self.order = [k for names in self.names for k in names]
        # The parameters no microbatch of this rank's window reached, known in finish():
        # until then every hook fired, so every parameter was used.
        self.unused: frozenset[str] = frozenset()

    # -- called by the gradient phase --------------------------------------------------
    def attach(self, params: Tensors, out: Loss) -> list[Any]:
        self._begin(out)
        return [p.register_hook(self._hook(k)) for k, p in params.items()]  # type: ignore[no-untyped-call]

    def _begin(self, out: Loss) -> None:
        """After the forward: the counts are known, so their reduction starts first."""
        w = out.weight.to(torch.float64)
        acc_w = 0.0 if self.acc is None else self.acc.weight.to(torch.float64)
        acc_v = 0.0 if self.acc is None else self.acc.value.to(torch.float64)
        v = out.value.detach().to(torch.float64)
        self.weight = out.weight.detach()
        self.counts = window_counts(w + acc_w, v * w + acc_v, self.n, self.step)
        self.counts_work = dist.all_reduce(self.counts, group=self.config.group, async_op=True)

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._put(name, grad)

        return hook

    # -- bucket bookkeeping ------------------------------------------------------------
    def _flat(self, i: int) -> torch.Tensor:
        flat = self.flats[i]
        if flat is None:
            flat = self.config.bucket_buffers(self.names, self.params)[i]
            offset = 0
            for k in self.names[i]:
                p = self.params[k]
                self.slots[k] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flats[i] = flat
        return flat

    def _put(self, name: str, grad: torch.Tensor) -> None:
        if name in self.done:
            return
        i = self.bucket_of[name]
        self._flat(i)
        assert self.weight is not None
        # The gradient of (mean * mult / n), times weight * n: that of (sum * mult),
        # written straight into its bucket slot, plus the window accumulated so far.
        slot = self.slots[name]
        torch.mul(grad, self.weight * self.n, out=slot)
        if self.acc is not None:
            slot.add_(self.acc.grads[name])
        self.done.add(name)
        self.filled[i] += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.launched < len(self.names) and self.filled[self.launched] == len(
            self.names[self.launched]
        ):
            flat = self.flats[self.launched]
            assert flat is not None
            if self.launched == len(self.names) - 1:
                tail = flat[flat.numel() - len(self.order) :]
                tail.copy_(self.config.used_flags(self.order, self.unused, tail))
            self.work.append(dist.all_reduce(flat, group=self.config.group, async_op=True))
            self.launched += 1

    # -- after backward ------------------------------------------------------------------
    def finish(self, g: GradOut) -> GradOut:
        """Wait for every reduction and return the window's global mean gradient.

        A parameter this rank did not use gets a zero gradient in the sum, as DDP's
        ``find_unused_parameters=True``; its entry in ``reached`` says whether any
        rank used it, so that the update skips it when none did.
        """
        earlier = None if self.acc is None else self.acc.unused
        self.unused = g.unused if earlier is None else earlier & g.unused
        for name in self.bucket_of:  # parameters whose hook did not fire (no gradient)
            if name not in self.done:
                self._put(name, g.grads[name])
        timeout = self.config.timeout
        assert self.counts is not None
        # The counts first: on CPU they are read next (check_agreement); on a GPU only
        # the stream waits, as for the buckets.
        self._wait(self.counts_work, timeout, "the window's sample counts", self.counts.device)
        for i, w in enumerate(self.work):
            flat = self.flats[i]
            self._wait(w, timeout, f"gradient bucket {i}", None if flat is None else flat.device)
        self._check_agreement(self.counts)
        total, value = self.counts[0], self.counts[1]
        reached = None
        if self.unused:
            last = self.flats[-1]
            assert last is not None
            anyone = last[last.numel() - len(self.order) :] > 0
            at = {k: i for i, k in enumerate(self.order)}
            reached = {k: anyone[at[k]] for k in self.unused}
        denom = total.to(next(iter(self.slots.values())).dtype)
        for flat in self.flats:
            if flat is not None:
                flat.div_(denom)
        # Views into the bucket buffers: the update phase owns them until the next window.
        grads = {name: self.slots[name] for name in self.params}
        window = GradOut(
            grads=grads,
            value=(value / total).to(g.value.dtype),
            weight=total.to(torch.float32),
            aux=g.aux,
            scale=g.scale,
            counted=g.counted,
            unused=self.unused,
            reached=reached,
        )
        return skip_empty_window(window)

    def _wait(
        self, work: Any, timeout: datetime.timedelta, what: str, device: torch.device | None
    ) -> None:
        wait(work, self.config, what, device=device)

    def _check_agreement(self, counts: torch.Tensor) -> None:
        check_agreement(counts, self.config, self.n)


def wait(work: Any, config: SyncConfig, what: str, *, device: torch.device | None = None) -> None:
    """Wait for ``work`` (an async collective) within ``config.timeout``, or raise
    :class:`DistributedStepError` saying whether a rank was late or the collective failed.

    For tensors on a GPU reduced by NCCL (``device`` given), ``work.wait()`` without a
    timeout only makes the current CUDA stream wait for the collective: the host goes
    on launching kernels. With a timeout NCCL blocks the host thread until the
    collective completes, once per bucket per window. So there the host does not wait:
    a collective still running ``config.timeout`` after it was waited on is reported,
    with the same error, by a later wait (``work.is_completed()``, which never blocks),
    and one that never completes by the process group's own watchdog (its ``timeout``
    in ``init_process_group``). Everywhere else (gloo, CPU tensors) the host waits, as
    the values are read right after.
    """
    if device is not None and _stream_ordered(config, device):
        _check_late(config)
        start = time.monotonic()
        try:
            work.wait()  # no timeout: a stream wait, not a host one
        except RuntimeError as e:  # an aborted communicator (the watchdog saw a failure)
            raise DistributedStepError(
                _failure_message(config, what, time.monotonic() - start, e)
            ) from e
        config._pending.append((work, start, what))
        return
    timeout = config.timeout
    start = time.monotonic()
    try:
        ok = work.wait(timeout)
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        if _timed_out(e, elapsed, timeout):
            raise DistributedStepError(_timeout_message(config, what)) from e
        raise DistributedStepError(_failure_message(config, what, elapsed, e)) from e
    if ok is False:
        raise DistributedStepError(_timeout_message(config, what))


def _stream_ordered(config: SyncConfig, device: torch.device) -> bool:
    """Whether waiting on a collective of ``device`` tensors orders a stream, not the host."""
    return device.type == "cuda" and "nccl" in str(dist.get_backend(config.group)).lower()


def _check_late(config: SyncConfig) -> None:
    """Forget completed collectives; raise for one running ``config.timeout`` or more."""
    now, limit = time.monotonic(), config.timeout.total_seconds()
    still = [entry for entry in config._pending if not entry[0].is_completed()]
    config._pending[:] = still
    for _, since, what in still:
        if now - since >= limit:
            config._pending.clear()
            raise DistributedStepError(_timeout_message(config, what))


def _failure_message(config: SyncConfig, what: str, elapsed: float, error: BaseException) -> str:
    said = " ".join(str(error).split())
    if len(said) > 600:
        said = said[:597] + "..."
    return (
        f"rank {dist.get_rank(config.group)}: the all-reduce of {what} failed "
        f"after {elapsed:.1f} s, before the {config.timeout.total_seconds():g} s "
        "timeout: the collective itself failed, no rank was merely late. Usually "
        "another rank died (an exception, an out-of-memory kill: see its own log) or "
        "its connection was lost; every rank must then restart from a checkpoint. "
        f"The backend said: {type(error).__name__}: {said}"
    )


def _timeout_message(config: SyncConfig, what: str) -> str:
    return (
        f"rank {dist.get_rank(config.group)} waited {config.timeout.total_seconds():g} s "
        f"for the all-reduce of {what} at the end of an accumulation window, and "
        "another rank did not join: every rank must run the same number of steps and "
        "microbatches per update (same grad_accumulate n, same number of batches)"
    )


def window_counts(
    weight: torch.Tensor, value_sum: torch.Tensor, n: int, step: torch.Tensor, *extra: torch.Tensor
) -> torch.Tensor:
    """One window's counts for a SUM all-reduce, in float64: total weight, sum of
    value * weight, then 1, ``n``, ``n**2``, ``step``, ``step**2`` (for
    :func:`check_agreement`), then ``extra``.
    """
    one = torch.ones((), dtype=torch.float64, device=weight.device)
    s = step.to(torch.float64)
    return torch.stack(
        [
            weight.to(torch.float64),
            value_sum.to(torch.float64),
            one,
            one * n,
            one * n * n,
            s,
            s * s,
            *(x.to(torch.float64) for x in extra),
        ]
    )


def check_agreement(counts: torch.Tensor, config: SyncConfig, n: int) -> None:
    """Raise unless every rank ran ``n`` microbatches at the same optimizer step.

    ``counts`` is :func:`window_counts` summed over the ranks: the values agree iff
    ``R * sum(x**2) == sum(x)**2``.
    """
    ranks, n1, n2, s1, s2 = counts[2], counts[3], counts[4], counts[5], counts[6]
    agree = torch.isclose(ranks * n2, n1 * n1) & torch.isclose(ranks * s2, s1 * s1)
    if counts.device.type != "cpu":
        return  # a device-side assert would kill the CUDA context; docs/distributed.md
    try:
        # A tensor condition, not a Python branch: on CPU it raises here and now.
        _compat.assert_async(agree, "ranks disagree")
    except RuntimeError as e:
        raise DistributedStepError(
            f"ranks disagree on the accumulation window: rank "
            f"{dist.get_rank(config.group)} runs {n} microbatches per update "
            "but another rank is at a different optimizer step or runs another number "
            "of microbatches. Give every rank the same grad_accumulate n and the same "
            "number of batches"
        ) from e
