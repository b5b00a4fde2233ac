"""fasttorch.schedules against torch.optim.lr_scheduler, step by step."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
from tolerance import unit_roundoff

from fasttorch import schedules

# The optimizer reads the lr as a float32 (OptState.hyper): two float64 schedules that
# agree within one float32 rounding (the dtype's epsilon, tests/README.md) train alike.
# torch's recursive schedulers and the closed forms here both round far less, in float64.
TOL = unit_roundoff(torch.float32)


def _torch_lrs(
    base_lr: float,
    make: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler],
    steps: int,
) -> list[float]:
    """The lr torch's scheduler gives the k-th opt.step(), for k in range(steps)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = make(opt)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return lrs


def _ours(schedule: schedules.Schedule, steps: int) -> list[float]:
    out = []
    for k in range(steps):
        lr = schedule(torch.tensor(k))
        assert lr.dtype == torch.float64 and lr.shape == ()
        out.append(float(lr))
    return out


def _assert_close(ours: list[float], ref: list[float]) -> None:
    assert len(ours) == len(ref)
    for k, (a, b) in enumerate(zip(ours, ref)):
        assert math.isclose(a, b, rel_tol=TOL, abs_tol=0.0), (k, a, b)


def test_constant() -> None:
    _assert_close(_ours(schedules.constant(0.3), 10), [0.3] * 10)


def test_linear_warmup_matches_linear_lr() -> None:
    ref = _torch_lrs(
        0.5, lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=8), 20
    )
    _assert_close(_ours(schedules.linear_warmup(0.5, 8, init=0.05), 20), ref)


def test_linear_warmup_from_zero() -> None:
    _assert_close(_ours(schedules.linear_warmup(2.0, 4), 7), [0.0, 0.5, 1.0, 1.5, 2.0, 2.0, 2.0])


def test_cosine_matches_cosine_annealing() -> None:
    ref = _torch_lrs(
        0.5, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=15, eta_min=0.01), 16
    )
    ours = _ours(schedules.cosine(0.5, 15, end=0.01), 25)
    _assert_close(ours[:16], ref)
    _assert_close(ours[16:], [0.01] * 9)  # torch rises again after T_max; this one stays


@pytest.mark.parametrize(
    ("total", "pct", "div", "final"),
    [(100, 0.3, 25.0, 1e4), (37, 0.25, 10.0, 100.0), (10, 0.5, 5.0, 2.0)],
)
def test_one_cycle_matches_one_cycle_lr(total: int, pct: float, div: float, final: float) -> None:
    ref = _torch_lrs(
        0.1,
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o,
            max_lr=0.4,
            total_steps=total,
            pct_start=pct,
            div_factor=div,
            final_div_factor=final,
            cycle_momentum=False,
        ),
        total,
    )
    ours = _ours(
        schedules.one_cycle(0.4, total, pct_start=pct, div_factor=div, final_div_factor=final),
        total + 5,
    )
    _assert_close(ours[:total], ref)
    _assert_close(ours[total:], [ref[-1]] * 5)


def test_step_decay_matches_step_lr() -> None:
    ref = _torch_lrs(0.3, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 30)
    _assert_close(_ours(schedules.step_decay(0.3, 3, gamma=0.5), 30), ref)


def test_warmup_matches_sequential_lr() -> None:
    def make(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        lin = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=5)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.001)
        return torch.optim.lr_scheduler.SequentialLR(o, [lin, cos], milestones=[5])

    ref = _torch_lrs(0.5, make, 25)
    ours = _ours(schedules.warmup(5, schedules.cosine(0.5, 20, end=0.001), init=0.1), 25)
    _assert_close(ours, ref)


def test_warmup_formula() -> None:
    then = schedules.step_decay(1.0, 2, gamma=0.5)
    expected = [0.2 + (1.0 - 0.2) * k / 4 for k in range(4)] + [1.0, 1.0, 0.5, 0.5, 0.25]
    _assert_close(_ours(schedules.warmup(4, then, init=0.2), 9), expected)


