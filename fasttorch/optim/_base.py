"""The vocabulary every fasttorch optimizer speaks: its state record and its protocol.

An optimizer is a small frozen configuration object (built outside the step, validated
at construction) with three pure methods: ``init`` builds an :class:`OptState`,
``learning_rate`` reads the rate for a step, and ``update`` returns new parameters and a
new state without touching its inputs. Hyperparameters live in the state as 0-d float32
tensors so that changing them (:func:`set_hyperparams`) never recompiles a step (float32,
as torch's capturable optimizers: ``torch.compile`` turns 0-d float64 CPU tensors into
Python floats whose values it guards, a read of each on every call).

And when a built-in optimizer runs torch's fused kernel, with the host values it needs. A
donated eager step on a GPU updates every parameter of one dtype in one launch of
torch's fused kernel (``torch.optim.AdamW(fused=True)``'s), which also takes
``GradScaler``'s scale and inf flag. Elsewhere (a CPU, a graph, a state that is not
donated) the update runs as ``_foreach_*`` calls, written so that each takes CUDA's
multi-tensor path (docs/optimizers.md, "Kernels").
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from fasttorch import _checks, _compat, struct
from fasttorch.optim import _inner
from fasttorch.schedules import Schedule

__all__ = [
    "FUSED_DEVICES",
    "LearningRate",
    "OptState",
    "Optimizer",
    "by_dtype",
    "cpu_as_gpu",
    "cpu_operator",
    "factor_dtype",
    "float_flag",
    "host_float",
    "kernel",
    "like_params",
    "remember",
    "set_hyperparams",
    "update_used",
]


LearningRate = float | Schedule
"""A learning rate: a fixed float, or a schedule evaluated in-graph from the step."""

TensorList = list[Tensor] | tuple[Tensor, ...]
"""What ``torch._foreach_*`` takes and returns."""


class OptState(struct.Record):
    """The state of a functional optimizer: a pytree of tensors, nothing else.

    Attributes:
        count: int64 0-d tensor on the parameters' device, the number of updates
            applied so far (Adam's bias correction uses ``count + 1``).
        hyper: 0-d float32 tensors on the parameters' device, by name ("lr",
            "weight_decay", "momentum", "dampening", "beta1", "beta2", "eps" as the
            algorithm needs; ``from_torch``'s "lr" is a 1-element tensor, float64 for a
            Python float); change them with :func:`set_hyperparams`.
        slots: per-parameter buffers by slot name, then parameter name
            (``{"exp_avg": {"w": ...}}``), same dtype and device as the parameter.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> state = optim.sgd(0.1, momentum=0.9).init({"w": torch.ones(2)})
        >>> state.count, sorted(state.hyper), state.slots["momentum_buffer"]["w"]
        (tensor(0), ['dampening', 'lr', 'momentum', 'weight_decay'], tensor([0., 0.]))
    """

    count: Tensor
    hyper: dict[str, Tensor]
    slots: dict[str, dict[str, Tensor]]


class Optimizer(Protocol):
    """What a training step needs from an optimizer (``fasttorch.optim.sgd`` etc.)."""

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """A fresh state for ``params``: count 0, hyperparameters, zeroed slots."""
        ...

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        """The 0-d learning rate ``update`` uses at training step ``step``."""
        ...

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        inplace: bool = False,
    ) -> tuple[dict[str, Tensor], OptState]:
        """New parameters and state after one step.

        The inputs are left untouched unless ``inplace=True``, which overwrites the
        parameter, slot and gradient tensors and returns them (same results).
        """
        ...


# Valid ranges, shared by construction-time validation and set_hyperparams.
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda v: v >= 0.0, "lr >= 0"),
    "weight_decay": (lambda v: v >= 0.0, "weight_decay >= 0"),
    "momentum": (lambda v: v >= 0.0, "momentum >= 0"),
    "dampening": (lambda v: 0.0 <= v <= 1.0, "0 <= dampening <= 1"),
    "beta1": (lambda v: 0.0 <= v < 1.0, "0 <= beta1 < 1"),
    "beta2": (lambda v: 0.0 <= v < 1.0, "0 <= beta2 < 1"),
    "eps": (lambda v: v >= 0.0, "eps >= 0"),
}


def check_hyper(owner: str, name: str, value: object) -> None:
    """Raise ValueError (TypeError for non-numbers) unless ``value`` is valid for ``name``."""
    ok, rule = _RANGES[name]
    # finite=False: inf and NaN get the message below, which names the range too.
    x = _checks.real(
        owner, name, value, finite=False, kind="a float", hint=f"Pass a value with {rule}."
    )
    if not math.isfinite(x) or not ok(x):
        raise ValueError(
            f"{owner}: invalid {name}={value!r}; valid values are finite and satisfy "
            f"{rule}. Pass a value in that range."
        )


def check_lr(owner: str, lr: object) -> None:
    """Validate a learning rate: a float >= 0 or a schedule (see :func:`check_schedule`)."""
    if callable(lr):
        check_schedule(owner, lr)
        return
    check_hyper(owner, "lr", lr)


_HOST_READS = frozenset(
    {"__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "cpu"}
)


class _NoHostRead(torch.overrides.TorchFunctionMode):
    """Refuses reading a tensor's value into Python (``if step < 10``, ``float(step)``)."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        if getattr(func, "__name__", "") in _HOST_READS:
            raise TypeError(
                f"{self.owner}: the learning-rate schedule reads the step's value into Python "
                f"({getattr(func, '__name__', func)}, as `if step < k:` or float(step) do). "
                "A schedule is evaluated inside the step, where that is a host sync and, "
                "compiled, a graph break. Write it with tensor ops, e.g. "
                "lambda step: torch.where(step < 100, 1e-3, 1e-4), or use "
                "fasttorch.schedules"
            )
        return func(*args, **(kwargs or {}))


