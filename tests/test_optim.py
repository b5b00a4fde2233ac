"""fasttorch.optim against torch.optim: parameters and state, step by step."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from reference import capturable_on_cpu as allow_capturable_on_cpu
from reference import f32
from tolerance import EXACT, params_atol, unit_roundoff
from torch import Tensor, nn

from fasttorch import optim, schedules
from fasttorch.optim import OptState, _base
from fasttorch.optim.adam import adam_math
from fasttorch.optim.sgd import sgd_math

STEPS = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _grads(model: nn.Module, steps: int = STEPS) -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        for _ in range(steps)
    ]


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _close(a: Tensor, b: Tensor, atol: float) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


def _atol(
    ref: dict[str, Tensor], exact: dict[str, Tensor], steps: int, beta2: float | None = None
) -> float:
    """Rule 2 (tests/README.md): ``FACTOR`` x torch.optim's own fp32 error against the
    same optimizer run in float64 on the same gradients, one bound for the tensors given.

    torch's ``add(..., alpha=)`` fuses a multiply-add on CPU where fasttorch's
    tensor-scalar foreach ops round twice: the orders differ, the mathematics does not.
    The floor is two roundings (a product and a sum) per step of the largest entry:
    after few steps torch's own error can be 0 where fasttorch's is one rounding.

    ``beta2`` (the ``exp_avg_sq`` slot): fasttorch holds hyperparameters as float32
    tensors and forms ``1 - beta2`` from the rounded ``beta2``, whose one rounding that
    subtraction amplifies by its condition number ``beta2 / (1 - beta2)`` (torch rounds
    ``1 - beta2`` once): that many roundings of the slot, relative to its entries."""
    errors = {n: float((ref[n].double() - exact[n]).abs().max()) for n in ref}
    atol = params_atol(errors, exact, roundings=2 * steps)
    if beta2 is not None:
        largest = max(float(t.abs().max()) for t in exact.values())
        atol += unit_roundoff(torch.float32) * beta2 / (1 - beta2) * largest
    return atol


def _slots(opt: torch.optim.Optimizer, by_name: dict[str, Tensor], slot: str) -> dict[str, Tensor]:
    return {n: opt.state[p][SLOT_NAMES[slot]] for n, p in by_name.items()}


# (fasttorch factory kwargs, torch.optim class, torch kwargs)
CASES: dict[
    str,
    tuple[Callable[..., Any], dict[str, Any], Callable[..., torch.optim.Optimizer], dict[str, Any]],
] = {
    "sgd": (optim.sgd, {}, torch.optim.SGD, {}),
    "sgd_wd": (optim.sgd, {"weight_decay": 0.1}, torch.optim.SGD, {"weight_decay": 0.1}),
    "sgd_momentum": (
        optim.sgd,
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
        torch.optim.SGD,
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    ),
    "sgd_nesterov": (
        optim.sgd,
        {"momentum": 0.8, "nesterov": True, "weight_decay": 0.01},
        torch.optim.SGD,
        {"momentum": 0.8, "nesterov": True, "weight_decay": 0.01},
    ),
    "adam": (optim.adam, {}, torch.optim.Adam, {}),
    "adam_wd": (
        optim.adam,
        {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
        torch.optim.Adam,
        {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    ),
    "adamw": (optim.adamw, {}, torch.optim.AdamW, {}),
    "adamw_wd": (
        optim.adamw,
        {"weight_decay": 0.3, "betas": (0.5, 0.9)},
        torch.optim.AdamW,
        {"weight_decay": 0.3, "betas": (0.5, 0.9)},
    ),
}

SLOT_NAMES = {
    "momentum_buffer": "momentum_buffer",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
}


def _run_both(
    case: str,
    lr: float | schedules.Schedule,
    torch_lr: Callable[[int], float | None],
    set_lr: Callable[[int], float | None] = lambda k: None,
) -> None:
    """Train both for STEPS steps; compare params and state after every step."""
    factory, kw, torch_cls, torch_kw = CASES[case]
    model = _model()
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    ref_opt = torch_cls(ref.parameters(), lr=0.05, **torch_kw)
    exact_opt = torch_cls(exact.parameters(), lr=0.05, **torch_kw)
    names = [n for n, _ in ref.named_parameters()]
    by_name, exact_by_name = dict(ref.named_parameters()), dict(exact.named_parameters())
    opt = factory(lr, **kw)
    params = _params(model)
    state = opt.init(params)
    for k, grads in enumerate(_grads(model)):
        step = torch.tensor(k)
        new_lr = set_lr(k)
        if new_lr is not None:
            state = optim.set_hyperparams(state, lr=new_lr)
        lr_k = torch_lr(k)
        if lr_k is not None:
            for group in ref_opt.param_groups + exact_opt.param_groups:
                group["lr"] = lr_k
        for n in names:
            by_name[n].grad = grads[n].clone()
            exact_by_name[n].grad = grads[n].double()
        ref_opt.step()
        exact_opt.step()
        params, state = opt.update(params, grads, state, step)
        assert list(params) == names
        assert int(state.count) == k + 1
        with torch.no_grad():
            atol = _atol(by_name, exact_by_name, k + 1)
            for n in names:
                _close(params[n], by_name[n], atol)
            for slot, buffers in state.slots.items():
                ref_slot = _slots(ref_opt, by_name, slot)
                exact_slot = _slots(exact_opt, exact_by_name, slot)
                beta2 = ref_opt.param_groups[0]["betas"][1] if slot == "exp_avg_sq" else None
                slot_atol = _atol(ref_slot, exact_slot, k + 1, beta2)
                for n in names:
                    _close(buffers[n], ref_slot[n], slot_atol)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optim(case: str) -> None:
    _run_both(case, 0.05, lambda k: None)


@pytest.mark.parametrize("case", ["sgd_momentum", "adam", "adamw_wd"])
def test_set_hyperparams_lr_mid_run(case: str) -> None:
    def lr_at(k: int) -> float | None:
        return {0: 0.05, 7: 0.01, 13: 0.2}.get(k)

    _run_both(case, 0.05, lr_at, set_lr=lr_at)


@pytest.mark.parametrize("case", ["sgd_nesterov", "adam_wd", "adamw"])
def test_scheduled_lr(case: str) -> None:
    sched = schedules.warmup(5, schedules.cosine(0.1, 10, end=0.001), init=0.01)
    _run_both(case, sched, lambda k: float(sched(torch.tensor(k))))


def test_set_hyperparams_other_values() -> None:
    """Changing momentum and weight decay mid-run, as param_group edits do."""
    model = _model()
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    exact_opt = torch.optim.SGD(exact.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    opt = optim.sgd(0.05, momentum=0.9, weight_decay=0.01)
    params = _params(model)
    state = opt.init(params)
    for k, grads in enumerate(_grads(model, 10)):
        if k == 5:
            state = optim.set_hyperparams(state, momentum=0.5, weight_decay=torch.tensor(0.2))
            ref_opt.param_groups[0].update(momentum=0.5, weight_decay=0.2)
            exact_opt.param_groups[0].update(momentum=0.5, weight_decay=0.2)
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        for n, p in exact.named_parameters():
            p.grad = grads[n].double()
        ref_opt.step()
        exact_opt.step()
        params, state = opt.update(params, grads, state, torch.tensor(k))
    with torch.no_grad():
        ref_p = dict(ref.named_parameters())
        atol = _atol(ref_p, dict(exact.named_parameters()), 10)
        for n, p in ref_p.items():
            _close(params[n], p, atol)


@pytest.mark.parametrize("factory", [optim.sgd, optim.adam, optim.adamw])
def test_hyper_dtype_and_learning_rate(factory: Callable[..., Any]) -> None:
    state = factory(0.1).init({"w": torch.zeros(2)})
    assert state.count.dtype == torch.int64 and state.count.shape == ()
    for value in state.hyper.values():
        # float32: float64 0-d CPU tensors would be turned into guarded Python floats
        # by torch.compile, a read of their value on every call.
        assert value.dtype == torch.float32 and value.shape == ()
    lr = factory(0.1).learning_rate(state, torch.tensor(3))
    one_rounding = unit_roundoff(torch.float32)  # 0.1 held as a float32
    assert lr.dtype == torch.float32 and float(lr) == pytest.approx(0.1, rel=one_rounding)
    sched = factory(schedules.step_decay(1.0, 2, gamma=0.5))
    sstate = sched.init({"w": torch.zeros(2)})
    assert "lr" not in sstate.hyper
    assert float(sched.learning_rate(sstate, torch.tensor(3))) == 0.5


@pytest.mark.parametrize(
    "opt",
    [
        optim.sgd(0.1, momentum=0.9, nesterov=True),
        optim.adam(0.1, weight_decay=0.1),
        optim.adamw(0.1),
    ],
)
def test_update_is_pure(opt: Any) -> None:
    model = _model()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    grads = _grads(model, 2)
    state = opt.init(params)
    params, state = opt.update(params, grads[0], state, torch.tensor(0))
    snapshot = copy.deepcopy((params, grads[1], state))
    new_params, new_state = opt.update(params, grads[1], state, torch.tensor(1))
    for a, b in zip(
        torch.utils._pytree.tree_leaves((params, grads[1], state)),
        torch.utils._pytree.tree_leaves(snapshot),
    ):
        assert torch.equal(a, b)
    assert int(state.count) == 1 and int(new_state.count) == 2
    assert all(not p.requires_grad for p in new_params.values())
    # Same inputs, same outputs.
    again, _ = opt.update(params, grads[1], state, torch.tensor(1))
    assert all(torch.equal(again[n], new_params[n]) for n in params)


def _traced_and_eager(
    opt: Any, steps: int, lr_at: Callable[[int], float] | None = None
) -> tuple[dict[str, Tensor], OptState, dict[str, Tensor], OptState]:
    """``steps`` updates through ``torch.compile(update, backend="aot_eager")`` and
    eagerly from the same start: (params, state) of each. ``lr_at`` sets a fixed lr."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    update: Callable[..., Any] = torch.compile(opt.update, fullgraph=True, backend="aot_eager")
    model = _model()
    params = _params(model)
    grads = _grads(model, steps)
    state = opt.init(params)
    eager_params, eager_state = params, state
    for k in range(steps):
        step = torch.tensor(k)
        if lr_at is not None and "lr" in state.hyper:
            state = optim.set_hyperparams(state, lr=lr_at(k))
            eager_state = optim.set_hyperparams(eager_state, lr=lr_at(k))
        params, state = update(params, grads[k], state, step)
        eager_params, eager_state = opt.update(eager_params, grads[k], eager_state, step)
    return params, state, eager_params, eager_state