def test_schedules_compile_once() -> None:
    sched = schedules.warmup(3, schedules.one_cycle(1.0, 20), init=0.01)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(sched, fullgraph=True, backend="aot_eager")
    for k in range(30):
        step = torch.tensor(k)
        # Rule 1: aot_eager runs the eager schedule's operations, in the same order.
        assert float(compiled(step)) == float(sched(step))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: schedules.linear_warmup(1.0, 0), ["warmup_steps", "positive int", "0"]),
        (lambda: schedules.cosine(1.0, 2.5), ["decay_steps", "2.5"]),  # type: ignore[arg-type]
        (lambda: schedules.cosine(float("nan"), 3), ["peak", "finite"]),
        (lambda: schedules.one_cycle(-1.0, 10), ["max_lr=-1.0", ">= 0"]),
        (
            lambda: schedules.one_cycle(1.0, 10, pct_start=0.05),
            ["pct_start", "between 1 and total_steps"],
        ),
        (lambda: schedules.one_cycle(1.0, 10, div_factor=0.0), ["div_factor", "> 0"]),
        (lambda: schedules.step_decay(1.0, 0), ["step_size"]),
        (lambda: schedules.step_decay(1.0, 2, gamma=-0.5), ["gamma=-0.5"]),
        (lambda: schedules.warmup(0, schedules.constant(1.0)), ["warmup_steps"]),
    ],
)
def test_bad_arguments(build: Callable[[], object], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        build()
    for word in words:
        assert word in str(info.value)


def test_warmup_then_must_be_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        schedules.warmup(3, 0.5)  # type: ignore[arg-type]


def _one_step(lr, *, compile_it=False):
    from reference import LayerNormNet, batches, mse

    import fasttorch

    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(lr))
    step = fasttorch.step(mse)
    if compile_it:
        step = fasttorch.compiled(step, backend="aot_eager")
    return step(state, batches(1, 8)[0])


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
def test_a_schedule_returning_a_python_float_is_accepted(compile_it):
    new, metrics = _one_step(lambda step: 0.1, compile_it=compile_it)
    _, expected = _one_step(schedules.constant(0.1))
    assert int(new.step) == 1
    assert metrics["lr"].dtype == expected["lr"].dtype
    assert float(metrics["lr"]) == float(expected["lr"])


@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        (lambda step: 0.1 if step < 10 else 0.01, r"reads the step's value .*torch.where"),
        (lambda step: 0.1 * 0.5 ** int(step), r"reads the step's value"),
        (lambda step: None, r"lr must be a float, got None"),
        (lambda step: -0.1, r"invalid lr=-0.1; valid values are finite and satisfy lr >= 0"),
        (lambda step: torch.ones(2), r"tensor of shape \(2,\)"),
    ],
)
def test_a_schedule_that_cannot_run_in_a_step_is_refused_when_the_optimizer_is_built(
    schedule, words
):
    import fasttorch

    for build in (fasttorch.optim.sgd, fasttorch.optim.adamw):
        with pytest.raises((TypeError, ValueError), match=words):
            build(schedule)
    with pytest.raises((TypeError, ValueError), match=words):
        fasttorch.optim.from_torch(torch.optim.Adam, schedule)