def check_schedule(owner: str, schedule: Callable[..., object]) -> None:
    """Raise unless ``schedule(step)`` works at step 0 as it must inside a step.

    Evaluated once here, on a CPU step tensor, so that a schedule that branches on the
    step's value or returns no number fails when the optimizer is built, not at the
    first step, after the state was given to it. A Python number is accepted (it is
    turned into a tensor in the step); a tensor must hold one value.
    """
    try:
        with _NoHostRead(owner):
            out = schedule(torch.zeros((), dtype=torch.int64))
    except Exception as e:
        e.add_note(f"fasttorch: raised by {owner}'s lr schedule, evaluated at step 0 to check it")
        raise
    if isinstance(out, Tensor):
        if out.numel() != 1 or out.is_complex() or out.dtype == torch.bool:
            raise TypeError(
                f"{owner}: the lr schedule returned a {out.dtype} tensor of shape "
                f"{tuple(out.shape)} at step 0; a schedule returns the rate as a 0-d "
                "float tensor (or a Python float)"
            )
        out = float(out.detach().reshape(()))
    check_hyper(f"{owner} (its lr schedule at step 0)", "lr", out)


def make_hyper(lr: LearningRate, device: torch.device, **values: float) -> dict[str, Tensor]:
    """0-d float32 hyperparameter tensors on ``device``; "lr" only when it is a float."""
    if not callable(lr):
        values = {"lr": float(lr), **values}
    return {
        name: torch.tensor(float(v), dtype=torch.float32, device=device)
        for name, v in values.items()
    }


def params_device(params: Mapping[str, Tensor]) -> torch.device:
    """The device of the first parameter (CPU when there are none)."""
    for p in params.values():
        return p.device
    return torch.device("cpu")


def scheduled_or_fixed_lr(lr: LearningRate, opt_state: OptState, step: Tensor) -> Tensor:
    """``lr(step)`` for a schedule, else the tensor in ``opt_state.hyper["lr"]``."""
    if callable(lr):
        rate = lr(step)
        if not isinstance(rate, Tensor):  # a Python number (checked by check_schedule)
            return torch.full((), float(rate), dtype=torch.float64, device=step.device)
        return rate.to(torch.float64)
    return opt_state.hyper["lr"]


