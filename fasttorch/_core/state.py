"""``TrainState``: everything a training step reads and writes, as one immutable pytree.

And its life: creation from a module, the check that its tensors fit that module, and
donation (a step's results written into the input state's tensors, which then die).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import torch
import torch.utils._pytree as pytree
from torch import nn

from fasttorch import _scope, struct
from fasttorch._module import Ties, call_with, record_modes, tied_names
from fasttorch._module import evaluating as evaluating
from fasttorch._module import is_sharded as is_sharded
from fasttorch._module import local_tensor as local_tensor
from fasttorch._module import reshard as reshard
from fasttorch._module import training_modes as training_modes
from fasttorch._rng import default_seed, initial_rng_state
from fasttorch.substates import any_declares

if TYPE_CHECKING:
    from fasttorch.optim import Optimizer, OptState

__all__ = [
    "DonatedStateError",
    "TrainState",
    "check_template",
    "commit",
    "default_seed",
    "evaluating",
    "is_sharded",
    "kept_leaves",
    "local_tensor",
    "reshard",
    "training_modes",
]

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
        rng: the generator state of the parameters' device (see ``fasttorch._rng``).
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
        torch._foreach_copy_(dst, src)
    elif len(dst) > 0:
        _scope.begin()  # a failure from here on leaves the donated state part-written
        _copy_by_dtype(dst, src)
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