def _torch_lrs_per_epoch(
    base_lr: float,
    make: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler],
    epochs: int,
    steps_per_epoch: int,
) -> list[float]:
    """The lr of every update when the scheduler is stepped once per epoch."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = make(opt)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs):
            for _ in range(steps_per_epoch):
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
            sched.step()
    return lrs


@pytest.mark.parametrize(
    ("warmup_method", "lr_min", "steps_per_epoch"),
    [("linear", 0.0, 5), ("linear", 1e-4, 3), ("constant", 0.0, 4)],
)
def test_per_epoch_sequential_matches_torchvision_reference(
    warmup_method: str, lr_min: float, steps_per_epoch: int
) -> None:
    # torchvision's references/classification/train.py with --lr-warmup-method
    # linear|constant --lr-warmup-epochs 3 --lr-warmup-decay 0.01 --lr-scheduler
    # cosineannealinglr: SequentialLR stepped once per epoch.
    lr, epochs, warm, decay = 0.5, 14, 3, 0.01

    def make(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        main = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=epochs - warm, eta_min=lr_min)
        if warmup_method == "linear":
            first: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.LinearLR(
                o, start_factor=decay, total_iters=warm
            )
        else:
            first = torch.optim.lr_scheduler.ConstantLR(o, factor=decay, total_iters=warm)
        return torch.optim.lr_scheduler.SequentialLR(o, [first, main], milestones=[warm])

    ref = _torch_lrs_per_epoch(lr, make, epochs, steps_per_epoch)
    if warmup_method == "linear":
        head: schedules.Schedule = schedules.linear_warmup(lr, warm, init=decay * lr)
    else:
        head = schedules.constant(decay * lr)
    ours = schedules.per_epoch(
        schedules.sequential([head, schedules.cosine(lr, epochs - warm, end=lr_min)], [warm]),
        steps_per_epoch,
    )
    _assert_close(_ours(ours, epochs * steps_per_epoch), ref)


def test_per_epoch_matches_a_scheduler_stepped_per_epoch() -> None:
    ref = _torch_lrs_per_epoch(
        0.3, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), 9, 7
    )
    _assert_close(_ours(schedules.per_epoch(schedules.step_decay(0.3, 2, gamma=0.5), 7), 63), ref)


def test_sequential_of_three_matches_sequential_lr() -> None:
    def make(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        lin = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.01)
        step = torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
        return torch.optim.lr_scheduler.SequentialLR(o, [lin, cos, step], milestones=[4, 14])

    ref = _torch_lrs(0.5, make, 30)
    ours = schedules.sequential(
        [
            schedules.linear_warmup(0.5, 4, init=0.05),
            schedules.cosine(0.5, 10, end=0.01),
            schedules.step_decay(0.5, 3, gamma=0.5),
        ],
        milestones=[4, 14],
    )
    _assert_close(_ours(ours, 30), ref)


def test_sequential_of_one_is_that_schedule() -> None:
    # Rule 1: the same schedule's operations on the same step.
    s = schedules.cosine(1.0, 5)
    assert _ours(schedules.sequential([s], []), 8) == _ours(s, 8)


def test_warmup_is_a_sequential_with_a_linear_ramp_to_then_0() -> None:
    then = schedules.cosine(0.5, 20, end=0.001)
    a = schedules.warmup(5, then, init=0.1)
    b = schedules.sequential([schedules.linear_warmup(0.5, 5, init=0.1), then], [5])
    _assert_close(_ours(a, 30), _ours(b, 30))


@pytest.mark.parametrize(
    ("build", "error", "words"),
    [
        (lambda: schedules.per_epoch(schedules.constant(1.0), 0), ValueError, ["steps_per_epoch"]),
        (lambda: schedules.per_epoch(0.1, 3), TypeError, ["callable"]),
        (lambda: schedules.sequential([], []), ValueError, ["at least one"]),
        (lambda: schedules.sequential(schedules.constant(1.0), []), TypeError, ["a list"]),
        (
            lambda: schedules.sequential([schedules.constant(1.0), 0.5], [3]),
            TypeError,
            ["schedules[1]", "0.5"],
        ),
        (
            lambda: schedules.sequential([schedules.constant(1.0)] * 2, []),
            ValueError,
            ["2 schedules need 1 milestones", "[]"],
        ),
        (
            lambda: schedules.sequential([schedules.constant(1.0)] * 3, [5, 5]),
            ValueError,
            ["increase strictly", "[5, 5]"],
        ),
        (
            lambda: schedules.sequential([schedules.constant(1.0)] * 2, [0]),
            ValueError,
            ["milestones[0]", "0"],
        ),
        (
            lambda: schedules.sequential([schedules.constant(1.0)] * 2, [2.5]),
            TypeError,
            ["milestones[0]", "2.5"],
        ),
    ],
)
def test_combinator_bad_arguments(
    build: Callable[[], object], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        build()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


NEW_SCHEDULES = {
    "hf_linear": lambda: schedules.hf("linear", 0.1, warmup_steps=5, total_steps=30),
    "hf_cosine": lambda: schedules.hf("cosine", 0.1, warmup_steps=5, total_steps=30),
    "hf_cosine_with_restarts": lambda: schedules.hf(
        "cosine_with_restarts", 0.1, warmup_steps=5, total_steps=30, num_cycles=3
    ),
    "hf_polynomial": lambda: schedules.hf(
        "polynomial", 0.1, warmup_steps=5, total_steps=30, power=2.0
    ),
    "hf_constant_with_warmup": lambda: schedules.hf("constant_with_warmup", 0.1, warmup_steps=5),
    "hf_inverse_sqrt": lambda: schedules.hf("inverse_sqrt", 0.1, warmup_steps=5, timescale=3),
    "hf_wsd": lambda: schedules.hf(
        "warmup_stable_decay",
        0.1,
        warmup_steps=5,
        total_steps=30,
        num_decay_steps=10,
        warmup_type="1-sqrt",
        min_lr_ratio=0.1,
    ),
    "hf_cosine_warmup_with_min_lr": lambda: schedules.hf(
        "cosine_warmup_with_min_lr", 0.1, warmup_steps=5, total_steps=30, min_lr_rate=0.1
    ),
    "timm_cosine": lambda: schedules.timm_cosine(
        0.1, 10, cycle_mul=2.0, cycle_limit=3, cycle_decay=0.5, warmup_t=3, k_decay=1.5
    ),
    "timm_cosine_restarts": lambda: schedules.timm_cosine(
        0.1, 10, cycle_limit=2, warmup_t=3, warmup_prefix=True
    ),
    "per_epoch_sequential": lambda: schedules.per_epoch(
        schedules.sequential(
            [schedules.linear_warmup(0.1, 2, init=0.001), schedules.cosine(0.1, 5)], [2]
        ),
        4,
    ),
}


@pytest.mark.parametrize("name", sorted(NEW_SCHEDULES))
def test_new_schedules_compile_once_and_equal_eager(name: str) -> None:
    sched = NEW_SCHEDULES[name]()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(sched, fullgraph=True, backend="aot_eager")
    for k in range(45):
        step = torch.tensor(k)
        # Rule 1: aot_eager runs the eager schedule's operations, in the same order.
        assert float(compiled(step)) == float(sched(step)), k
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("name", ["hf_wsd", "timm_cosine", "per_epoch_sequential"])
def test_new_schedules_drive_a_compiled_step_without_recompiling(name: str) -> None:
    from reference import LayerNormNet, batches, mse

    import fasttorch

    sched = NEW_SCHEDULES[name]()
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(sched))
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    data = batches(1, 8)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(12):
            state, metrics = step(state, data)
            # Rule 1: the step evaluates the same schedule on the same step, then casts.
            assert torch.equal(metrics["lr"], sched(torch.tensor(k)).to(metrics["lr"].dtype)), k
    assert not [w for w in caught if issubclass(w.category, fasttorch.RecompileWarning)]
