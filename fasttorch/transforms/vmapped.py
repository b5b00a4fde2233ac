"""``vmapped``: one step call trains every member of a population, under ``torch.func.vmap``.

The step's own phases (loss, gradients, update, and every transform's changes to them)
run once, under ``torch.func.vmap`` over the population's stacked leaves, so each
member sees an ordinary single-model state: its own parameters, optimizer state,
hyperparameters, step counter, loss scale and sub-states. Nothing is rewritten for the
population; three things are adapted to vmap, here:

* gradients come from ``torch.func.grad`` (the population's sub-state asks for it:
  ``torch.autograd.grad`` cannot run inside vmap);
* ``torch._foreach_*`` kernels have no batching rules: a ``TorchFunctionMode`` runs
  each as the per-tensor ops it stands for (the same arithmetic, tensor by tensor);
* random ops draw from each member's own generator state (``state.rng[i]``): dropout,
  ``torch.rand``/``randn`` and their ``_like`` forms go through ``fasttorch.state.draw_``,
  whose vmap rule draws member by member, so member ``i`` draws what its lone run
  draws; any other random op is refused (vmap's ``randomness="error"``), since it
  would draw from one generator for all members.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from fasttorch import _checks, _compat
from fasttorch.phases import Batch, Metrics, scoped_call
from fasttorch.population import (
    KEY,
    Members,
    check_module,
    check_optimizer,
    member_view,
)
from fasttorch.state import TrainState, commit, draw_
from fasttorch.steps import Step, check_wrap
from fasttorch.transforms._in_dims import InDims, check_batch_dims, check_in_dims
from fasttorch.transforms.grad_accumulate import AccumState

__all__ = ["vmapped", "vmapped_eval"]


def vmapped(step: Step, n: int, *, in_dims: InDims = None) -> Step:
    """Train ``n`` models as one: ``step`` mapped over a population with ``torch.func.vmap``.

    The state is a population (:func:`fasttorch.create_population`): every leaf stacked
    along a leading dimension of size ``n``. One call runs ``step`` for every member,
    each with its own parameters, optimizer state, hyperparameters, step counter and
    transform sub-states (the fp16 loss scale, the non-finite counters, the EMA), and
    returns the new population and metrics with a leading dimension ``n``
    (``metrics["loss"][i]`` is member ``i``'s loss). ``in_dims=None`` gives every member
    the same batch; ``in_dims=0`` gives member ``i`` the batch ``batch[i]`` (every tensor
    with a leading dimension ``n``); a pytree prefix of the batch mixes them, as
    ``torch.func.vmap``'s ``in_dims``. Compose it like any transform, inside
    ``compiled``: ``compiled(vmapped(clip_scaled(with_amp(step(loss_fn)), 1.0), n))``
    compiles one graph for the whole population.

    Equivalent to ``n`` independent loops, one per member::

        for batch in loader:
            for model, opt in zip(models, opts):
                loss = loss_fn(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    Each member draws its dropout masks from its own generator state: those of its
    lone run (docs/population.md, "Dropout and other random ops").

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed, not compiled.
        n: the number of members the state holds.
        in_dims: where the members' batches are: ``None`` (shared), ``0``, or a prefix.

    Raises:
        TypeError: ``step`` is not a fasttorch step.
        ValueError: ``n`` < 1, a compiled step, or a transform that reduces across
            ranks (``sync_on_last``); at call time, a state that is not a population
            of ``n``, or one whose optimizer or module cannot be batched.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(apply(x), y)
        >>> pop = fasttorch.create_population(
        ...     lambda: torch.nn.Linear(4, 1), fasttorch.optim.sgd(0.1), 3,
        ...     hyper={"lr": [0.01, 0.1, 1.0]})
        >>> train = fasttorch.vmapped(fasttorch.step(loss_fn), 3)
        >>> pop, metrics = train(pop, (torch.randn(8, 4), torch.randn(8, 1)))
        >>> tuple(metrics["loss"].shape), pop.step.tolist()
        ((3,), [1, 1, 1])
    """
    check_wrap(step, "vmapped")
    _compat.register_foreach_batching(_per_tensor)
    _checks.count("vmapped", "n", n)
    check_in_dims(in_dims, "vmapped")
    if step.window.reduce is not None or "sync_on_last" in step.transforms:
        raise ValueError(
            "vmapped cannot wrap a step with sync_on_last: its reduction across ranks "
            "runs hooks and collectives per model, which torch.func.vmap cannot batch. "
            "Train a population per rank without sync_on_last, or average the members' "
            "gradients yourself"
        )
    # Not donating inside vmap (donation is the population's, after it). The members'
    # calls run in a scope that is not in place, so no window uses the module's .grad.
    inner = attrs.evolve(step, donate=False)
    # Scratch buffers a runner keeps across calls (grad_accumulate's window) would be
    # made inside vmap for one member's shapes, and escape it: none are kept.
    inner.__dict__["_memos"] = _NoMemos()
    runner = functools.partial(_run_population, inner=inner, n=n, in_dims=in_dims)
    inits = tuple(
        attrs.evolve(d, init=functools.partial(_vmapped_init, d.init)) for d in step.inits
    )
    hooks = tuple(_PerMember(h, n) for h in step.hooks)
    return step.with_phases("vmapped", runner=runner, inits=inits, hooks=hooks)


def vmapped_eval(
    fn: Callable[[TrainState, Batch], Metrics], n: int, *, in_dims: InDims = None
) -> Callable[[TrainState, Batch], Metrics]:
    """An evaluation function (``fasttorch.eval_step``) mapped over a population's members.

    Returns ``(population, batch) -> metrics`` whose tensors have a leading dimension
    ``n``: ``metrics["loss"][i]`` is member ``i``'s loss on its batch (``in_dims`` as in
    :func:`vmapped`). Equivalent to ``[fn(member(pop, i), batch) for i in range(n)]``,
    stacked.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> pop = fasttorch.create_population(
        ...     lambda: torch.nn.Linear(4, 1), fasttorch.optim.sgd(0.1), 2)
        >>> ev = fasttorch.vmapped_eval(fasttorch.eval_step(loss_fn), 2)
        >>> tuple(ev(pop, torch.randn(8, 4))["loss"].shape)
        (2,)
    """
    _compat.register_foreach_batching(_per_tensor)
    if not callable(fn):
        raise TypeError(f"vmapped_eval expects an evaluation function, got {type(fn).__name__}")
    _checks.count("vmapped_eval", "n", n)
    check_in_dims(in_dims, "vmapped_eval")

    def evaluate(state: TrainState, batch: Batch) -> Metrics:
        _check_state(state, n)
        check_batch_dims(in_dims, batch, n, "vmapped_eval")

        def one(member_state: TrainState, b: Batch) -> Metrics:
            with _PerTensor(None):
                return fn(member_state, b)

        # Evaluation draws nothing (dropout is off); a sampling function draws from the
        # caller's generator, different values per member, as eval_step draws from it.
        out: Metrics = torch.func.vmap(one, in_dims=(0, in_dims), randomness="different")(
            state, batch
        )
        return out

    evaluate.__name__ = evaluate.__qualname__ = getattr(fn, "__name__", "evaluate")
    return evaluate


def _run_population(
    step: Step, state: TrainState, batch: Batch, *, inner: Step, n: int, in_dims: InDims
) -> tuple[TrainState, Metrics]:
    _check_state(state, n)
    check_batch_dims(in_dims, batch, n, "vmapped")
    if not step.is_eager and any(isinstance(v, AccumState) for v in state.substates.values()):
        raise ValueError(
            "compiled(vmapped(...)) cannot compile grad_accumulate(..., across_calls=True): "
            "the window's position is a Python int in the state, and in one graph for the "
            "whole population each position would be a recompile. Accumulate within a call "
            "(grad_accumulate(step, n)), or run this population eagerly"
        )
    kernel = step.kernel(
        "vmapped", lambda: functools.partial(_members, inner, in_dims, step.donate)
    )
    # Eager phases read the call scope: no in-place update, no backward into .grad.
    with scoped_call(in_place=False, into=None):
        try:
            return kernel(state, batch)  # type: ignore[no-any-return]
        except RuntimeError as e:
            if "randomness" in str(e):
                e.add_note(
                    "fasttorch.vmapped: each member draws from its own generator through "
                    "F.dropout (nn.Dropout), torch.rand, torch.randn, torch.rand_like and "
                    "torch.randn_like; other random ops (scaled_dot_product_attention's "
                    "dropout_p, torch.randint, Tensor.bernoulli_, ...) would draw from one "
                    "generator for all members and are refused. Use those ops instead "
                    "(attention dropout as nn.Dropout on the attention weights)"
                )
            elif "vmap" in str(e) or "Batching rule" in str(e):
                e.add_note(
                    "fasttorch.vmapped: the step ran under torch.func.vmap, which cannot "
                    "batch .item(), Python branching on tensor values, in-place writes into "
                    "a tensor shared by all members, or ops without batching rules; keep "
                    "the loss function free of those (docs/population.md)"
                )
            raise


def _members(
    inner: Step, in_dims: InDims, donate: bool, state: TrainState, batch: Batch
) -> tuple[TrainState, Metrics]:
    """The whole population's call: ``inner``'s runner under vmap, then donation."""

    def one(member_state: TrainState, b: Batch) -> tuple[TrainState, Metrics]:
        # The member's random ops advance its generator state in place (draw_).
        with _PerTensor(member_state.rng):
            new, metrics = inner.runner(inner, member_state, b)
        return new.replace(rng=member_state.rng), metrics

    # Draws write into the generator states: a copy, so that the input stays as it was
    # (donation then copies the advanced states back, as every other leaf).
    fresh = state.replace(rng=state.rng.clone())
    out_dims: Any = (0, 0)  # a pytree prefix, as in_dims (the stub says ints only)
    members = torch.func.vmap(one, in_dims=(0, in_dims), out_dims=out_dims, randomness="error")
    new, metrics = members(fresh, batch)
    return commit(donate, state, new), metrics


class _NoMemos(dict[str, Any]):
    """``Step.memo``'s store, keeping nothing: every call gets a fresh, empty memo."""

    def setdefault(self, key: str, default: Any = None) -> Any:
        return {}


def _vmapped_init(make: Callable[[TrainState], Any], state: TrainState) -> Any:
    """A transform's sub-state, built for each member (``make`` under vmap)."""

    def one(member_state: TrainState) -> Any:
        with _PerTensor(None):
            return make(member_state)

    out = torch.func.vmap(one, in_dims=(0,), randomness="error")(state)
    # A value the same for every member comes back expanded (stride 0): own memory.
    return pytree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, out)