def set_hyperparams(
    opt_state: OptState, *, in_place: bool = False, **values: float | Tensor
) -> OptState:
    """A copy of ``opt_state`` with some hyperparameters replaced.

    The new values become tensors of the old ones' shape (0-d; ``from_torch``'s lr has
    one element), dtype and device, so a compiled
    step sees new tensor *values*, not new constants, and does not recompile. The
    torch.optim equivalent is ``for g in opt.param_groups: g["lr"] = value``.

    With ``in_place=True`` the values are written into the state's own 0-d tensors
    instead (the input then holds them too, as a donated state's tensors do), and the
    result holds the same tensor objects. Use it with a donating step under CUDA
    graphs (``compiled(..., mode="reduce-overhead")``): the graphs read the state's
    tensors at fixed addresses, and a new tensor would make them record again (after
    128 such records inductor stops using graphs for the step).

    Args:
        opt_state: the state returned by an optimizer's ``init`` or ``update``.
        **values: new values by name (``lr=1e-4``, ``weight_decay=0.0``): Python numbers
            or 1-element tensors, each checked to be finite and in range. For a tensor
            that reads its value to the host (a sync on a GPU): acceptable here, as
            ``set_hyperparams`` runs between steps, never inside one.

    Returns:
        A new :class:`OptState`; the input is unchanged.

    Raises:
        ValueError: for a name the state does not hold (the message lists the valid
            ones), for "lr" when the learning rate is a schedule, or for a value that
            is not finite (inf, NaN) or out of range.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> state = optim.adamw(1e-3).init({"w": torch.zeros(3)})
        >>> optim.set_hyperparams(state, lr=1e-4).hyper["lr"]
        tensor(1.0000e-04)
        >>> lr = state.hyper["lr"]
        >>> optim.set_hyperparams(state, lr=1e-5, in_place=True).hyper["lr"] is lr
        True
    """
    hyper = dict(opt_state.hyper)
    for name, value in values.items():
        if name not in hyper:
            if name == "lr":
                raise ValueError(
                    "set_hyperparams: this optimizer's lr is a schedule, evaluated from the "
                    "step counter inside the step, so there is no 'lr' to set. Build the "
                    "optimizer with a float lr to set it by hand, or pass a new schedule."
                )
            raise ValueError(
                f"set_hyperparams: unknown hyperparameter {name!r}; this state holds "
                f"{sorted(hyper)}. (Hyperparameters an optimizer was built without, e.g. "
                "momentum for sgd(momentum=0), cannot be added later: build a new one.)"
            )
        old = hyper[name]
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"set_hyperparams: {name} must be a number or a 1-element tensor, "
                    f"got a tensor of shape {tuple(value.shape)}."
                )
            check_hyper("set_hyperparams", name, float(value.detach().reshape(())))
            hyper[name] = value.detach().reshape(old.shape).to(dtype=old.dtype, device=old.device)
        else:
            # a parameter group's hyperparameter ("group0.lr") has the range of its own
            check_hyper("set_hyperparams", name.rsplit(".", 1)[-1], value)
            hyper[name] = torch.full(old.shape, float(value), dtype=old.dtype, device=old.device)
    if in_place:
        # Checked first, written after: a bad value leaves every tensor as it was.
        for name in values:
            hyper[name] = opt_state.hyper[name].copy_(hyper[name])
    # A number's value is known on the host: a fused GPU step need not read it back.
    remember(hyper, {n: v for n, v in values.items() if not isinstance(v, Tensor)})
    return opt_state.replace(hyper=hyper)


