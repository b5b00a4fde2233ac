"""``TrainState`` and what a call knows beside it: the module, the call scope, the RNG.

``TrainState`` is everything a training step reads and writes, as one immutable pytree,
and its life: creation from a module, the check that its tensors fit that module, and
donation (``commit``: a step's results written into the input state's tensors, which
then die; :class:`DonatedStateError`). ``fasttorch.state`` is its public face.

Below it, in reading order, what the state needs and nothing above it:

* the user's ``nn.Module`` (:func:`training_modes`, :func:`evaluating`, FSDP2's shards
  :func:`is_sharded`, :func:`reshard`, :func:`local_tensor`, tied weights,
  :func:`call_with`): host-side facts about the template the state's tensors run in;
* the call scope (:class:`CallScope`, :func:`current`, :func:`scope`, :func:`begin`):
  how the running eager call goes, the one piece of context the phases read. A
  contextvar, not an argument, because the driver must tell the innermost phases how
  this call runs (its state is donated; its backward adds into the module's ``.grad``)
  without every transform in between threading a value it never reads. Graphs never
  read it: each reader checks ``torch.compiler.is_compiling()`` first;
* the state's RNG (:func:`scoped_rng`, :func:`draw_`): a generator state carried as a
  tensor leaf. A step installs it on the global generator of the parameters' device
  before it runs, reads the advanced state afterwards into the new ``TrainState``, and
  puts the caller's generator back, so the same ``(state, batch)`` gives the same
  result and the user's own random stream is left untouched (host bookkeeping, outside
  any graph, not a device sync). A population (``fasttorch.vmapped``) carries one
  generator state per member, stacked: its random ops call :func:`draw_`, which takes
  the member's own state and advances it, so member ``i`` draws exactly what a single
  model with that generator state draws.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch import nn

from fasttorch import _checks, _compat, struct
from fasttorch._core.subclass_copy import copy_subclasses
from fasttorch.substates import any_declares

if TYPE_CHECKING:
    from fasttorch.optim import Optimizer, OptState

__all__ = [
    "CallScope",
    "DonatedStateError",
    "Progress",
    "Ties",
    "TrainState",
    "begin",
    "call_with",
    "check_template",
    "commit",
    "current",
    "default_seed",
    "draw_",
    "evaluating",
    "imported_class",
    "initial_rng_state",
    "is_sharded",
    "kept_leaves",
    "local_tensor",
    "record_modes",
    "reshard",
    "restore_training",
    "scope",
    "scoped_rng",
    "set_modes",
    "tied_names",
    "training_modes",
]


# --------------------------------------------------------------------------- the module


def imported_class(module: str, name: str) -> Any:
    """Class ``name`` of ``module`` if that module was imported, else ``()`` (which no
    object is an instance of).

    FSDP2's ``FSDPModule`` and ``DTensor`` are looked up, not imported: importing
    ``torch.distributed.fsdp`` costs about 1.4 s (it brings ``torch.distributed.tensor``),
    a third of ``import fasttorch``, and a module can be sharded, or a tensor a
    ``DTensor``, only once the program imported them. A torch built without
    distributed support has neither.
    """
    found = sys.modules.get(module)
    return () if found is None else getattr(found, name, ())


def training_modes(module: nn.Module) -> tuple[bool, ...]:
    """Each submodule's ``training`` flag, in ``module.modules()`` order."""
    return tuple(m.training for m in module.modules())


def set_modes(module: nn.Module, modes: tuple[bool, ...]) -> None:
    """Give each submodule the flag ``training_modes`` read (``module.train()`` when the
    module's structure changed since)."""
    subs = list(module.modules())
    if len(subs) != len(modes):
        module.train()
        return
    for m, mode in zip(subs, modes):
        m.training = mode


def restore_training(module: nn.Module) -> None:
    """Put a module left in evaluation mode back in the modes it was trained in.

    An evaluation (``module.eval()``) switches every submodule off; what the user froze
    (a BatchNorm in ``eval()``) was recorded by ``TrainState.create`` and stays frozen.
    """
    modes = _MODES.get(module)
    if modes is None:
        module.train()
    else:
        set_modes(module, modes)