def _check_state(state: TrainState, n: int) -> None:
    members = state.substates.get(KEY)
    if not isinstance(members, Members):
        raise ValueError(
            "vmapped: the state is a single model's TrainState; a vmapped step trains a "
            "population: build it with fasttorch.create_population(model, optimizer, n)"
        )
    got = int(members.index.shape[0])
    if got != n:
        raise ValueError(
            f"vmapped: the step was built for {n} members but the population holds {got}; "
            f"build the step with vmapped(step, {got})"
        )
    check_optimizer(state.optimizer, "vmapped")
    check_module(state.module, "vmapped")


@attrs.frozen
class _PerMember:
    """An inner step's call hook (a host-side limit or warning), run for each member."""

    hook: Any
    n: int

    def before(self, step: Step, state: TrainState) -> None:
        _check_state(state, self.n)
        for i in range(self.n):  # views: a hook reads a counter or two, copies nothing
            self.hook.before(step, member_view(state, i))

    def after(self, step: Step, new: TrainState) -> None:
        for i in range(self.n):
            self.hook.after(step, member_view(new, i))


class _PerTensor(TorchFunctionMode):
    """Ops rewritten for vmap inside a member's step: random ops, ``F.layer_norm``,
    ``F.linear`` in half precision.

    ``rng``: the member's generator state, which its random ops advance (``None``
    where nothing may draw: evaluation and sub-state initialisation).
    """

    def __init__(self, rng: torch.Tensor | None) -> None:
        super().__init__()
        self.rng = rng

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.layer_norm:
            return _layer_norm(*args, **kwargs)
        if func is torch.nn.functional.linear:
            return _linear(*args, **kwargs)
        if self.rng is not None:
            drawn = _draw(self.rng, func, args, kwargs)
            if drawn is not None:
                return drawn
        return func(*args, **kwargs)