def computed_once(*scalars: Tensor) -> tuple[Tensor, ...]:
    """The 0-d float tensors ``scalars``, computed once per call of a CPU graph.

    Inductor inlines a chain of 0-d arithmetic (a bias correction, a clip coefficient)
    into every per-element expression that reads it: in an update over N parameter
    tensors, N copies of the chain to generate code for, and each copy's reads count
    toward inductor's rules for writing intermediate values to buffers of their own, so
    the copies also multiply the buffers (M3's update graph: 464 buffers instead of
    363, about 2 s more of its cold compile). Inductor always gives a CPU concatenation a
    buffer of its own, so here the scalars go through one ``torch.stack`` in float64
    (which holds every float32, bfloat16 and float16 value exactly) and come back in
    their own dtypes: the same values, computed once. Elsewhere they are returned as
    they are.
    """
    if any(s.dim() != 0 or not s.is_floating_point() for s in scalars):
        raise ValueError("computed_once takes 0-d floating-point tensors")
    if not in_cpu_graph(list(scalars)):
        return scalars
    entries = [s.to(torch.float64) for s in scalars]
    if len(entries) == 1:  # inductor inlines a concatenation of one tensor (a copy)
        entries.append(torch.zeros((), dtype=torch.float64))
    stacked = torch.stack(entries)
    return tuple(x.to(s.dtype) for x, s in zip(stacked.unbind(), scalars))


def in_cpu_graph(tensors: list[Tensor]) -> bool:
    """Whether ``tensors`` (CPU) are being traced into a compiled graph.

    Inductor has no CPU lowering for ``_foreach_lerp`` with tensor weights: it stays an
    ATen call, and the gradients it reads (unscaled, clipped) must be materialized
    first, a copy the size of the parameters. Per-tensor ``lerp`` is lowered and fuses
    with the arithmetic around it.
    """
    # len(), not bool(): dynamo in torch 2.10 and 2.11 cannot trace bool() of a list.
    return len(tensors) > 0 and tensors[0].device.type == "cpu" and torch.compiler.is_compiling()


_AS_GPU = [False]


@contextlib.contextmanager
def cpu_as_gpu() -> Iterator[None]:
    """Within it, a CPU step takes the form a GPU step has: no opaque update (torch's
    fused CPU kernel and its operators, a CPU's only; :func:`in_place_in_graph`,
    :func:`kernel`). For ``fasttorch.testing.check_cudagraphs``, which judges a CPU
    step's graphs as CUDA's."""
    before = _AS_GPU[0]
    _AS_GPU[0] = True
    try:
        yield
    finally:
        _AS_GPU[0] = before


def in_place_in_graph(opt: object) -> bool:
    """Whether ``opt.update(..., inplace=True)`` may run inside a compiled CPU step.

    A compiled step that donates its state on a CPU passes ``inplace=True`` to an
    optimizer whose ``in_place_in_graph`` is true (``adam(..., opaque=True)``, and
    ``groups`` holding one), which then runs its update as one opaque operator on the
    state's own tensors. Any other optimizer updates out of place there, as it always
    has: its eager in-place form may read values to the host, which a graph cannot.
    """
    return bool(getattr(opt, "in_place_in_graph", False)) and not _AS_GPU[0]


def update_outside_graphs(opt: object) -> bool:
    """Whether a compiled CPU step that donates its state runs ``opt``'s update outside
    its graphs, in place, as an eager step runs it.

    True for an opaque optimizer (:func:`in_place_in_graph`) and for one whose update a
    compiler cannot trace (``from_torch(..., fused=True)``: torch wraps its fused
    kernels in ``torch.compiler.disable``), which declares ``update_outside_graphs``.
    """
    own = bool(getattr(opt, "update_outside_graphs", False)) and not _AS_GPU[0]
    return own or in_place_in_graph(opt)


