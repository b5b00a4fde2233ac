"""The state's RNG: a generator state carried as a tensor leaf, installed around a step.

Dropout and other random ops draw from the global generator of the parameters' device
(eager kernels and inductor's generated code both do). A step installs the state's
generator state before it runs, reads the advanced state afterwards into the new
``TrainState``, and puts the caller's generator back, so the same ``(state, batch)``
gives the same result and the user's own random stream is left untouched. This runs
outside any compiled graph: it is host bookkeeping, not a device sync.

A population (``fasttorch.vmapped``) carries one generator state per member instead,
stacked, and cannot install them on the one global generator: its random ops call
:func:`draw_`, which takes the member's own state and advances it, so member ``i``
draws exactly what a single model with that generator state draws.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fasttorch import _checks

__all__ = ["draw_", "initial_rng_state", "scoped_rng"]


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
    state_rng: torch.Tensor, device: torch.device, *, install: bool = True
) -> Iterator[Callable[[], torch.Tensor | None]]:
    """Install ``state_rng`` on ``device``; yield a getter of the advanced state.

    ``install=False`` (a state whose random ops draw from its own generators, with
    :func:`draw_`): nothing is installed and the getter returns ``None``.
    """
    if not install:
        yield lambda: None
        return
    get, put = _accessors(device)
    restore = _snapshot(device, get, put)
    put(state_rng)
    try:
        yield get
    finally:
        restore()


@torch.library.custom_op("fasttorch::draw_", mutates_args=("rng",))
def draw_(
    rng: torch.Tensor,
    kind: str,
    shape: list[int],
    p: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A tensor of ``shape`` drawn from the generator state ``rng``, which is advanced.

    ``kind``: ``"bernoulli"`` (probability ``p``: the noise of ``F.dropout``),
    ``"uniform"`` (``torch.rand``) or ``"normal"`` (``torch.randn``). The draw is the
    very kernel call a single model makes on its global generator
    (``torch.empty(shape).bernoulli_(p)``, ``uniform_()``, ``normal_()``), on a
    generator holding ``rng``; ``rng`` then holds the advanced state. Under
    ``torch.func.vmap`` each member's state is used in turn (the batching rule below),
    so the members' draws are those of independent runs. An opaque operator to
    ``torch.compile`` (a custom op): compiled and eager steps draw the same bits.
    """
    gen = torch.Generator(device=device)
    # set_state of a view with a storage offset (a member's row) crashes torch 2.13:
    # a fresh copy.
    gen.set_state(rng.detach().clone())
    out = torch.empty(shape, dtype=dtype, device=device)
    if kind == "bernoulli":
        out.bernoulli_(p, generator=gen)
    elif kind == "uniform":
        out.uniform_(generator=gen)
    else:
        out.normal_(generator=gen)
    rng.copy_(gen.get_state())
    return out


@draw_.register_fake
def _draw_fake(
    rng: torch.Tensor,
    kind: str,
    shape: list[int],
    p: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _draw_per_member(
    info: Any,
    in_dims: tuple[int | None, ...],
    rng: torch.Tensor,
    kind: str,
    shape: list[int],
    p: float,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """``draw_``'s vmap rule: each member draws from its own row of ``rng``."""
    dim = in_dims[0]
    if dim is None:
        raise ValueError(
            "fasttorch: a random op under vmap was given one generator state for all "
            "members; a population keeps one per member (fasttorch.create_population)"
        )
    rows = rng.movedim(dim, 0)
    draws = [draw_(rows[i], kind, shape, p, dtype, device) for i in range(info.batch_size)]
    return torch.stack(draws), 0


draw_.register_vmap(_draw_per_member)


def default_seed() -> int:
    """The seed of a state's generator when none is given: from ``torch.initial_seed()``.

    The seed of torch's global generator (that of the last ``torch.manual_seed``), so a
    seed sweep gets different dropout masks, mixed (splitmix64) so that the state's
    stream is not the very stream that initialized the model's weights.
    """
    z = (torch.initial_seed() + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