def _draw(rng: torch.Tensor, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` drawn from the member's own ``rng``, or ``None`` (not random).

    Each form runs the kernel call a single model makes on its global generator:
    ``F.dropout`` is ``x * (empty_like(x).bernoulli_(1 - p) / (1 - p))`` (ATen's
    ``_dropout_impl`` on CPU), ``torch.rand`` is ``empty(size).uniform_()``,
    ``torch.randn`` is ``empty(size).normal_()``.
    """
    if func is torch.nn.functional.dropout:
        return _dropout(rng, *args, **kwargs)
    if func in _LIKE and set(kwargs) <= {"dtype"}:
        x = args[0]
        dtype = kwargs.get("dtype") or x.dtype
        return draw_(rng, _LIKE[func], list(x.shape), 0.0, dtype, x.device)
    if func in _SIZED and set(kwargs) <= {"dtype", "device"}:
        size = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = torch.device(kwargs.get("device") or torch.get_default_device())
        return draw_(rng, _SIZED[func], [int(d) for d in size], 0.0, dtype, device)
    return None


_LIKE = {torch.rand_like: "uniform", torch.randn_like: "normal"}
_SIZED = {torch.rand: "uniform", torch.randn: "normal"}


def _dropout(
    rng: torch.Tensor,
    x: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
) -> torch.Tensor | None:
    if not training or not 0 < p < 1 or x.numel() == 0:  # draws nothing (or torch's error)
        return torch.nn.functional.dropout(x, p, training, inplace)
    noise = draw_(rng, "bernoulli", list(x.shape), 1 - p, x.dtype, x.device)
    noise = noise.div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


def _layer_norm(
    x: torch.Tensor,
    shape: Any,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` without its mixed-dtype kernel, whose backward vmap cannot batch.

    Under CPU autocast a bf16/fp16 input meets float32 weights: the mixed kernel
    computes in float32 and rounds its output once, and its backward under
    ``torch.func.vmap`` fails ("expected scalar type BFloat16 but found Float"). The
    same computation as float32 ops, rounded once at the end.
    """
    w = weight if weight is not None else bias
    if w is None or x.dtype == w.dtype or not x.is_floating_point():
        return torch.nn.functional.layer_norm(x, shape, weight, bias, eps)
    with torch.autocast(x.device.type, enabled=False):
        out = torch.nn.functional.layer_norm(x.to(w.dtype), shape, weight, bias, eps)
    return out.to(x.dtype)


_HALF = (torch.bfloat16, torch.float16)


def _half_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The half dtype an op on ``tensors`` computes in (autocast's, or theirs), or ``None``."""
    device = tensors[0].device.type
    if not all(t.is_floating_point() and t.dtype != torch.float64 for t in tensors):
        return None
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return dtype if dtype in _HALF else None
    dtype = tensors[0].dtype
    return dtype if dtype in _HALF and all(t.dtype == dtype for t in tensors) else None


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` in half precision rounded once, as the unbatched kernel rounds.

    A single model's half-precision linear is one ``addmm``: the products summed in
    float32 with the bias, rounded once to the half dtype. Under ``torch.func.vmap`` the
    per-member weights make it a batched product (rounded to the half dtype) and a
    separate bias add (rounded again; under autocast the add even promotes to float32,
    and the next op rounds it). Here the bias is one more column of the weight, against
    a column of ones in the input: one batched product, whose float32 sum includes the
    bias, rounded once. The same arithmetic as ``addmm`` (a product of two half values
    is exact in float32), in another order of summation (rule 2 of tests/tolerance.py);
    its backward gives the bias gradient as that product's column, also summed in
    float32 and rounded once, as the unbatched ``grad.sum(0)``.
    """
    dtype = None if bias is None else _half_dtype(x, weight, bias)
    if bias is None or dtype is None:
        return torch.nn.functional.linear(x, weight, bias)
    ones = torch.ones(*x.shape[:-1], 1, dtype=dtype, device=x.device)
    with torch.autocast(x.device.type, enabled=False):
        xs = torch.cat([x.to(dtype), ones], dim=-1)
        ws = torch.cat([weight.to(dtype), bias.to(dtype).unsqueeze(-1)], dim=-1)
        return torch.nn.functional.linear(xs, ws)


def _per_tensor(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch._foreach_<op>(*args, **kwargs)`` as one op per tensor (a vmap batching rule).

    ``torch.func.vmap`` has no batching rule (and no fallback) for the foreach kernels
    that fasttorch's optimizers and transforms use; each is a loop of one op per tensor,
    with list arguments taken element by element, which vmap batches
    (``_compat.register_foreach_batching``).
    """
    inplace = op.endswith("_")
    base = op.rstrip("_")
    count = len(args[0])

    def item(a: Any, i: int) -> Any:
        return a[i] if isinstance(a, (list, tuple)) and len(a) == count else a

    results = []
    for i in range(count):
        xs = [item(a, i) for a in args]
        results.append(_one(base, inplace, xs, kwargs))
    return None if inplace else results


def _one(base: str, inplace: bool, xs: list[Any], kwargs: dict[str, Any]) -> Any:
    t = xs[0]
    if base == "norm":
        return torch.linalg.vector_norm(t, *xs[1:2], **kwargs)
    if base in ("addcmul", "addcdiv"):
        value = xs[3] if len(xs) > 3 else kwargs.get("value", 1)
        prod = xs[1] * xs[2] if base == "addcmul" else xs[1] / xs[2]
        out = t + prod * value
        return t.copy_(out) if inplace else out
    if base == "copy":
        return t.copy_(xs[1])
    if base == "zero":
        return t.zero_()
    if base == "lerp" and inplace:  # lerp_ with a tensor weight has no batching rule; lerp has
        return t.copy_(torch.lerp(*xs, **kwargs))
    if inplace:
        return getattr(t, base + "_")(*xs[1:], **kwargs)
    return getattr(torch, base)(*xs, **kwargs)