def update_used(
    opt: Optimizer,
    params: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    opt_state: OptState,
    step: Tensor,
    *,
    unused: frozenset[str],
    inplace: bool = False,
    reached: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], OptState]:
    """``opt.update`` on the parameters not in ``unused``; the others kept as they are.

    ``torch.optim`` skips a parameter whose ``grad`` is ``None``: no weight decay, no
    momentum step, no moment or per-parameter step count change. ``unused`` names the
    parameters the loss's graph did not reach (static: known when the graph is built),
    so this is a filter of the lists passed to the optimizer, not a tensor branch.
    Their parameter and slot tensors come back unchanged: the same tensors in place,
    copies otherwise (a new state never shares a tensor with the old one). The shared
    update ``count`` still advances (see docs/concepts.md for what that means for Adam).

    ``reached`` (``sync_on_last``): for names in ``unused``, a 0-d bool tensor saying
    whether another rank used the parameter; those are updated and then selected
    (``torch.where``) against their old values, so no rank reads the flag on the host.
    """
    maybe = {n: f for n, f in (reached or {}).items() if n in unused}
    if not maybe:
        return _update_skipping(opt, params, grads, opt_state, step, unused, inplace)

    def before(t: Tensor) -> Tensor:  # an in-place update overwrites the old value
        return _inner.clone(t) if inplace else t

    old_p = {n: before(params[n]) for n in maybe}
    old_s = {k: {n: before(v[n]) for n in maybe if n in v} for k, v in opt_state.slots.items()}
    out, new_s = _update_skipping(
        opt, params, grads, opt_state, step, unused - maybe.keys(), inplace
    )

    def pick(flag: Tensor, new: Tensor, old: Tensor) -> Tensor:
        chosen = _inner.where(flag, new, old)  # a quantized state: its codes
        return new.copy_(chosen) if inplace else chosen

    for n, flag in maybe.items():
        out[n] = pick(flag, out[n], old_p[n])
    slots = {k: dict(v) for k, v in new_s.slots.items()}
    for k, olds in old_s.items():
        for n, old in olds.items():
            slots[k][n] = pick(maybe[n], slots[k][n], old)
    return out, new_s.replace(slots=slots)


def _update_skipping(
    opt: Optimizer,
    params: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    opt_state: OptState,
    step: Tensor,
    unused: frozenset[str] | set[str],
    inplace: bool,
) -> tuple[dict[str, Tensor], OptState]:
    """:func:`update_used` without ``reached``: the ``unused`` parameters skipped."""
    skipped = [n for n in params if n in unused]
    if not skipped:
        return opt.update(params, grads, opt_state, step, inplace=inplace)
    used = [n for n in params if n not in unused]
    sub = opt_state.replace(
        slots={k: {n: v[n] for n in used if n in v} for k, v in opt_state.slots.items()}
    )
    new_p, new_s = opt.update(
        {n: params[n] for n in used}, {n: grads[n] for n in used}, sub, step, inplace=inplace
    )

    def kept(t: Tensor) -> Tensor:
        return t if inplace else _inner.clone(t)

    out = {n: new_p[n] if n in new_p else kept(params[n]) for n in params}
    slots = {
        k: {n: new_s.slots[k][n] if n in new_s.slots.get(k, {}) else kept(t) for n, t in v.items()}
        for k, v in opt_state.slots.items()
    }
    return out, new_s.replace(slots=slots)


# Layouts found to match, by (optimizer id, hyperparameter names, slot names); the
# optimizer is kept in the value so that its id is not reused while cached.
_MATCHED: dict[tuple[int, tuple[str, ...], tuple[str, ...]], Optimizer] = {}


def check_matches(
    optimizer: Optimizer, opt_state: OptState, params: Mapping[str, Tensor], api: str
) -> None:
    """Raise if ``opt_state`` does not have the layout ``optimizer.init`` gives.

    A state whose optimizer was swapped (``state.replace(optimizer=optim.adamw(...))``
    on an SGD state) otherwise fails inside the step with ``KeyError: 'beta1'``, after
    the state was given to it. The expected layout comes from ``init`` on ``meta``
    copies of the parameters (no memory), once per optimizer and layout; an
    optimizer whose ``init`` cannot run on ``meta`` is not checked.
    """
    key = (id(optimizer), tuple(opt_state.hyper), tuple(opt_state.slots))
    if _MATCHED.get(key) is optimizer:
        return
    try:
        fresh = optimizer.init({k: torch.empty_like(p, device="meta") for k, p in params.items()})
    except Exception:  # an optimizer that needs real tensors to init: not checked
        return
    if set(fresh.hyper) != set(opt_state.hyper) or set(fresh.slots) != set(opt_state.slots):
        raise ValueError(
            f"{api}: the state's optimizer state does not belong to its optimizer "
            f"{type(optimizer).__name__}: it holds hyperparameters {sorted(opt_state.hyper)} "
            f"and slots {sorted(opt_state.slots)}, where this optimizer keeps "
            f"{sorted(fresh.hyper)} and {sorted(fresh.slots)} (was the optimizer swapped "
            "with state.replace(optimizer=...)?). Start the new optimizer from a fresh "
            "state: state.replace(optimizer=new, opt_state=new.init(state.params)), or "
            "TrainState.create(model, new)"
        )
    if len(_MATCHED) > 256:
        _MATCHED.clear()
    _MATCHED[key] = optimizer