def record_modes(module: nn.Module) -> None:
    """Remember each submodule's mode, the modes steps train ``module`` in
    (``TrainState.create``; :func:`restore_training` puts them back)."""
    _MODES[module] = training_modes(module)


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Run the block with ``module`` in evaluation mode; each submodule's own mode after."""
    modes = training_modes(module)
    module.eval()
    try:
        yield
    finally:
        set_modes(module, modes)


_MODES: weakref.WeakKeyDictionary[nn.Module, tuple[bool, ...]] = weakref.WeakKeyDictionary()


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was sharded with FSDP2's ``fully_shard`` (its root or a child)."""
    found = _SHARDED.get(module)
    if found is None:
        kind = imported_class("torch.distributed.fsdp", "FSDPModule")
        found = _SHARDED[module] = any(isinstance(m, kind) for m in module.modules())
    return found


def reshard(module: nn.Module) -> None:
    """Free the unsharded parameters FSDP2 still holds for ``module`` (no-op otherwise).

    After a forward without backward (evaluation, ``TrainState.apply``, sampling),
    FSDP2 keeps the root's parameters unsharded, waiting for a backward that never
    comes: the module's parameters are then plain tensors, not the state's shards.
    Resharding puts the shards (the state's own storage) back and frees the rest.
    """
    if is_sharded(module):
        kind = imported_class("torch.distributed.fsdp", "FSDPModule")
        for m in module.modules():
            if isinstance(m, kind):
                m.reshard()


_SHARDED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """``p`` detached; for a ``DTensor``, this rank's shard (the same storage)."""
    if isinstance(p, imported_class("torch.distributed.tensor", "DTensor")):
        with torch.no_grad():
            local: torch.Tensor = p.to_local().detach()
            return local
    return p.detach()


Ties: TypeAlias = tuple[tuple[str, str], ...]
"""``(alias, name)`` pairs: a tensor the module holds under ``alias`` and, first, ``name``."""


def tied_names(module: nn.Module) -> Ties:
    """Each name of ``module``'s parameters and buffers whose tensor an earlier name holds.

    A tied weight (a GPT's head and its token embedding) is one tensor under two names;
    ``named_parameters()`` lists it under the first only, as a state keeps it. Parameters
    come before buffers, in ``named_parameters``' order.

    Example:
        >>> m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
        >>> m["b"].weight = m["a"].weight
        >>> tied_names(m)
        (('b.weight', 'a.weight'),)
    """
    first: dict[int, str] = {}
    pairs = []
    for name, t in (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ):
        if first.setdefault(id(t), name) != name:
            pairs.append((name, first[id(t)]))
    return tuple(pairs)


def call_with(
    module: nn.Module,
    tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    ties: Ties | None,
    args: Any,
    kwargs: Any,
) -> Any:
    """``torch.func.functional_call(module, tensors, args, kwargs)``, with known ties.

    ``functional_call`` finds every other name of each tensor it swaps in by walking all
    submodules' parameters and buffers on each call, so that a tied weight is swapped
    under each of its names. Dynamo traces that walk in every compiled step (about 2 s of
    a 12-layer GPT step's tracing, 2026-11-27). Given the module's ``ties``, recorded
    once by ``TrainState.create`` (:func:`tied_names`), the aliases are added here and the
    walk is skipped (``tie_weights=False``): the same tensors under the same names.
    ``ties=None`` (not known) walks as before.
    """
    if ties is None:
        return torch.func.functional_call(module, tensors, args, kwargs)
    params, buffers = tensors
    named = {**params, **buffers}
    named.update({alias: named[name] for alias, name in ties if name in named})
    return torch.func.functional_call(module, named, args, kwargs, tie_weights=False)


# --------------------------------------------------------------------------- the call scope