@pytest.mark.parametrize(
    "opt",
    [
        optim.sgd(0.1, momentum=0.9),
        optim.adam(0.1, weight_decay=0.1),
        optim.adamw(schedules.one_cycle(0.1, 20)),
    ],
    ids=["sgd", "adam", "adamw_scheduled"],
)
def test_compiles_once_while_lr_changes(opt: Any) -> None:
    params, _, eager_params, _ = _traced_and_eager(opt, 10, lambda k: 0.1 / (k + 1))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    for n in params:
        # Rule 1: aot_eager runs the eager update's operations, in the same order.
        _close(params[n], eager_params[n], 0.0)


def test_empty_params() -> None:
    opt = optim.adam(0.1)
    state = opt.init({})
    params, state = opt.update({}, {}, state, torch.tensor(0))
    assert params == {} and int(state.count) == 1


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: optim.sgd(-0.1), ["lr=-0.1", "lr >= 0"]),
        (lambda: optim.sgd(0.1, momentum=-1.0), ["momentum=-1.0", "momentum >= 0"]),
        (lambda: optim.sgd(0.1, weight_decay=-1e-3), ["weight_decay", ">= 0"]),
        (lambda: optim.sgd(0.1, nesterov=True), ["nesterov", "momentum > 0"]),
        (lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True), ["dampening"]),
        (lambda: optim.adam(0.1, betas=(1.0, 0.999)), ["beta1=1.0", "0 <= beta1 < 1"]),
        (lambda: optim.adam(0.1, betas=(0.9, -0.1)), ["beta2=-0.1"]),
        (lambda: optim.adamw(0.1, eps=-1e-8), ["eps", ">= 0"]),
        (lambda: optim.adamw(0.1, weight_decay=-0.1), ["weight_decay"]),
        (lambda: optim.adam(0.1, betas=(0.9,)), ["pair"]),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments(build: Callable[[], object], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        build()
    for word in words:
        assert word in str(info.value)


def test_bad_lr_type() -> None:
    with pytest.raises(TypeError, match="lr must be a float"):
        optim.sgd("0.1")  # type: ignore[arg-type]


def test_set_hyperparams_errors() -> None:
    state = optim.sgd(0.1).init({"w": torch.zeros(2)})
    with pytest.raises(
        ValueError, match=r"unknown hyperparameter 'momentum'.*\['lr', 'weight_decay'\]"
    ):
        optim.set_hyperparams(state, momentum=0.9)
    with pytest.raises(ValueError, match=r"lr=-1\.0"):
        optim.set_hyperparams(state, lr=-1.0)
    with pytest.raises(ValueError, match="1-element"):
        optim.set_hyperparams(state, lr=torch.ones(2))
    scheduled = optim.adam(schedules.constant(0.1)).init({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="schedule"):
        optim.set_hyperparams(scheduled, lr=0.1)
    new = optim.set_hyperparams(state, lr=torch.tensor(0.5, dtype=torch.float64))
    assert new.hyper["lr"].dtype == torch.float32 and float(new.hyper["lr"]) == 0.5
    assert float(state.hyper["lr"]) == pytest.approx(0.1, rel=unit_roundoff(torch.float32))


@pytest.mark.parametrize(
    "value",
    [math.inf, -math.inf, math.nan, torch.tensor(math.nan), torch.tensor([math.inf]), -2.0],
    ids=["inf", "-inf", "nan", "tensor-nan", "tensor-inf", "tensor-negative"],
)
def test_set_hyperparams_refuses_non_finite_and_out_of_range_values(value: Any) -> None:
    state = optim.adamw(0.1).init({"w": torch.zeros(2)})
    if isinstance(value, float) and value == -2.0:
        value = torch.tensor(value)  # a tensor out of range is checked too
    with pytest.raises(ValueError, match=r"invalid lr=.*finite and satisfy lr >= 0"):
        optim.set_hyperparams(state, lr=value)
    with pytest.raises(ValueError, match=r"invalid eps=.*finite"):
        optim.set_hyperparams(state, eps=value)
    with pytest.raises(ValueError, match=r"invalid lr=inf"):
        optim.adamw(math.inf)


@pytest.mark.parametrize(
    "opt",
    [
        optim.adam(0.1, weight_decay=0.1),
        optim.adamw(0.05, betas=(0.3, 0.99), weight_decay=0.1),
        optim.adamw(schedules.one_cycle(0.1, 20), weight_decay=0.01),
    ],
    ids=["adam_l2", "adamw_small_beta1", "adamw_scheduled"],
)
def test_adam_in_a_cpu_graph_gives_the_eager_bits(opt: Any) -> None:
    """In a CPU graph Adam runs per tensor with its factors computed once; traced and
    run op by op (aot_eager), that form must give what the _foreach form gives."""
    params, state, eager_params, eager_state = _traced_and_eager(opt, 8)
    for n in params:
        assert torch.equal(params[n], eager_params[n]), n
        for slot in state.slots:
            assert torch.equal(state.slots[slot][n], eager_state.slots[slot][n]), (slot, n)


def _update_graph_calls(opt: Any, n: int) -> int:
    """Calls dynamo traced in ``opt.update`` over ``n`` CPU tensors (getitems not counted)."""
    import operator

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    params = {str(i): torch.randn(3, i + 1) for i in range(n)}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    update: Callable[..., Any] = torch.compile(opt.update, fullgraph=True, backend=backend)
    update(params, grads, opt.init(params), torch.tensor(0))
    (gm,) = graphs
    return sum(
        node.op in ("call_function", "call_method") and node.target is not operator.getitem
        for node in gm.graph.nodes
    )


@pytest.mark.parametrize(
    "opt", [optim.adamw(0.1, weight_decay=0.1), optim.adam(0.1, weight_decay=0.1)]
)
def test_adam_in_a_cpu_graph_traces_each_operation_once_not_once_per_tensor(opt: Any) -> None:
    """Dynamo's tracing time grows with the calls it traces: the CPU graph's Adam is one
    ``_foreach`` call per operation, and only its ``lerp`` (which inductor cannot lower
    as ``_foreach_lerp`` with a tensor weight on CPU) is one call per tensor."""
    per_tensor = (_update_graph_calls(opt, 12) - _update_graph_calls(opt, 4)) / 8
    assert per_tensor == 1


def _adamw_per_tensor(
    params: dict[str, Tensor], grads: dict[str, Tensor], state: OptState, step: Tensor
) -> tuple[dict[str, Tensor], OptState]:
    """AdamW as the CPU graph wrote it before, one expression per tensor (a reference)."""
    from fasttorch.optim._base import computed_once

    h, count = state.hyper, state.count + 1
    lr, beta1, beta2, eps, wd = h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"]
    t = count.to(torch.float32)
    step_size = beta1.pow(t).sub(1).div(lr).reciprocal()
    bc2 = beta2.pow(t).sub(1).neg().sqrt()
    decay, w, beta2, rest2, step_size, bc2, eps = computed_once(
        1 - lr * wd, 1 - beta1, beta2, 1 - beta2, step_size, bc2, eps
    )
    new_p, new_m, new_v = {}, {}, {}
    for n, p in params.items():
        g, m, v = grads[n], state.slots["exp_avg"][n], state.slots["exp_avg_sq"][n]
        p = p * decay
        new_m[n] = m = m.lerp(g, w.to(m.dtype))
        new_v[n] = v = torch.addcmul(v * beta2, g * rest2, g)
        new_p[n] = torch.addcdiv(p, m, (v.sqrt() / bc2 + eps) / step_size)
    return new_p, state.replace(count=count, slots={"exp_avg": new_m, "exp_avg_sq": new_v})


def test_adam_in_an_inductor_cpu_graph_gives_the_per_tensor_bits() -> None:
    """Inductor lowers the CPU graph's ``_foreach`` calls to the expressions a loop over
    the tensors gives: compiled, the two forms give the same bits (tiny tensors)."""
    opt = optim.adamw(0.05, betas=(0.3, 0.99), weight_decay=0.1)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    params = {str(i): torch.randn(5, i + 2, generator=gen) for i in range(3)}
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    p1, s1 = torch.compile(opt.update, fullgraph=True)(
        params, grads, opt.init(params), torch.tensor(0)
    )
    p2, s2 = torch.compile(_adamw_per_tensor, fullgraph=True)(
        params, grads, opt.init(params), torch.tensor(0)
    )
    assert int(s1.count) == int(s2.count) == 1
    for n in params:
        assert torch.equal(p1[n], p2[n]), n
        for slot in s1.slots:
            assert torch.equal(s1.slots[slot][n], s2.slots[slot][n]), (slot, n)


def test_computed_once_gives_back_the_scalars_outside_a_cpu_graph() -> None:
    from fasttorch.optim._base import computed_once

    a, b = torch.tensor(0.5), torch.tensor(2.0, dtype=torch.float64)
    got = computed_once(a, b)
    assert got[0] is a and got[1] is b


def test_computed_once_keeps_values_and_dtypes_in_a_graph() -> None:
    from fasttorch.optim._base import computed_once

    def f(*xs: Tensor) -> tuple[Tensor, ...]:
        return computed_once(*(x * 3 for x in xs))

    xs = (
        torch.tensor(1 / 3),
        torch.tensor(0.1, dtype=torch.bfloat16),
        torch.tensor(1e-300, dtype=torch.float64),
    )
    traced = torch.compile(f, fullgraph=True, backend="aot_eager")
    for args in (xs, xs[:1]):
        got, want = traced(*args), f(*args)
        assert [g.dtype for g in got] == [w.dtype for w in want]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    for bad in (torch.ones(2), torch.tensor(1)):
        with pytest.raises(ValueError, match="0-d floating-point"):
            computed_once(bad)


def test_inductor_computes_a_shared_factor_once_when_asked() -> None:
    """The generated code holds the 0-d chain once, not once per tensor that reads it."""
    from torch._inductor.utils import run_and_get_code

    from fasttorch.optim._base import computed_once

    def scaled(once: bool) -> Callable[..., list[Tensor]]:
        def f(ts: list[Tensor], beta: Tensor, t: Tensor) -> list[Tensor]:
            c = (1 - beta ** t.to(torch.float64)).sqrt()
            if once:
                (c,) = computed_once(c)
            return [x / c for x in ts]

        return f

    args = (
        [torch.randn(37), torch.randn(5, 7), torch.randn(300)],
        torch.tensor(0.99),
        torch.tensor(3),
    )
    pows = {}
    for once in (True, False):
        out, code = run_and_get_code(torch.compile(scaled(once), fullgraph=True), *args)
        assert all(torch.equal(o, r) for o, r in zip(out, scaled(False)(*args)))
        pows[once] = "\n".join(code).count("std::pow")
    assert pows[True] == 1 and pows[False] >= 3, pows


# ----------------------------------------------------- torch twins, bit for bit
#
# Rule 1 (tests/README.md): each native optimizer runs the operations of one torch
# configuration in its order, so given the same values (the hyperparameters as the state
# holds them, float32) the two agree bit for bit, in every path: eager out of place, in
# place, in a CPU graph (aot_eager runs the graph's ATen operations) and, for Adam, the
# opaque operator. The twins: Adam(W) with ``foreach=True, capturable=True`` and a tensor
# lr; SGD with ``foreach=True`` and a tensor lr as torch.compile runs it (dampening 0).


TWIN_SHAPES = {"w": (8, 5), "b": (8,), "odd": (37, 33), "unused": (6, 4)}
""""odd": a length with a vector tail; "unused": a parameter whose gradient is always 0
(an embedding's rows no batch reads), so Adam's second moment stays 0."""

TWINS: dict[str, tuple[Callable[..., Any], str, dict[str, Any]]] = {
    "adam": (optim.adam, "Adam", {}),
    "adam_l2": (
        optim.adam,
        "Adam",
        {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    ),
    "adamw": (optim.adamw, "AdamW", {}),
    "adamw_wd": (optim.adamw, "AdamW", {"betas": (0.5, 0.9), "weight_decay": 0.3}),
    "sgd": (optim.sgd, "SGD", {}),
    "sgd_wd": (optim.sgd, "SGD", {"weight_decay": 0.1}),
    "sgd_momentum": (optim.sgd, "SGD", {"momentum": 0.9, "weight_decay": 0.01}),
    "sgd_nesterov": (optim.sgd, "SGD", {"momentum": 0.8, "nesterov": True, "weight_decay": 0.01}),
}


@pytest.fixture
def capturable_on_cpu() -> Iterator[None]:
    """torch's capturable Adam on CPU tensors, outside torch.compile (tests/reference.py)."""
    with allow_capturable_on_cpu():
        yield


def _twin(name: str, params: list[nn.Parameter], lr: float, mode: str) -> torch.optim.Optimizer:
    """The torch optimizer ``name``'s ``mode`` equals: torch's fused kernel for the fused
    path and the opaque one (torch's fused CPU kernel), else the foreach form above."""
    _, cls, kw = TWINS[name]
    if cls != "SGD":  # torch's defaults, which are fasttorch's, as Python floats
        kw = {"betas": (0.9, 0.999), "eps": 1e-8, **kw}
    hyper: dict[str, Any] = {
        k: (tuple(f32(b) for b in v) if k == "betas" else v if k == "nesterov" else f32(v))
        for k, v in kw.items()
    }
    lr_t = torch.tensor(lr, dtype=torch.float32)
    if cls == "AdamW" and "weight_decay" not in hyper:
        hyper["weight_decay"] = f32(1e-2)  # fasttorch's adamw default, torch's too
    if mode in ("fused", "opaque"):
        return getattr(torch.optim, cls)(params, lr=lr_t, fused=True, **hyper)
    if cls == "SGD":
        opt = torch.optim.SGD(params, lr=lr_t, foreach=True, **hyper)
        opt.step = torch.compile(opt.step, backend="aot_eager")  # type: ignore[method-assign]
        return opt
    return getattr(torch.optim, cls)(params, lr=lr_t, foreach=True, capturable=True, **hyper)


def _twin_grads(steps: int) -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        {
            n: torch.zeros(s) if n == "unused" else torch.randn(s, generator=gen)
            for n, s in TWIN_SHAPES.items()
        }
        for _ in range(steps)
    ]


def _native_update(opt: Any, mode: str) -> Callable[..., Any]:
    """``opt.update`` as ``mode`` runs it: out of place, in place, compiled (a CPU graph,
    out of place) or opaque (compiled in place: Adam's ``fasttorch::adam_fused_`` operator,
    torch's fused CPU kernel)."""
    if mode == "eager":
        return opt.update
    if mode in ("inplace", "fused"):  # fused: a donated eager step on a GPU
        return functools.partial(opt.update, inplace=True)
    torch._dynamo.reset()
    inplace = mode == "opaque"
    return torch.compile(  # type: ignore[no-any-return]
        functools.partial(opt.update, inplace=inplace), fullgraph=True, backend="aot_eager"
    )


def _assert_equal(got: Tensor, want: Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **EXACT, msg=lambda m: f"{what}: {m}")


def _run_twins(
    name: str, mode: str, lr: float | schedules.Schedule, steps: int = 6
) -> dict[str, Tensor]:
    """``steps`` updates of the native optimizer (``mode``) and its torch twin from the
    same start; params and slots compared bit for bit after every step. Returns the
    native params."""
    factory, cls, kw = TWINS[name]
    opt = factory(lr, **kw, opaque=mode == "opaque")
    gen = torch.Generator().manual_seed(4)
    start = {n: torch.randn(s, generator=gen) for n, s in TWIN_SHAPES.items()}
    ref = {n: nn.Parameter(t.clone()) for n, t in start.items()}
    at = (lambda k: float(lr(torch.tensor(k)))) if callable(lr) else (lambda k: lr)
    twin = _twin(name, list(ref.values()), at(0), mode)
    params = {n: t.clone() for n, t in start.items()}
    state = opt.init(params)
    update = _native_update(opt, mode)
    fused = frozenset({"cuda", "cpu"}) if mode == "fused" else _base.FUSED_DEVICES
    for k, grads in enumerate(_twin_grads(steps)):
        twin.param_groups[0]["lr"].fill_(at(k))
        for n, p in ref.items():
            p.grad = grads[n].clone()
        twin.step()
        with mock.patch.object(_base, "FUSED_DEVICES", fused):
            params, state = update(
                params, {n: g.clone() for n, g in grads.items()}, state, torch.tensor(k)
            )
        for n, p in ref.items():
            _assert_equal(params[n], p.detach(), f"{name} {mode} step {k} {n}")
            for slot, by_name in state.slots.items():
                _assert_equal(by_name[n], twin.state[p][slot], f"{name} {mode} step {k} {slot} {n}")
    return params


# Every path of every optimizer: "opaque" is the opaque operator, torch's fused CPU
# kernel; "fused" runs the donated eager GPU step's kernel (FUSED_DEVICES with "cpu"
# added); the twin of both is torch's fused=True.
PATHS = [
    (name, mode)
    for name in sorted(TWINS)
    for mode in ("eager", "inplace", "compiled", "opaque", "fused")
]


@pytest.mark.usefixtures("capturable_on_cpu")
@pytest.mark.parametrize(("name", "mode"), PATHS)
def test_native_optimizer_equals_its_torch_twin_bit_for_bit(name: str, mode: str) -> None:
    _run_twins(name, mode, 0.05)


@pytest.mark.usefixtures("capturable_on_cpu")
@pytest.mark.parametrize(("name", "mode"), PATHS)
def test_lr_zero_and_a_warmup_from_zero_give_no_nan(name: str, mode: str) -> None:
    """lr 0 (and a warmup that starts at 0) with a parameter whose gradient is always 0:
    Adam's step is m / (denom / (-lr / (1 - beta1^t))), whose denominator is -inf at
    lr 0, never 0/0. Twin-equal at every step; at lr 0 nothing moves, as in torch's
    eager loop (coupled decay enters the moments only, decoupled decay is 1 - 0 * wd)."""
    gen = torch.Generator().manual_seed(4)
    start = {n: torch.randn(s, generator=gen) for n, s in TWIN_SHAPES.items()}
    still = _run_twins(name, mode, 0.0, steps=3)
    for n, p in still.items():
        _assert_equal(p, start[n], f"{name} {mode} at lr 0: {n}")
    warm = _run_twins(name, mode, schedules.linear_warmup(0.05, 3), steps=5)
    assert all(bool(p.isfinite().all()) for p in warm.values())
    # torch's default (host-sync) loop at lr 0 leaves every parameter as it was too.
    factory, cls, kw = TWINS[name]
    ref = {n: nn.Parameter(t.clone()) for n, t in start.items()}
    default = getattr(torch.optim, cls)(list(ref.values()), lr=0.0, **kw)
    for grads in _twin_grads(3):
        for n, p in ref.items():
            p.grad = grads[n].clone()
        default.step()
    for n, p in ref.items():
        _assert_equal(p.detach(), start[n], f"torch.optim.{cls} at lr 0: {n}")


# "unfused": the opaque optimizer where torch's fused kernel does not apply (the CPU
# graph's own form then); "opaque" itself is torch's fused CPU kernel.
ALGORITHM_PATHS = [
    (n, "unfused" if m == "opaque" else m)
    for n, m in PATHS
    if n.startswith("adam") and m != "fused"
]


@pytest.mark.parametrize(("name", "mode"), ALGORITHM_PATHS)
@pytest.mark.parametrize("lr", [0.05, 0.0])
def test_every_adam_kernel_computes_the_readable_algorithm_s_bits(
    name: str, mode: str, lr: float
) -> None:
    """adam.py's adam_math is the algorithm, one parameter at a time; every kernel
    _adam_kernels.update chooses for it (foreach on copies or in place, the CPU graph,
    an opaque optimizer's where torch's fused kernel does not apply) gives
    its bits, step for step (EXACT: the same operations on the same values). torch's
    fused kernel, a donated eager GPU step's and an opaque optimizer's donated CPU
    step's, is torch's fused form, with its own roundings: its twin is torch's
    fused=True (above)."""
    factory, _, kw = TWINS[name]
    opt = factory(lr, **kw, opaque=mode == "unfused")
    gen = torch.Generator().manual_seed(4)
    params = {n: torch.randn(s, generator=gen) for n, s in TWIN_SHAPES.items()}
    state = opt.init(params)
    p_ref = {n: t.clone() for n, t in params.items()}
    m_ref = {n: torch.zeros_like(t) for n, t in params.items()}
    v_ref = {n: torch.zeros_like(t) for n, t in params.items()}
    update = _native_update(opt, "opaque" if mode == "unfused" else mode)
    no_kernel = (
        mock.patch.object(_base._compat, "fused_optimizer_kernel", lambda name: None)
        if mode == "unfused"
        else contextlib.nullcontext()
    )
    for k, grads in enumerate(_twin_grads(4)):
        count = torch.tensor(k + 1)
        for n in params:
            p_ref[n], m_ref[n], v_ref[n] = adam_math(
                p_ref[n],
                grads[n],
                m_ref[n],
                v_ref[n],
                state.hyper["lr"],
                count,
                state.hyper,
                decoupled=opt.decoupled_weight_decay,
            )
        with no_kernel:
            params, state = update(
                params, {n: g.clone() for n, g in grads.items()}, state, torch.tensor(k)
            )
        assert int(state.count) == k + 1
        for n in params:
            _assert_equal(params[n], p_ref[n], f"{name} {mode} step {k} {n}")
            _assert_equal(state.slots["exp_avg"][n], m_ref[n], f"{name} {mode} m {k} {n}")
            _assert_equal(state.slots["exp_avg_sq"][n], v_ref[n], f"{name} {mode} v {k} {n}")


SGD_ALGORITHM_PATHS = [
    (n, m) for n, m in PATHS if n.startswith("sgd") and m not in ("fused", "opaque")
]


@pytest.mark.parametrize(("name", "mode"), SGD_ALGORITHM_PATHS)
def test_every_sgd_kernel_computes_the_readable_algorithm_s_bits(name: str, mode: str) -> None:
    """sgd.py's sgd_math is the algorithm, one parameter at a time; the foreach kernel
    _sgd_kernels.update chooses for it, on copies, in place or in a CPU graph, gives its
    bits step for step (EXACT: the same operations on the same values)."""
    factory, _, kw = TWINS[name]
    opt = factory(0.05, **kw, opaque=False)
    gen = torch.Generator().manual_seed(4)
    params = {n: torch.randn(s, generator=gen) for n, s in TWIN_SHAPES.items()}
    state = opt.init(params)
    momentum = "momentum_buffer" in state.slots
    p_ref = {n: t.clone() for n, t in params.items()}
    b_ref = {n: torch.zeros_like(t) if momentum else None for n, t in params.items()}
    update = _native_update(opt, mode)
    for k, grads in enumerate(_twin_grads(4)):
        for n in params:
            p_ref[n], b_ref[n] = sgd_math(
                p_ref[n],
                grads[n],
                b_ref[n],
                state.hyper["lr"],
                state.count,
                state.hyper,
                nesterov=opt.nesterov,
            )
        params, state = update(
            params, {n: g.clone() for n, g in grads.items()}, state, torch.tensor(k)
        )
        for n in params:
            _assert_equal(params[n], p_ref[n], f"{name} {mode} step {k} {n}")
            if momentum:
                buf = state.slots["momentum_buffer"][n]
                _assert_equal(buf, b_ref[n], f"{name} {mode} buffer {k} {n}")
