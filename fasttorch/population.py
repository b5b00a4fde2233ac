"""A population: many models of one architecture as one ``TrainState``, members stacked.

Every tensor leaf of a population state (parameters, buffers, optimizer state and its
hyperparameters, step counter, transform sub-states) has a leading dimension of size
``n``, member ``i`` at index ``i``: the layout of ``torch.func.stack_module_state`` and
of a JAX ensemble under ``jax.vmap``. :func:`fasttorch.vmapped` trains it, one call for
all members. It is a plain :class:`fasttorch.TrainState`, so checkpointing,
``set_hyperparams`` and the user's loop handle it as they handle any state.

The step counter and the random generator are stacked too: member ``i`` has its own
``step[i]`` (every call advances every member, a skipped update included, as for one
model) and its own generator state ``rng[i]``, seeded as a lone ``TrainState.create``
seeds its own, so member ``i``'s dropout masks are those of its independent run
(``fasttorch._core.state.draw_``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from fasttorch import _checks, struct
from fasttorch._core.state import initial_rng_state
from fasttorch.optim._base import check_hyper
from fasttorch.state import TrainState, check_alive, default_seed, is_sharded

__all__ = [
    "KEY",
    "Members",
    "create_population",
    "member",
    "member_state_dict",
    "member_view",
    "population_size",
]

KEY = "population"
"""The sub-state key of :class:`Members`."""


class Members(struct.Record):
    """Sub-state ``"population"``: marks a state as a population and numbers its members.

    Attributes:
        index: int64 ``[n]``, ``arange(n)``; under ``vmapped`` each member sees its own
            0-d index.
    """

    index: torch.Tensor

    # Read by the gradient phase: under torch.func.vmap, torch.autograd.grad cannot run
    # (it needs requires_grad_() on batched tensors), torch.func.grad can.
    functional_grads: ClassVar[bool] = True
    # Read by state.check_template: every leaf has one leading dimension, the members.
    stacks_members: ClassVar[bool] = True


def create_population(
    model: nn.Module | Callable[[], nn.Module],
    optimizer: Any,
    n: int,
    *,
    init: str = "seeds",
    seeds: Sequence[int] | None = None,
    hyper: Mapping[str, Sequence[float]] | None = None,
    rng_seeds: Sequence[int] | None = None,
) -> TrainState:
    """A population of ``n`` models trained by ``optimizer``, as one stacked ``TrainState``.

    Member ``i`` is initialised under ``torch.manual_seed(seeds[i])`` (``seeds``
    defaults to ``range(n)``): ``model()`` is called again for each member when
    ``model`` is a callable (a ``make_model``), or, for a module, ``reset_parameters()``
    of every submodule that has one is run on a copy. With ``init="copies"`` every
    member starts from the module's own values. The caller's global RNG is left as it
    was. Each member has its own random generator (dropout), seeded with
    ``rng_seeds[i]``, by default with the seed ``TrainState.create`` takes after
    ``torch.manual_seed(seeds[i])``: member ``i`` then draws the dropout masks of the
    single model that the plain setup below builds and trains. ``hyper`` gives members
    their own optimizer hyperparameters (``lr``,
    ``weight_decay``, ``beta1``, ``beta2``, ``momentum``, ...): a 0-d hyperparameter
    becomes a ``[n]`` tensor, one value per member.

    Equivalent to the plain PyTorch setup it replaces::

        models = []
        for i in range(n):
            torch.manual_seed(seeds[i])  # also seeds member i's dropout
            models.append(make_model())
        opts = [torch.optim.AdamW(m.parameters(), lr=lrs[i]) for i, m in enumerate(models)]

    Args:
        model: an ``nn.Module`` or a callable building one.
        optimizer: a fasttorch optimizer (``fasttorch.optim.adamw(1e-3)``).
        n: the number of members, >= 1.
        init: ``"seeds"`` (independent initialisations) or ``"copies"``.
        seeds: one seed per member: its initialisation (``init="seeds"``) and, unless
            ``rng_seeds`` is given, its random generator.
        hyper: per-member hyperparameter values, ``n`` per name.
        rng_seeds: one seed per member for its random generator, as
            ``TrainState.create(..., seed=...)``.

    Raises:
        ValueError: ``n`` < 1, a wrong number of seeds or values, two members that
            would train alike (repeated seeds, rng seeds and hyperparameters), an unknown
            hyperparameter, a module with BatchNorm running statistics or one sharded
            with FSDP2, parameters that ``reset_parameters`` cannot re-initialise.
        TypeError: an optimizer that wraps a ``torch.optim`` class (``from_torch``), a
            seed that is not an int.

    Example:
        >>> import torch, fasttorch
        >>> pop = fasttorch.create_population(
        ...     lambda: torch.nn.Linear(3, 1), fasttorch.optim.sgd(0.1), 4,
        ...     hyper={"lr": [0.1, 0.2, 0.3, 0.4]})
        >>> tuple(pop.params["weight"].shape), fasttorch.population_size(pop)
        ((4, 1, 3), 4)
        >>> pop.opt_state.hyper["lr"]
        tensor([0.1000, 0.2000, 0.3000, 0.4000])
    """
    _checks.count("create_population", "n", n)
    check_optimizer(optimizer, "create_population")
    _check_distinct(n, init, seeds, rng_seeds, hyper or {})
    modules = _member_modules(model, n, init, seeds)
    for m in modules:
        check_module(m, "create_population")
    # One template module for all (the first member's); each member's values are leaves.
    states = [TrainState.create(m, optimizer).replace(module=modules[0]) for m in modules]
    stacked = _stack(states)
    device = stacked.device
    opt_state = _with_hyper(stacked.opt_state, hyper or {}, n)
    rngs = [initial_rng_state(device, s) for s in _rng_seeds(n, seeds, rng_seeds)]
    return stacked.replace(
        opt_state=opt_state,
        step=torch.zeros(n, dtype=torch.int64, device=device),
        rng=torch.stack(rngs),
        substates={KEY: Members(index=torch.arange(n, device=device))},
    )


def _check_distinct(
    n: int,
    init: str,
    seeds: Sequence[int] | None,
    rng_seeds: Sequence[int] | None,
    hyper: Mapping[str, Sequence[float]],
) -> None:
    """Raise for a seed that is not an int, and for two members that would train alike.

    Without ``rng_seeds`` a member's random generator follows its seed, so two members
    whose ``seeds`` repeat (and whose hyperparameters do) start and train alike: one of
    them computes nothing the other does not. ``rng_seeds`` given one by one may repeat
    on purpose (the same dropout draws for two members).
    """
    for what, given in (("seeds", seeds), ("rng_seeds", rng_seeds)):
        for i, s in enumerate(given or ()):
            _checks.count("create_population", f"{what}[{i}]", s, low=-(2**63), kind="an int")
    if rng_seeds is not None or not isinstance(hyper, Mapping):
        return  # rng seeds chosen one by one (repeats on purpose); a wrong hyper: below
    if seeds is not None and len(seeds) != n:
        return  # said with its own message below

    def hyper_of(i: int) -> tuple[Any, ...]:
        try:
            return tuple(repr(v[i]) for v in hyper.values())  # type: ignore[index]
        except (TypeError, IndexError, KeyError):  # checked with their own messages later
            return (i,)

    start = list(range(n)) if seeds is None else list(seeds)
    seen: dict[tuple[Any, ...], int] = {}
    for i in range(n):
        key = (start[i], hyper_of(i))
        if key in seen:
            raise ValueError(
                f"create_population: members {seen[key]} and {i} would train alike: "
                f"seeds={list(start)} repeat {start[i]} (each member's start, with "
                f"init={init!r}, and its random generator) and their hyperparameters "
                "repeat too, so one computes nothing the other does not. Give each member "
                "its own seed (seeds=range(n)), or other hyper values, or rng_seeds."
            )
        seen[key] = i


def _rng_seeds(n: int, seeds: Sequence[int] | None, rng_seeds: Sequence[int] | None) -> list[int]:
    """Each member's generator seed: given, or what a lone run seeded with ``seeds[i]`` gets."""
    if rng_seeds is not None:
        if len(rng_seeds) != n:
            raise ValueError(f"create_population: {len(rng_seeds)} rng_seeds given for {n} members")
        return list(rng_seeds)
    out = []
    for s in range(n) if seeds is None else seeds:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s)
            out.append(default_seed())
    return out