@dataclasses.dataclass(frozen=True)
class CallScope:
    """``in_place``: the call donates its state, so phases may update its tensors in place.
    ``into``: an eager accumulation window whose backward adds into the module's ``.grad``
    (a :class:`fasttorch.phases.IntoGrad`), or ``None``. ``progress``: the driver's
    :class:`Progress` of the call. ``state_window``: the accumulation window the call
    adds into is the state's own (across calls), not a scratch one. ``shared``: a
    several-model call's shared forwards, kept for their owners' steps (a
    ``fasttorch.several._shared_forward.Pending``), or ``None``; read by the operator
    that backpropagates them, which runs outside graphs.
    """

    in_place: bool = False
    into: Any = None
    progress: Progress | None = None
    state_window: bool = False
    shared: Any = None


class Progress:
    """Whether the running call may have written into its donated state (``began``).

    Set outside any graph where a write can begin: an eager update phase that updates
    in place, an eager commit's copies, an accumulation window added into in place,
    a compiled kernel that ran (or failed while running). The driver marks a donated
    input state dead when a call fails after that point. An error raised earlier (by
    the loss function, by a compiler refusing a graph, by validation) leaves it usable;
    only buffers the eager forward updated in place (BatchNorm statistics) may differ.
    """

    began: bool = False


def begin() -> None:
    """Note that the running call may write its donated state now (outside any graph)."""
    progress = _SCOPE.get().progress
    if progress is not None:
        progress.began = True


_SCOPE: contextvars.ContextVar[CallScope] = contextvars.ContextVar(
    "fasttorch_call_scope",
    default=CallScope(),  # noqa: B039 (frozen: never changed, only replaced)
)


def current() -> CallScope:
    """The scope of the running call (the default one outside any call)."""
    return _SCOPE.get()


@contextlib.contextmanager
def scope(**changes: Any) -> Iterator[CallScope]:
    """Run the block with the current scope's fields changed as given."""
    new = dataclasses.replace(_SCOPE.get(), **changes)
    token = _SCOPE.set(new)
    try:
        yield new
    finally:
        _SCOPE.reset(token)


