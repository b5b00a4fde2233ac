"""Contract checks for your own steps and transforms, in a few lines of a unit test.

:func:`check_step` runs a step through the invariants every fasttorch step keeps:

* ``pure``: the same ``(state, batch)`` gives bit-identical results, and the input
  state (and the module) is not changed. A donating :class:`fasttorch.Step` is
  checked as its ``donate=False`` twin (same phases, copying semantics); a plain
  callable that donates its input is reported as skipped;
* ``dtype``: every state leaf keeps its dtype, shape and device; metrics are tensors;
* ``composes``: ``with_amp(.., "bf16")``, ``grad_accumulate(.., 2)``,
  ``clip_scaled(.., 1.0)`` and ``ema(.., 0.9)`` still wrap it and run (the ones
  not applied yet; a ``Step``). For a step over several models
  (:func:`fasttorch.several`) each wraps every member's step: every trained member
  then takes as many updates as under the step itself, with finite parameters, and
  ``ema`` leaves the training unchanged bit for bit;
* ``compiles``: ``compiled(step, backend=compiled_backend)`` runs every batch with no
  graph break and no recompile, and agrees with the eager step;
* ``no_host_sync``: ``Tensor.item``, ``__bool__`` and ``tolist`` raise while the step
  runs, eager and compiled (after warm-up calls, since tracing may read values); on
  CUDA, any synchronizing call raises too (see :func:`forbid_host_sync`);
* ``reference``: the parameters equal those of your plain-PyTorch loop, given as
  ``reference(model, batches)`` on a deep copy of the initial model.

:func:`check_cudagraphs` tells, on any device, whether CUDA graphs
(``compiled(..., mode="reduce-overhead")``) would capture each of a step's graphs, and
every reason they would not.

Example:
    >>> import torch, fasttorch
    >>> from fasttorch.testing import check_step
    >>> def loss_fn(apply, batch):
    ...     x, y = batch
    ...     return torch.nn.functional.mse_loss(apply(x), y)
    >>> def make_state():
    ...     torch.manual_seed(0)
    ...     return fasttorch.TrainState.create(torch.nn.Linear(4, 2), fasttorch.optim.sgd(0.1))
    >>> def reference(model, batches):
    ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     for x, y in batches:
    ...         torch.nn.functional.mse_loss(model(x), y).backward()
    ...         opt.step()
    ...         opt.zero_grad()
    ...     return model
    >>> data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    >>> report = check_step(fasttorch.step(loss_fn), make_state, data, reference=reference)
    >>> sorted(report.values())
    ['ok', 'ok', 'ok', 'ok', 'ok', 'ok']
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree
from torch import nn

from fasttorch import _compat
from fasttorch.models import Models
from fasttorch.several import Several
from fasttorch.state import TrainState
from fasttorch.steps import Step, eager
from fasttorch.testing._cudagraphs import CudagraphReport, check_cudagraphs
from fasttorch.transforms.clip_scaled import clip_scaled
from fasttorch.transforms.compiled import compiled
from fasttorch.transforms.ema import ema
from fasttorch.transforms.grad_accumulate import grad_accumulate
from fasttorch.transforms.profiled import Profiled
from fasttorch.transforms.with_amp import with_amp

__all__ = [
    "CHECKS",
    "CudagraphReport",
    "assert_states_close",
    "check_cudagraphs",
    "check_step",
    "forbid_host_sync",
]

CHECKS = ("pure", "dtype", "composes", "compiles", "no_host_sync", "reference")
"""The checks :func:`check_step` knows, in the order it runs them."""

StepFn = Callable[[TrainState, Any], "tuple[TrainState, dict[str, Any]]"]
Reference = Callable[[nn.Module, Sequence[Any]], "nn.Module | Mapping[str, torch.Tensor]"]


def check_step(
    step: StepFn,
    state_factory: Callable[[], TrainState],
    batches: Sequence[Any],
    *,
    reference: Reference | None = None,
    compiled_backend: str = "aot_eager",
    checks: Sequence[str] = CHECKS,
    rtol: float = 1e-6,
    atol: float = 1e-7,
) -> dict[str, str]:
    """Run ``step`` through the contract checks of this module; raise on the first failure.

    Args:
        step: a :class:`fasttorch.Step` (any transforms, compiled or not) or any
            ``(state, batch) -> (state, metrics)`` callable.
        state_factory: builds a fresh, identical initial state on each call (seed
            inside it: it is called once per check).
        batches: at least 2 batches on the state's device, each splittable in 2
            (for the ``grad_accumulate`` composition).
        reference: ``reference(model, batches)`` trains ``model`` (a deep copy of the
            initial module) with plain PyTorch and returns it, or its parameters by
            name; compared with the step's parameters at ``rtol``/``atol``.
        compiled_backend: the ``torch.compile`` backend of the ``compiles`` check. It
            calls ``torch._dynamo.reset()`` first, to count graphs from zero.
        checks: the subset of :data:`CHECKS` to run.
        rtol, atol: tolerance of the ``reference`` comparison.

    Returns:
        ``{check: "ok" | "skipped: <why>"}`` for each check asked for.

    Raises:
        AssertionError: naming the check, the step and what differed.
    """
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"check_step: unknown checks {unknown}; valid: {list(CHECKS)}")
    if len(batches) < 2:
        raise ValueError(f"check_step: give at least 2 batches, got {len(batches)}")
    name = getattr(step, "__name__", type(step).__name__)
    report: dict[str, str] = {}
    runners = {
        "pure": _check_pure,
        "dtype": _check_dtype,
        "composes": _check_composes,
        "compiles": _check_compiles,
        "no_host_sync": _check_no_host_sync,
        "reference": _check_reference,
    }
    ctx = _Ctx(step, state_factory, batches, reference, compiled_backend, rtol, atol)
    for check in CHECKS:
        if check not in checks:
            continue
        try:
            report[check] = runners[check](ctx)
        except AssertionError as e:
            raise AssertionError(f"check_step[{check}] on {name!r}: {e}") from e
    return report


@attrs.frozen
class _Ctx:
    step: Any
    factory: Callable[[], TrainState]
    batches: Sequence[Any]
    reference: Reference | None
    backend: str
    rtol: float
    atol: float
    cache: dict[str, Any] = attrs.field(factory=dict)

    def fast(self) -> Any:
        """The compiled step, built once (so the checks share its compiled graphs)."""
        if "fast" not in self.cache:
            self.cache["fast"] = (
                self.step if self.is_compiled() else compiled(self.step, backend=self.backend)
            )
        return self.cache["fast"]

    def eager(self) -> Any:
        s = self.step
        return attrs.evolve(s, jit=eager) if isinstance(s, Step) else s

    def is_compiled(self) -> bool:
        s = self.step
        if isinstance(s, Profiled):
            s = s.step
        if isinstance(s, Step):
            return not s.is_eager
        return bool(getattr(s, "__fasttorch_compiled__", False))


def _run(fn: Any, state: TrainState, batches: Sequence[Any]) -> tuple[TrainState, dict[str, Any]]:
    metrics: dict[str, Any] = {}
    for b in batches:
        state, metrics = fn(state, b)
    return state, metrics


def _leaves(tree: Any) -> dict[str, Any]:
    return {pytree.keystr(p): x for p, x in pytree.tree_flatten_with_path(tree)[0]}


def _check_pure(c: _Ctx) -> str:
    s = c.eager()
    if isinstance(s, Step):
        s = attrs.evolve(s, donate=False)
    state = c.factory()
    if isinstance(s, Step):
        state = s.init(state)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in _leaves(state).items()}
    module_before = {k: v.clone() for k, v in state.module.state_dict().items()}
    b = c.batches[0]
    new1, m1 = s(state, b)
    try:
        after = _leaves(state)
    except RuntimeError as e:  # DonatedStateError
        return f"skipped: the callable donates its input ({e.__class__.__name__})"
    _compare(before, after, rtol=0, atol=0, what="the input state before and after a call")
    now = state.module.state_dict()
    for k, v in module_before.items():
        assert torch.equal(v, now[k]), f"the call changed the module's {k!r}"
    new2, m2 = s(state, b)
    assert_states_close(new1, new2, rtol=0, atol=0, what="two calls on the same (state, batch)")
    assert_states_close(m1, m2, rtol=0, atol=0, what="the metrics of two identical calls")
    return "ok"


def _check_dtype(c: _Ctx) -> str:
    s = c.eager()
    state = c.factory()
    if isinstance(s, Step):
        state = s.init(state)
    spec = {
        k: (v.dtype, v.shape, v.device)
        for k, v in _leaves(state).items()
        if isinstance(v, torch.Tensor)
    }
    for i, b in enumerate(c.batches):
        state, metrics = s(state, b)
        for k, v in _leaves(state).items():
            if k in spec and isinstance(v, torch.Tensor):
                assert (v.dtype, v.shape, v.device) == spec[k], (
                    f"after call {i}, state{k} is {v.dtype}{tuple(v.shape)}@{v.device}, "
                    f"was {spec[k][0]}{tuple(spec[k][1])}@{spec[k][2]}"
                )
        for k, v in _leaves(metrics).items():
            assert v is None or isinstance(v, torch.Tensor), (
                f"metrics{k} is a {type(v).__name__}: metrics must stay tensors (no host read)"
            )
    return "ok"


def _compositions() -> list[tuple[str, Callable[[Step], Step]]]:
    return [
        ("with_amp", lambda s: with_amp(s, "bf16")),
        ("grad_accumulate", lambda s: grad_accumulate(s, 2)),
        ("clip_scaled", lambda s: clip_scaled(s, 1.0)),
        ("ema", lambda s: ema(s, 0.9)),
    ]


def _check_composes(c: _Ctx) -> str:
    s = c.step
    if isinstance(s, Several):
        return _check_composes_members(c, s)
    if not isinstance(s, Step):
        return "skipped: not a fasttorch.Step (only compiled and profiled wrap a callable)"
    if not s.is_eager:
        return "skipped: compiled is outermost; nothing wraps it"
    done = []
    for name, wrap in _compositions():
        if name in s.transforms:
            continue
        state, metrics = _run(wrap(s), c.factory(), c.batches[:2])
        for k, v in _leaves(state.params).items():
            assert bool(torch.isfinite(v).all()), f"{name}(step): params{k} is not finite"
        assert "loss" in metrics, f"{name}(step): no 'loss' in the metrics"
        done.append(name)
    return "ok" if done else "skipped: every composable transform is already applied"


def _check_composes_members(c: _Ctx, s: Several) -> str:
    """Each transform applied to every member's step (how transforms compose over a step
    over several models): it runs, every trained member takes as many updates as under
    the step itself, with finite parameters and a loss, and ``ema`` leaves the training
    as it was, bit for bit (the average only reads the parameters)."""
    if not all(m.is_eager for _, m in s.steps):
        return "skipped: compiled is outermost; nothing wraps it"
    plain, _ = _run(s, c.factory(), c.batches[:2])
    assert isinstance(plain, Models)
    done = []
    for name, wrap in _compositions():
        if all(name in m.transforms for _, m in s.steps):
            continue
        if name == "grad_accumulate" and s.outputs:
            continue  # a shared output is the whole call's: no member splits the call
        wrapped = s.map_steps(_unless_applied(name, wrap))
        state, metrics = _run(wrapped, c.factory(), c.batches[:2])
        assert isinstance(state, Models)
        member: str
        for member, m in state.members.items():
            if not isinstance(m, TrainState):
                continue
            what = f"{name}(step of member {member!r})"
            for k, v in _leaves(m.params).items():
                assert bool(torch.isfinite(v).all()), f"{what}: params{k} is not finite"
            assert "loss" in metrics[member], f"{what}: no 'loss' in its metrics"
            took, want = int(m.step), int(plain.members[member].step)  # type: ignore[union-attr]
            assert took == want, f"{what}: {took} updates over 2 calls, the step {want}"
        if name == "ema":
            assert_states_close(
                plain.params, state.params, rtol=0, atol=0, what="ema(each member) vs the step"
            )
        done.append(name)
    return "ok" if done else "skipped: every composable transform is already applied"


def _unless_applied(name: str, wrap: Callable[[Step], Step]) -> Callable[[Step], Step]:
    return lambda m: m if name in m.transforms else wrap(m)


_PROFILED_SKIP = "skipped: profiled(step) cannot be compiled; check profiled(compiled(step))"


def _refuses_compile(c: _Ctx) -> bool:
    return isinstance(c.step, Profiled) and not c.is_compiled()


def _check_compiles(c: _Ctx) -> str:
    if _refuses_compile(c):
        return _PROFILED_SKIP
    fast = c.fast()
    counters = _compat.dynamo_counters()
    _compat.dynamo_reset()
    counters.clear()
    state, _ = _run(fast, c.factory(), c.batches)
    breaks = dict(counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"
    recompiles = sum(counters["recompiles"].values())
    assert recompiles == 0, f"{recompiles} recompiles over {len(c.batches)} calls"
    if not c.is_compiled():
        eager, _ = _run(c.step, c.factory(), c.batches)
        assert_states_close(
            eager.params, state.params, rtol=1e-5, atol=1e-6, what="compiled vs eager"
        )
    return "ok"


@contextlib.contextmanager
def forbid_host_sync(device: torch.device | str | None = None) -> Iterator[None]:
    """Make reading a device value on the host raise: ``item``, ``bool``, ``tolist``.

    ``float()`` and ``int()`` are left alone: reading a value that an earlier,
    non-blocking copy already brought to the host is not a sync (a policy that reads
    a counter one call late does that), and on a CPU the two cannot be told apart. On
    a CUDA ``device`` every synchronizing CUDA call raises as well
    (``torch.cuda.set_sync_debug_mode("error")``), which catches them all.

    Example:
        >>> import torch
        >>> from fasttorch.testing import forbid_host_sync
        >>> with forbid_host_sync():
        ...     torch.ones(2).item()
        Traceback (most recent call last):
        AssertionError: host sync inside a step: Tensor.item
    """

    def refuse(name: str) -> Callable[..., Any]:
        def f(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host sync inside a step: Tensor.{name}")

        return f

    names = ("item", "__bool__", "tolist")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    cuda = device is not None and torch.device(device).type == "cuda"
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _check_no_host_sync(c: _Ctx) -> str:
    variants = [("eager", c.eager(), 0)]
    if not _refuses_compile(c):
        variants.append(("compiled", c.fast(), len(c.batches) // 2))
    for label, fn, warm in variants:
        state, _ = _run(fn, c.factory(), c.batches[:warm])
        try:
            with forbid_host_sync(state.device):
                state, _ = _run(fn, state, c.batches[warm:])
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from e
    return "ok"


def _check_reference(c: _Ctx) -> str:
    if c.reference is None:
        return "skipped: no reference loop given"
    state = c.factory()
    model = copy.deepcopy(state.module)
    state, _ = _run(c.eager(), state, c.batches)
    out = c.reference(model, c.batches)
    ref = dict(out.named_parameters()) if isinstance(out, nn.Module) else dict(out)
    assert set(ref) == set(state.params), (
        f"the reference has parameters {sorted(ref)}, the state {sorted(state.params)}"
    )
    assert_states_close(
        state.params,
        {k: v.detach() for k, v in ref.items()},
        rtol=c.rtol,
        atol=c.atol,
        what="the step vs the reference loop",
    )
    return "ok"


def assert_states_close(
    a: Any, b: Any, *, rtol: float = 1e-6, atol: float = 1e-7, what: str = "states"
) -> None:
    """Assert two states (or any pytrees) have the same leaves, equal within tolerance.

    Leaves are matched by pytree path (``.params['w']``); tensors must have the same
    dtype and shape and be close (``torch.testing.assert_close``, NaNs equal);
    other leaves must be equal. ``rtol=atol=0`` asks for bit equality.

    Args:
        a, b: the two states, metrics dicts or other pytrees.
        rtol, atol: the tolerance.
        what: how the message names them.

    Raises:
        AssertionError: naming the first leaf that differs.

    Example:
        >>> import torch
        >>> from fasttorch.testing import assert_states_close
        >>> assert_states_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-9})
        >>> assert_states_close({"w": torch.ones(2)}, {"w": torch.zeros(2)}, what="x")
        Traceback (most recent call last):
        AssertionError: x differ at ['w']: ...
    """
    _compare(_leaves(a), _leaves(b), rtol=rtol, atol=atol, what=what)


def _compare(
    la: dict[str, Any], lb: dict[str, Any], *, rtol: float, atol: float, what: str
) -> None:
    if set(la) != set(lb):
        raise AssertionError(
            f"{what} have different leaves: only in the first {sorted(set(la) - set(lb))}, "
            f"only in the second {sorted(set(lb) - set(la))}"
        )
    for k, x in la.items():
        y = lb[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            try:
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as e:
                raise AssertionError(f"{what} differ at {k}: {e}") from None
        elif x is not y and x != y:
            raise AssertionError(f"{what} differ at {k}: {x!r} != {y!r}")