def _member_modules(
    model: nn.Module | Callable[[], nn.Module], n: int, init: str, seeds: Sequence[int] | None
) -> list[nn.Module]:
    if init not in ("seeds", "copies"):
        raise ValueError(f"create_population: init must be 'seeds' or 'copies', got {init!r}")
    if seeds is None:
        seeds = list(range(n))
    elif len(seeds) != n:
        raise ValueError(f"create_population: {len(seeds)} seeds given for {n} members")
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(
                "create_population expects an nn.Module or a callable returning one, "
                f"got {type(model).__name__}"
            )
        if init == "copies":
            model = model()
        else:
            return [_seeded(seeds[i], model) for i in range(n)]
    if init == "copies":
        return [copy.deepcopy(model) for _ in range(n)]
    _check_resettable(model)
    return [_seeded(seeds[i], lambda: _reset(copy.deepcopy(model))) for i in range(n)]


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = make()
    if not isinstance(m, nn.Module):
        raise TypeError(f"create_population: model() returned {type(m).__name__}, not a module")
    return m


def _reset(module: nn.Module) -> nn.Module:
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
    return module


def _check_resettable(module: nn.Module) -> None:
    """Raise if some parameter belongs to a module without ``reset_parameters``."""
    covered = {
        id(p)
        for m in module.modules()
        if callable(getattr(m, "reset_parameters", None))
        for p in m.parameters(recurse=False)
    }
    missing = [k for k, p in module.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(
            f"create_population: parameters {missing[:3]} belong to modules without "
            "reset_parameters(), so init='seeds' cannot re-initialise them from a module. "
            "Pass a callable that builds the model (create_population(make_model, ...)), "
            "or init='copies' to start every member from the module's values"
        )


def check_optimizer(optimizer: Any, api: str) -> None:
    """Raise if ``optimizer`` runs kernels that ``torch.func.vmap`` cannot batch."""
    if type(optimizer).__name__ == "TorchOptimizer" or hasattr(optimizer, "torch_class"):
        raise TypeError(
            f"{api}: optimizers wrapped from torch.optim (fasttorch.optim.from_torch) run "
            "torch's own foreach/fused kernels, which torch.func.vmap cannot batch over "
            "members. Use fasttorch's own: fasttorch.optim.sgd, adam or adamw"
        )


def check_module(module: nn.Module, api: str) -> None:
    """Raise for modules a population cannot train: BatchNorm statistics, FSDP2."""
    if is_sharded(module):
        raise ValueError(
            f"{api}: the module is sharded with FSDP2 (fully_shard), whose hooks gather "
            "one model's shards across ranks; a population stacks whole members on one "
            "device. Train the population unsharded, or shard members across ranks by "
            "hand (a population per rank)"
        )
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            raise ValueError(
                f"{api}: {name or 'the model'} is a {type(m).__name__} that tracks running "
                "statistics: its forward updates them in place, which torch.func.vmap "
                "cannot do per member. Build it with track_running_stats=False (batch "
                "statistics in evaluation too, as torch.func.replace_all_batch_norm_modules_ "
                "does), or use GroupNorm/LayerNorm"
            )


def _stack(states: list[TrainState]) -> TrainState:
    leaves0, spec = pytree.tree_flatten(states[0])
    columns: list[list[torch.Tensor]] = [[t] for t in leaves0]
    for s in states[1:]:
        leaves, other = pytree.tree_flatten(s)
        if other != spec or any(a.shape != b.shape for a, b in zip(leaves, leaves0)):
            raise ValueError(
                "create_population: the members' models differ in structure or shapes; "
                "model() must build the same architecture every time"
            )
        for col, t in zip(columns, leaves):
            col.append(t)
    return pytree.tree_unflatten([torch.stack(col) for col in columns], spec)  # type: ignore[no-any-return]


def _with_hyper(opt_state: Any, hyper: Mapping[str, Sequence[float]], n: int) -> Any:
    if not isinstance(hyper, Mapping):
        raise _checks.ArgumentTypeError(
            f"create_population: hyper must map hyperparameter names to one value per "
            f"member, got {type(hyper).__name__}; for example hyper={{'lr': [1e-3] * {n}}}"
        )
    values = dict(opt_state.hyper)
    for name, given in hyper.items():
        if name not in values:
            raise ValueError(
                f"create_population: unknown hyperparameter {name!r}; this optimizer holds "
                f"{sorted(values)} (a scheduled lr is not a hyperparameter tensor: give "
                "each member a float lr, or scale a shared schedule by a per-member factor)"
            )
        vals = _per_member_values(name, given, n)
        if len(vals) != n:
            raise ValueError(
                f"create_population: hyper[{name!r}] has {len(vals)} values for {n} members"
            )
        for v in vals:
            check_hyper("create_population", name.rsplit(".", 1)[-1], v)
        old = values[name]
        values[name] = torch.tensor(vals, dtype=old.dtype, device=old.device)
    return opt_state.replace(hyper=values)


def _per_member_values(name: str, given: Any, n: int) -> list[float]:
    """``hyper[name]`` as ``n`` floats: a list, a tuple or a 1-d tensor of numbers."""
    if isinstance(given, torch.Tensor):
        if given.dim() == 1 and given.dtype != torch.bool and not given.is_complex():
            return [float(v) for v in given.tolist()]
    elif (
        isinstance(given, Sequence)
        and not isinstance(given, (str, bytes))
        and all(_checks.is_real(v) for v in given)
    ):
        return [float(v) for v in given]
    shown = (
        f"a tensor of shape {tuple(given.shape)}"
        if isinstance(given, torch.Tensor)
        else repr(given)
    )
    raise _checks.ArgumentTypeError(
        f"create_population: hyper[{name!r}] is {shown}; it takes one value per member, "
        f"{n} numbers: hyper={{{name!r}: [v0, ..., v{n - 1}]}} (for one value shared by "
        f"every member, give it to the optimizer, as in fasttorch.optim.adamw({name}=...), "
        f"and leave {name!r} out of hyper)"
    )


def population_size(state: TrainState) -> int:
    """The number of members of population ``state`` (raises for a single model's state)."""
    check_alive(state, "population_size")
    members = state.substates.get(KEY)
    if not isinstance(members, Members):
        raise ValueError(
            "this TrainState is not a population (it has no 'population' sub-state); "
            "build one with fasttorch.create_population(model, optimizer, n)"
        )
    return int(members.index.shape[0])


def member(state: TrainState, i: int | torch.Tensor) -> TrainState:
    """Member ``i`` of population ``state`` as a single model's ``TrainState`` (copies).

    ``i`` is an int or a 0-d integer tensor (``metrics["loss"].argmin()``).

    Its tensors are copies of the member's slices (its own step counter and generator
    state included), so it trains on with any plain step, alone, as its independent
    run would have.

    Example:
        >>> import torch, fasttorch
        >>> pop = fasttorch.create_population(
        ...     lambda: torch.nn.Linear(3, 1), fasttorch.optim.sgd(0.1), 2)
        >>> one = fasttorch.member(pop, 1)
        >>> tuple(one.params["weight"].shape), int(one.step)
        ((1, 3), 0)
    """
    n = population_size(state)
    return member_view(state, member_index(i, n, "member"), copy=True)


def member_index(i: Any, n: int, api: str) -> int:
    """``i`` as a Python int in ``[-n, n)``: an int, or a 0-d integer tensor (what
    ``torch.argmin`` returns, read on the host here, outside any step)."""
    if isinstance(i, torch.Tensor):
        if i.dim() != 0 or i.is_floating_point() or i.is_complex() or i.dtype == torch.bool:
            raise _checks.ArgumentTypeError(
                f"{api}: the index is a tensor of shape {tuple(i.shape)} and dtype {i.dtype}; "
                "give one member's index: an int, or a 0-d integer tensor such as "
                "metrics['loss'].argmin()"
            )
        index = int(i)
    elif _checks.is_int(i):
        index = i
    else:
        raise _checks.ArgumentTypeError(
            f"{api}: the index is {i!r} of type {type(i).__name__}; give one member's "
            "index: an int, or a 0-d integer tensor such as metrics['loss'].argmin()"
        )
    if not -n <= index < n:
        raise IndexError(
            f"{api}: index {index} is out of range for a population of {n} members; valid "
            f"indices are 0 to {n - 1} (or -{n} to -1 from the end)"
        )
    return index


def member_view(state: TrainState, i: int, *, copy: bool = False) -> TrainState:
    """Member ``i`` of ``state`` over views of its tensors (``copy``: over copies)."""
    bare = state.without_substate(KEY)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[i].clone() if copy else t[i]

    out: TrainState = pytree.tree_map(take, bare)
    return out


def member_state_dict(state: TrainState, i: int | torch.Tensor) -> dict[str, torch.Tensor]:
    """Member ``i``'s parameters and buffers keyed like ``module.state_dict()``.

    Load it into a plain ``nn.Module`` of the same architecture with
    ``model.load_state_dict(...)``.

    Example:
        >>> import torch, fasttorch
        >>> pop = fasttorch.create_population(
        ...     lambda: torch.nn.Linear(3, 1), fasttorch.optim.sgd(0.1), 2)
        >>> plain = torch.nn.Linear(3, 1)
        >>> plain.load_state_dict(fasttorch.member_state_dict(pop, 0))
        <All keys matched successfully>
    """
    return member(state, i).state_dict()