def kernel_ran(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, a compiled kernel, noting in the call scope that it may have written.

    A kernel that ran, or failed while running, may have written into the donated
    state (a counter's increment scheduled before the failing kernel). One that the
    compiler refused (a trace or compile error, a shape error found while tracing)
    ran nothing: the call scope is left as it was.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            # compiled re-raises the user's own error found while tracing from dynamo's
            if not (_compat.is_compile_error(e) or _compat.is_compile_error(e.__cause__)):
                begin()
            raise
        begin()
        return out

    return run


# --------------------------------------------------------------------------- the RNG


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


# --------------------------------------------------------------------------- the state

_DONATED = "_fasttorch_donated"
_FAILED = "_fasttorch_failed"


class DonatedStateError(RuntimeError):
    """A ``TrainState`` was used after a step consumed it (see :func:`fasttorch.step`)."""


class TrainState(struct.Record):
    """Parameters, buffers, optimizer state, step counter, RNG and transform sub-states.

    A frozen dataclass registered as a pytree: ``torch.compile``, ``torch.func`` and
    checkpointing see every tensor leaf, while the module (used only as a template for
    :func:`torch.func.functional_call`) and the optimizer are static. Transforms keep
    their own small sub-state in :attr:`substates` under the key they declare
    (:class:`fasttorch.substates.SubState`: "amp", "grad_accumulate", ...), added by
    ``step.init(state)`` or on a step's first call.

    Attributes:
        params: trainable parameters by name (``requires_grad=True`` ones).
        buffers: buffers (BatchNorm running statistics) and frozen parameters.
        opt_state: the optimizer's state, hyperparameters included as 0-d tensors.
        step: number of optimizer steps taken (skipped ones included); schedules read it.
        rng: the generator state of the parameters' device (see ``fasttorch.state``).
        substates: per-transform state, by the key each transform declares.
        module: the template module (static).
        optimizer: the functional optimizer (static).
        ties: the module's tied names, ``(alias, name)`` pairs, recorded by ``create``
            (static; ``None`` where not known: the forward then finds them itself).

    Example:
        >>> import torch, fasttorch
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(3, 1), fasttorch.optim.sgd(0.1))
        >>> sorted(state.params), int(state.step)
        (['bias', 'weight'], 0)
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: OptState
    step: torch.Tensor
    rng: torch.Tensor
    substates: dict[str, Any]
    module: nn.Module = struct.field(static=True)
    optimizer: Optimizer = struct.field(static=True)
    ties: Ties | None = struct.field(static=True, default=None)

    # A donating step writes its results into these tensors (commit, below): the
    # same objects on every call, which compiled marks static for CUDA graphs.
    kept_across_calls: ClassVar[bool] = True

    @classmethod
    def create(
        cls, module: nn.Module, optimizer: Optimizer, *, seed: int | None = None
    ) -> TrainState:
        """Build the initial state of ``module`` trained by ``optimizer``.

        The state's parameters and buffers share storage with the module's own (no
        copy is made): a donating step updates them in place, so the module follows the
        latest state. Each submodule keeps the mode the user gave it, as in the plain
        loop: a BatchNorm frozen with ``bn.eval()`` stays frozen. Only a module whose
        root is in evaluation mode is put in training mode as a whole
        (``module.train()``). Steps train in the modes recorded here (docs/concepts.md,
        "Training and evaluation modes").

        A module sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) gives a
        *sharded* state: its parameters (and so the optimizer state built from them)
        are this rank's shards, the local tensors of the module's ``DTensor``
        parameters, which FSDP2 all-gathers for each forward. Such a state is trained
        by steps wrapped in ``sync_on_last`` (docs/distributed.md, "Sharding").

        Args:
            module: the model. Its floating-point parameters with ``requires_grad`` are
                trained; frozen parameters and buffers are carried as buffers.
            optimizer: a functional optimizer from :mod:`fasttorch.optim`.
            seed: seed of the state's own random generator (dropout). By default
                derived from ``torch.initial_seed()``, so ``torch.manual_seed(s)``
                before ``create`` seeds it too (docs/concepts.md, "Seeding").

        Raises:
            TypeError: ``module`` is not an ``nn.Module``, ``optimizer`` is not a
                fasttorch optimizer, or a parameter is not floating point.
            ValueError: nothing to train, or tensors on more than one device.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"TrainState.create expects an nn.Module, got {type(module).__name__}")
        if isinstance(optimizer, torch.optim.Optimizer) or (
            isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)
        ):
            name = getattr(optimizer, "__name__", type(optimizer).__name__)
            raise TypeError(
                f"TrainState.create expects a fasttorch optimizer, got torch.optim.{name}: "
                "torch.optim optimizers keep hidden mutable state, which a pure step "
                "cannot carry. Wrap the algorithm instead: "
                f"fasttorch.optim.from_torch(torch.optim.{name}, lr=..., ...) runs torch's "
                "own kernels with the state in the TrainState (and "
                "fasttorch.optim.load_torch_state_dict takes over an existing one's state)"
            )
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                "TrainState.create expects a fasttorch optimizer such as "
                f"fasttorch.optim.adamw(lr=1e-3), got {type(optimizer).__name__}"
            )
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                raise TypeError(
                    f"parameter {name!r} has dtype {p.dtype}; fasttorch trains "
                    "floating-point parameters only. Register it with "
                    "module.register_buffer, or give it a floating dtype"
                )
            (params if p.requires_grad else buffers)[name] = local_tensor(p)
        for name, b in module.named_buffers():
            buffers[name] = b.detach()
        if not params:
            raise ValueError(
                f"{type(module).__name__} has no parameters with requires_grad=True: "
                "nothing to train"
            )
        devices = {t.device for t in (*params.values(), *buffers.values())}
        if len(devices) > 1:
            where = {
                str(d): [n for n, t in (*params.items(), *buffers.items()) if t.device == d][:3]
                for d in devices
            }
            raise ValueError(
                f"the module's tensors are on more than one device: {where}. "
                "Move the whole module to one device (module.to(device)) first"
            )
        device = next(iter(params.values())).device
        if not module.training:
            module.train()
        record_modes(module)
        return cls(
            params=params,
            buffers=buffers,
            # an optimizer whose init reads the module (groups' module selectors) gets it
            opt_state=(
                optimizer.init(params, module=module)  # type: ignore[call-arg]
                if getattr(optimizer, "init_reads_module", False)
                else optimizer.init(params)
            ),
            step=torch.zeros((), dtype=torch.int64, device=device),
            rng=initial_rng_state(device, default_seed() if seed is None else seed),
            substates={},
            module=module,
            optimizer=optimizer,
            ties=tied_names(module),
        )

    def with_substate(self, key: str, value: Any) -> TrainState:
        """A copy with sub-state ``key`` set to ``value`` (the others kept, in order).

        How a transform's phase returns the sub-state it owns (declared with
        :class:`fasttorch.substates.SubState`); traces under ``torch.compile``.

        Example:
            >>> import torch, fasttorch
            >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
            >>> sorted(state.with_substate("calls", torch.zeros(())).substates)
            ['calls']
        """
        return self.replace(substates={**self.substates, key: value})

    def without_substate(self, key: str) -> TrainState:
        """A copy without sub-state ``key`` (the same state when it has none)."""
        if key not in self.substates:
            return self
        return self.replace(substates={k: v for k, v in self.substates.items() if k != key})

    @property
    def device(self) -> torch.device:
        """The device of the parameters."""
        return next(iter(self.params.values())).device

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module in evaluation mode with this state's parameters and buffers.

        No gradients are recorded and the state is left as it is: BatchNorm uses its
        running statistics instead of updating them, dropout is off.
        """
        try:
            with evaluating(self.module), torch.no_grad():
                if is_sharded(self.module):  # the module runs over this state's storage
                    return self.module(*args, **kwargs)
                return call_with(self.module, (self.params, self.buffers), self.ties, args, kwargs)
        finally:
            reshard(self.module)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This state's values under exactly the keys of ``module.state_dict()``, for export.

        What ``module.state_dict()`` leaves out stays out (a non-persistent buffer such
        as a rotary embedding's ``inv_freq``), and a tied weight appears under each of
        its names, so ``model.load_state_dict(state.state_dict())`` works strictly.

        Example:
            >>> import torch, fasttorch
            >>> state = fasttorch.TrainState.create(torch.nn.Linear(2, 1), fasttorch.optim.sgd(0.1))
            >>> torch.nn.Linear(2, 1).load_state_dict(state.state_dict())
            <All keys matched successfully>
        """
        tensors = {**self.params, **self.buffers}
        kept_as = dict(tied_names(self.module))  # a tied name -> the name the state keeps
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            mine = tensors.get(kept_as.get(key, key))
            value = value if mine is None else mine
            out[key] = value.detach() if isinstance(value, torch.Tensor) else value
        return out

    def __getattr__(self, name: str) -> NoReturn:
        # Only reached when normal lookup fails: fields of a donated state are gone.
        if not name.startswith("__") and _DONATED in object.__getattribute__(self, "__dict__"):
            _raise_donated(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        if _DONATED in self.__dict__:
            return "TrainState(<donated>)"
        n = sum(p.numel() for p in self.params.values())
        return (
            f"TrainState(params={len(self.params)} tensors/{n} values, "
            f"buffers={len(self.buffers)}, step={self.step!r}, "
            f"substates={sorted(self.substates)}, device={self.device})"
        )


def check_template(state: TrainState, api: str) -> None:
    """Raise if ``state``'s tensors do not fit its template module (host metadata only).

    ``functional_call`` puts any tensor in: a wider model's weights run through a
    narrower template without an error (a linear layer takes any input width) and train
    a different model. Each new parameter dict is checked once: the one a step returns
    is marked checked (``mark_template_ok``), so a training loop pays a lookup a call.
    """
    module = state.module
    if _TEMPLATE_OK.get(module) == id(state.params) or is_sharded(module):
        return
    own: dict[str, torch.Tensor] = dict(module.named_parameters())
    own.update(module.named_buffers())
    # A sub-state may say that every leaf carries a leading dimension of its own (a
    # population's members): the template's shapes are then those after it.
    lead = 1 if any_declares(state.substates, "stacks_members") else 0
    for group, tensors in (("params", state.params), ("buffers", state.buffers)):
        for name, t in tensors.items():
            ref = own.get(name)
            if ref is None:
                raise ValueError(
                    f"{api}: state.{group}[{name!r}] is not a parameter or buffer of the "
                    f"state's module ({type(module).__name__}), which has "
                    f"{sorted(own)[:8]}{'...' if len(own) > 8 else ''}. A state trains "
                    "through its own module: build it with TrainState.create(model, opt) "
                    "for the model these tensors belong to"
                )
            if ref.shape != t.shape[lead:] or t.dim() != ref.dim() + lead:
                raise ValueError(
                    f"{api}: state.{group}[{name!r}] has shape {tuple(t.shape)} but the "
                    f"state's module ({type(module).__name__}) has {tuple(ref.shape)} "
                    "there: the state mixes tensors of another model with this template, "
                    "which would run the wrong model. Build the state with "
                    "TrainState.create(model, opt) for the model the tensors belong to "
                    "(or load a checkpoint into a state of that model)"
                )
    mark_template_ok(state)


def mark_template_ok(state: TrainState) -> None:
    """Note that ``state``'s parameters fit its module (a step's result keeps shapes)."""
    _TEMPLATE_OK[state.module] = id(state.params)


# Per module: id() of the last parameter dict found to fit it (an id, not the dict:
# holding it would keep a copying step's old parameters alive).
_TEMPLATE_OK: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _raise_donated(state: TrainState) -> NoReturn:
    d = object.__getattribute__(state, "__dict__")
    where = d[_DONATED]
    failure = d.get(_FAILED)
    if failure is not None:
        raise DonatedStateError(
            f"this TrainState was donated to {where}, which failed part-way ({failure}). "
            "A donating call writes its results into the input state's tensors, and some "
            "may already have been written when the error surfaced (a compiled kernel "
            "that ran before the failing one), so the state is no longer consistent and "
            f"cannot be used: {AFTER_FAILURE}"
        )
    raise DonatedStateError(
        f"this TrainState was donated to {where}: its tensors were updated in place "
        "and now belong to the state that call returned. Use the returned state "
        "(state, metrics = step(state, batch)), or build the step with "
        "fasttorch.step(loss_fn, donate=False) to keep input states intact"
    )


# What to do once a donating call failed part-way: true on a first call too, where no
# earlier state exists and the model's own tensors (the state's) may be part-written.
AFTER_FAILURE = (
    "continue from the last state a call returned successfully, or from a checkpoint; "
    "if no call has returned yet, create the model and its state again (a donated "
    "state shares the model's tensors, which may hold part of the results). Build the "
    "step with fasttorch.step(loss_fn, donate=False) to keep input states intact when "
    "a call fails"
)


def mark_failed(state: TrainState, by: str, error: BaseException) -> None:
    """Mark ``state`` dead after a donating call ``by`` raised ``error`` part-way."""
    mark_donated(state, by)
    object.__getattribute__(state, "__dict__")[_FAILED] = failure_summary(error)


def failure_summary(error: BaseException) -> str:
    """``error``'s type and the first line of its message (cut to 200 characters)."""
    first = (str(error).strip().splitlines() or [""])[0]
    if len(first) > 200:
        first = first[:197] + "..."
    return f"{type(error).__name__}: {first}"


def mark_donated(state: TrainState, by: str) -> None:
    """Make every later use of ``state`` raise :class:`DonatedStateError`."""
    d = object.__getattribute__(state, "__dict__")
    d.clear()
    d[_DONATED] = by


def check_alive(state: Any, api: str) -> None:
    """Raise a clear error unless ``state`` is a live :class:`TrainState`."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"{api} expects a fasttorch.TrainState as its first argument, got "
            f"{type(state).__name__}; call it as state, metrics = step(state, batch)"
        )
    if _DONATED in object.__getattribute__(state, "__dict__"):
        _raise_donated(state)


# Donation, as ``jax.jit(donate_argnums=0)``: a donating step computes new values, then
# commit copies them into the input state's own tensors and returns the new state over
# them, so memory stays 1x; the input state is marked dead (mark_donated) and any later
# use raises DonatedStateError.


def commit(donate: bool, old: Any, new: Any) -> Any:
    """With donation, write ``new``'s tensors into ``old``'s and return ``new`` over them.

    Phases compute new values (in eager mode some update tensors they own in place);
    this is where a donated state's tensors take the results. Under ``compiled`` the
    copies fuse into the kernels that produce the values. The walk stops at subtrees
    that are the same object, so an update that already happened in place costs nothing.
    """
    if not donate:
        return new
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    compiling = torch.compiler.is_compiling()
    out = _reuse(old, new, dst, src, compiling)
    if len(dst) > 0 and compiling:  # the compiler makes its own kernels for the copies
        dst, src = copy_subclasses(dst, src)
        if len(dst) > 0:
            torch._foreach_copy_(dst, src)
    elif len(dst) > 0:
        begin()  # a failure from here on leaves the donated state part-written
        _copy_by_dtype(*copy_subclasses(dst, src))
    return out


def _copy_by_dtype(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``_foreach_copy_`` once per dtype: on CUDA a list of mixed dtypes (a state's int64
    counters beside its float32 tensors) is copied one launch per tensor."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        ds, ss = groups.setdefault(d.dtype, ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def _same(a: Any, b: Any, compiling: bool) -> bool:
    """``a is b``, for tensors always; for containers only outside a graph.

    Inside a compiled step, ``is`` between two dicts or records does not trace on every
    torch release (2.11's dynamo refuses it). There containers count as distinct and the
    walk goes on to their tensors, where ``is`` traces: the same copies result.
    """
    if isinstance(b, torch.Tensor) or not compiling:
        return a is b
    return False


def _reuse(
    old: Any, new: Any, dst: list[torch.Tensor], src: list[torch.Tensor], compiling: bool
) -> Any:
    """``new`` with its tensors swapped for ``old``'s where they differ (copies queued)."""
    if _same(old, new, compiling):
        return new
    if isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            dst.append(old)
            src.append(new)
            return old
        return new
    if isinstance(new, dict) and isinstance(old, dict):
        out = {}
        for k, v in new.items():
            if isinstance(v, torch.Tensor):  # the tensor case above, written out: a dict
                o = old.get(k)  # of parameters is walked per tensor in every trace
                if (
                    isinstance(o, torch.Tensor)
                    and o is not v
                    and o.shape == v.shape
                    and (o.dtype == v.dtype)
                ):
                    dst.append(o)
                    src.append(v)
                    v = o
                out[k] = v
            else:
                out[k] = _reuse(old[k], v, dst, src, compiling) if k in old else v
        return out
    if isinstance(new, struct.Record) and type(old) is type(new):
        changes = {}
        for name in struct.data_fields(new):
            a, b = getattr(old, name), getattr(new, name)
            if not _same(a, b, compiling):
                changes[name] = _reuse(a, b, dst, src, compiling)
        return new.replace(**changes) if changes else new
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(old) == len(new):
        items = [_reuse(a, b, dst, src, compiling) for a, b in zip(old, new)]
        return type(new)(items) if isinstance(new, list) else tuple(items)
    return new


def kept_leaves(args: Any) -> list[torch.Tensor]:
    """The tensors of the records in ``args`` that a donating step keeps from call to call.

    A record declares it with a class attribute ``kept_across_calls = True`` (the
    train state, an across-calls accumulation window); :func:`commit` writes every
    result into those tensors, so they are the same objects, at the same addresses, on
    every call. ``compiled`` marks them static for CUDA graphs.
    """
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, struct.Record) and getattr(type(a), "kept_across_calls", False):
            out.extend(t for t in pytree.tree_leaves(a) if isinstance(t, torch.Tensor))
    return out