# --------------------------------------------------------------------------- operators

# fasttorch's operators with a CPU kernel only (torch.library, public API). Not custom_op:
# its Python autograd and in-place layers run on every call, 175 us a call over M1's 76
# tensors for Adam's (426 us against 250; 2026-11-29); these operators run under no_grad
# on tensors a step owns, and never meet autograd.
_LIB = torch.library.Library("fasttorch", "FRAGMENT")  # type: ignore[no-untyped-call]


def cpu_operator(schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> None:
    """Define ``fasttorch::<schema>`` with the CPU kernel ``impl`` and the fake kernel
    ``fake`` (what the compiler traces: the output's metadata, nothing computed)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)  # type: ignore[no-untyped-call]
    _LIB.impl(name, impl, "CPU")  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"fasttorch::{name}", fake, lib=_LIB)


# --------------------------------------------------------------------------- fused kernels

FUSED_DEVICES = frozenset({"cuda"})
"""Device types whose donated eager steps use the fused kernels for every optimizer.

Not the CPU: there only an opaque optimizer (``adam``, ``adamw``, ``sgd``'s default)
runs torch's fused CPU kernel, in eager and compiled steps alike (a compiled step runs
that update outside its graphs; a graph that holds it calls it as one operator):
:func:`kernel` with ``cpu``, so that both give the same bits. The tests run this
path on CPU by adding "cpu" here."""

_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def kernel(
    name: str, lists: Sequence[Sequence[Tensor]], *, cpu: bool = False
) -> Callable[..., Any] | None:
    """torch's fused kernel ``name`` when it can update ``lists`` (params first), else None.

    It can in an eager call (not traced), on a device in :data:`FUSED_DEVICES` (and on
    the CPU with ``cpu``: an opaque optimizer's kernel, in an eager call or, traced,
    inside the operator that runs it), for float dtypes, when every group of one dtype
    meets the kernel's layout rule (CUDA's multi-tensor rule: one device, dense
    tensors, the same shape and strides across the lists); and only where this torch
    has the kernel.
    """
    if not lists or not lists[0]:
        return None
    first = lists[0][0]
    on_cpu = cpu and first.device.type == "cpu" and not _AS_GPU[0]
    if torch.compiler.is_compiling():
        # Traced, only as an opaque optimizer's operator, which runs in a donated step:
        # never a vmapped one (whose members do not donate), which dynamo's tracing
        # would not tell apart from a plain graph.
        if not on_cpu:
            return None
    elif _compat.in_functorch_transform():  # vmap: the kernel's host hyperparameters
        return None
    if first.device.type not in FUSED_DEVICES and not on_cpu:
        return None
    fused = _compat.fused_optimizer_kernel(name)
    if fused is None:
        return None
    if on_cpu:
        # No per-tensor rule here: checked in a trace, it cost dynamo 5 s at 12 GPT
        # layers (4 lists of 148 tensors). The CPU kernel pairs elements by memory order,
        # which is right where a gradient has its parameter's strides (the moments and
        # the window's sums are made like the parameters): like_params copies one that
        # has not, at each call. Parameters are floating point.
        return fused if first.dtype in _DTYPES else None
    for group in by_dtype(lists):
        if group[0][0].dtype not in _DTYPES or not _same_layout(group):
            return None
    return fused


def like_params(params: Sequence[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """``grads``, each in its parameter's strides (a copy where it had others).

    torch's fused CPU kernels pair a parameter's elements with its gradient's and
    moments' in memory order, so every list must have the parameter's strides; the
    moments are made that way, a gradient from ``autograd.grad`` need not be.
    """
    if all(g.stride() == p.stride() for p, g in zip(params, grads)):
        return grads
    return [
        g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
        for p, g in zip(params, grads)
    ]


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a 0-d factor that scales a ``dtype`` list in a ``_foreach_*`` call.

    The list's own for float32 and float64: CUDA's multi-tensor path needs a scalar
    tensor of the list's dtype, and casting a float64 factor to float32 first is the
    cast the op itself makes (the same bits). float32 for bfloat16 and float16 lists,
    the precision the op computes in (a factor rounded to 8 bits would change the
    results; such lists take the per-tensor path in ``_foreach_*`` and the fused
    kernel in a donated eager step).
    """
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def by_dtype(lists: Sequence[Sequence[Tensor]]) -> Iterator[list[list[Tensor]]]:
    """``lists`` split by the dtype of the first list's tensors (one kernel per dtype)."""
    dtype = lists[0][0].dtype if len(lists[0]) > 0 else None
    if all(t.dtype == dtype for t in lists[0]):  # one dtype: the lists as they are
        yield [list(ts) for ts in lists]
        return
    order: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(lists[0]):
        order.setdefault(t.dtype, []).append(i)
    for indices in order.values():
        yield [[ts[i] for i in indices] for ts in lists]


