"""The state's RNG: a generator state carried as a tensor leaf, installed around a step.

Dropout and other random ops draw from the global generator of the parameters' device
(eager kernels and inductor's generated code both do). A step installs the state's
generator state before it runs, reads the advanced state afterwards into the new
``TrainState``, and puts the caller's generator back, so the same ``(state, batch)``
gives the same result and the user's own random stream is left untouched. This runs
outside any compiled graph: it is host bookkeeping, not a device sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from fasttorch import _checks

__all__ = ["initial_rng_state", "scoped_rng"]


def initial_rng_state(device: torch.device, seed: int) -> torch.Tensor:
    """The generator state of ``device``'s generator seeded with ``seed``."""
    # torch.Generator.manual_seed takes 64 bits; beyond that it says "Overflow when unpacking".
    if not _checks.is_int(seed):
        raise TypeError(f"TrainState.create: seed must be an int, got {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(
            f"TrainState.create: seed={seed} does not fit in 64 bits; valid seeds are "
            "-2**63 <= seed < 2**64 (as torch.manual_seed). Reduce it, e.g. seed % 2**64"
        )
    return torch.Generator(device=device).manual_seed(seed).get_state()


def _accessors(
    device: torch.device,
) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    if device.type == "cpu":
        return torch.get_rng_state, torch.set_rng_state
    if device.type == "cuda":
        return (
            lambda: torch.cuda.get_rng_state(device),
            lambda s: torch.cuda.set_rng_state(s, device),
        )
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        raise NotImplementedError(f"fasttorch cannot scope the RNG of device {device}")
    return (
        lambda: module.get_rng_state(device),
        lambda s: module.set_rng_state(s, device),
    )


def _snapshot(
    device: torch.device, get: Callable[[], torch.Tensor], put: Callable[[torch.Tensor], None]
) -> Callable[[], None]:
    """Save the caller's generator state; return what puts it back.

    On CPU the generator is copied as a generator (``clone_state``), not read out as a
    5 KB tensor that would stay allocated for the whole step.
    """
    if device.type == "cpu" and hasattr(torch.default_generator, "clone_state"):
        saved_gen = torch.default_generator.clone_state()

        def restore() -> None:
            torch.default_generator.set_state(saved_gen.get_state())

        return restore
    saved = get()
    return lambda: put(saved)


@contextmanager
def scoped_rng(
    state_rng: torch.Tensor, device: torch.device
) -> Iterator[Callable[[], torch.Tensor]]:
    """Install ``state_rng`` on ``device``; yield a getter of the advanced state."""
    get, put = _accessors(device)
    restore = _snapshot(device, get, put)
    put(state_rng)
    try:
        yield get
    finally:
        restore()