def _same_layout(lists: Sequence[Sequence[Tensor]]) -> bool:
    first = lists[0][0]
    for ts in lists:
        for t, p in zip(ts, lists[0], strict=True):
            if t.dtype != first.dtype or t.device != first.device or t.layout != torch.strided:
                return False
            if t.shape != p.shape or t.stride() != p.stride():
                return False
            if not (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)):
                return False
    return True


# id(tensor) -> (weak reference, version when read, value as a Python float)
_HOST: dict[int, tuple[weakref.ref[Tensor], int, float]] = {}


def remember(hyper: Mapping[str, Tensor], values: Mapping[str, float]) -> None:
    """Record the host values of hyperparameter tensors ``init`` just made from ``values``.

    Each as its tensor holds it (rounded to the tensor's dtype, on the host), so that a
    step on a GPU never reads them back.
    """
    for name, v in values.items():
        t = hyper[name]
        _store(t, float(torch.tensor(float(v), dtype=t.dtype)))


def host_float(t: Tensor) -> float:
    """The value of the 0-d tensor ``t`` as a Python float, read once per change.

    A tensor recorded by :func:`remember` and unchanged since is not read again. One
    changed in place (:func:`~fasttorch.optim.set_hyperparams`), or new (a loaded
    checkpoint), is read once: on a GPU one copy to the host, at the first eager
    step after the change.
    """
    entry = _HOST.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == _compat.tensor_version(t):
        return entry[2]
    value = float(t)
    _store(t, value)
    return value


def _store(t: Tensor, value: float) -> None:
    key = id(t)
    _HOST[key] = (weakref.ref(t, lambda _: _HOST.pop(key, None)), _compat.tensor_version(t), value)


# The last flag converted: (weak reference to the bool tensor, its version, float copy).
_FLAG: list[tuple[weakref.ref[Tensor], int, Tensor]] = []


def float_flag(flag: Tensor) -> Tensor:
    """``flag.float()`` (a bool 0-d tensor as float32), converted once per step.

    The fused kernels and ``with_amp``'s loss-scale kernel take GradScaler's
    ``found_inf`` as float32; the same step converts the same flag for both.
    """
    if _FLAG:
        ref, version, value = _FLAG[0]
        if ref() is flag and version == _compat.tensor_version(flag):
            return value
    value = flag.float()
    _FLAG[:] = [(weakref.ref(flag), _compat.tensor_version(flag), value)]
    return value
