"""fasttorch.schedules.timm_cosine against timm's CosineLRScheduler, at every update.

timm is not a dependency, so the oracle is its formula transcribed by hand from
huggingface/pytorch-image-models at commit aa4b5850c1543fa488abf260f18390eda46cf85d
(timm/scheduler/cosine_lr.py, ``CosineLRScheduler._get_lr``, and timm/scheduler/
scheduler.py, ``Scheduler.step``/``step_update``; both last changed in 31a85de79aad),
driven as timm's train.py drives it: the rate set at construction for the first
update, then ``step_update(num_updates)`` after every update (``t_in_epochs=False``)
or ``step(epoch + 1)`` after every epoch (``t_in_epochs=True``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tolerance import gamma

from fasttorch import schedules

# Both sides run the same float64 operations in the same order (timm's in Python floats).
# cos, pow and log are not correctly rounded: Python's libm and torch's kernels are each
# within one ulp (2u) of the exact value, so within 4u of each other, and each of the at
# most OPS operations after them may round the difference by one more u. Every quantity
# from there on is at most twice the peak (1 + cos <= 2, cycle_decay <= 1 here):
# gamma(4 + OPS) * 2 * peak in float64.
OPS = 8


def libm_atol(peak: float) -> float:
    return gamma(4 + OPS, torch.float64) * 2 * peak


def timm_get_lr(
    t: int,
    base: float,
    t_initial: int,
    lr_min: float = 0.0,
    cycle_mul: float = 1.0,
    cycle_decay: float = 1.0,
    cycle_limit: int = 1,
    warmup_t: int = 0,
    warmup_lr_init: float = 0.0,
    warmup_prefix: bool = False,
    k_decay: float = 1.0,
) -> float:
    """The rate timm's CosineLRScheduler sets for ``t`` (one parameter group, no noise)."""
    if t < warmup_t:
        return warmup_lr_init + t * ((base - warmup_lr_init) / warmup_t)
    if warmup_prefix:
        t -= warmup_t
    if cycle_mul != 1:
        cycle = math.floor(math.log(1 - t / t_initial * (1 - cycle_mul), cycle_mul))
        length: float = cycle_mul**cycle * t_initial
        into: float = t - (1 - cycle_mul**cycle) / (1 - cycle_mul) * t_initial
    else:
        cycle, into = divmod(t, t_initial)
        length = t_initial
    if cycle >= cycle_limit:
        return lr_min
    top = base * cycle_decay**cycle
    return lr_min + 0.5 * (top - lr_min) * (1 + math.cos(math.pi * into**k_decay / length**k_decay))


def timm_train_lrs(
    updates: int, *, steps_per_epoch: int | None = None, **kwargs: Any
) -> list[float]:
    """The rate of each update in timm's train.py loop: per update when
    ``steps_per_epoch`` is None (``t_in_epochs=False``), else per epoch."""
    base = kwargs["base"]
    # Scheduler.__init__ sets the base rate, CosineLRScheduler.__init__ then warmup_lr_init.
    lr = kwargs.get("warmup_lr_init", 0.0) if kwargs.get("warmup_t", 0) else base
    out = []
    for n in range(updates):
        out.append(lr)
        done = n + 1
        if steps_per_epoch is None:  # step_update(num_updates) after each update
            lr = timm_get_lr(done, **kwargs)
        elif done % steps_per_epoch == 0:  # step(epoch + 1) at the end of each epoch
            lr = timm_get_lr(done // steps_per_epoch, **kwargs)
    return out


CASES = [
    # timm's train.py defaults for a 100-update run with warm-up, and warmup_prefix
    dict(base=0.1, t_initial=100, lr_min=1e-5, warmup_t=10, warmup_lr_init=1e-4),
    dict(
        base=0.1, t_initial=100, lr_min=1e-5, warmup_t=10, warmup_lr_init=1e-4, warmup_prefix=True
    ),
    dict(base=5e-4, t_initial=40),
    # restarts: decaying tops, a cycle limit, then lr_min
    dict(base=1.0, t_initial=20, lr_min=0.01, cycle_decay=0.5, cycle_limit=3, warmup_t=5),
    # cycles doubling in length: boundaries at 10, 30 and 70 are exact powers in the log
    dict(base=1.0, t_initial=10, cycle_mul=2.0, cycle_limit=3, cycle_decay=0.8),
    dict(
        base=0.3,
        t_initial=8,
        cycle_mul=1.5,
        cycle_limit=4,
        k_decay=2.0,
        warmup_t=3,
        warmup_lr_init=0.01,
    ),
    dict(base=1.0, t_initial=30, k_decay=0.5, lr_min=0.1, cycle_limit=2),
    # shrinking cycles: timm's log has no value from t = 32 on (its train loop asks for
    # the rate after the last update), so run 31 updates
    dict(base=1.0, t_initial=16, cycle_mul=0.5, cycle_limit=4),
]


def _ours(schedule: schedules.Schedule, steps: int) -> list[float]:
    out = []
    for k in range(steps):
        lr = schedule(torch.tensor(k))
        assert lr.dtype == torch.float64 and lr.shape == ()
        out.append(float(lr))
    return out


def _build(case: dict[str, Any]) -> schedules.TimmCosine:
    kwargs = dict(case)
    return schedules.timm_cosine(kwargs.pop("base"), kwargs.pop("t_initial"), **kwargs)


def _assert_close(ours: list[float], ref: list[float], peak: float) -> None:
    atol = libm_atol(peak)
    bad = [(k, a, b) for k, (a, b) in enumerate(zip(ours, ref)) if abs(a - b) > atol]
    assert not bad, (atol, bad[:5])


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_timm_cosine_matches_timm_per_update(case: dict[str, Any]) -> None:
    updates = 31 if case.get("cycle_mul", 1.0) < 1 else 130
    ref = timm_train_lrs(updates, **case)
    _assert_close(_ours(_build(case), updates), ref, case["base"])


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]], ids=[0, 3, 5])
def test_timm_cosine_per_epoch_matches_t_in_epochs(case: dict[str, Any]) -> None:
    # t_in_epochs=True: t_initial and warmup_t are epochs; the rate changes per epoch only.
    steps_per_epoch = 7
    updates = 40 * steps_per_epoch
    ref = timm_train_lrs(updates, steps_per_epoch=steps_per_epoch, **case)
    ours = _ours(schedules.per_epoch(_build(case), steps_per_epoch), updates)
    _assert_close(ours, ref, case["base"])


def test_the_warmup_runs_under_the_unshifted_cosine() -> None:
    # What sets timm's schedule apart from fasttorch.schedules.warmup (which starts the
    # cosine at the end of the warm-up): at t = warmup_t the cosine is already warmup_t in.
    s = schedules.timm_cosine(1.0, 20, warmup_t=5)
    shifted = schedules.timm_cosine(1.0, 20, warmup_t=5, warmup_prefix=True)
    five = torch.tensor(5)
    assert math.isclose(
        float(s(five)), (1 + math.cos(math.pi * 5 / 20)) / 2, abs_tol=libm_atol(1.0)
    )
    assert float(shifted(five)) == 1.0  # cos(0): the start of the cosine
    fasttorch_warmup = schedules.warmup(5, schedules.cosine(1.0, 20))
    _assert_close(_ours(shifted, 25), _ours(fasttorch_warmup, 25), 1.0)


def test_shrinking_cycles_end_at_lr_min() -> None:
    # cycle_mul < 1: the cycles sum to t_initial / (1 - cycle_mul) = 32 steps, where
    # timm's math.log raises; the schedule is lr_min from there.
    s = schedules.timm_cosine(1.0, 16, cycle_mul=0.5, cycle_limit=100, lr_min=0.25)
    assert [float(s(torch.tensor(k))) for k in (32, 33, 1000)] == [0.25] * 3


@pytest.mark.parametrize(
    ("build", "error", "words"),
    [
        (lambda: schedules.timm_cosine(1.0, 0), ValueError, ["t_initial", "positive int"]),
        (
            lambda: schedules.timm_cosine(1.0, 10, cycle_mul=0.0),
            ValueError,
            ["cycle_mul=0.0", "> 0"],
        ),
        (lambda: schedules.timm_cosine(1.0, 10, warmup_t=-1), ValueError, ["warmup_t", "-1"]),
        (lambda: schedules.timm_cosine(1.0, 10, cycle_limit=0), ValueError, ["cycle_limit"]),
        (lambda: schedules.timm_cosine(1.0, 10, k_decay=0.0), ValueError, ["k_decay"]),
        (lambda: schedules.timm_cosine(1.0, 10, lr_min=-1.0), ValueError, ["lr_min=-1.0"]),
        (lambda: schedules.timm_cosine(1.0, 10, warmup_prefix=1), TypeError, ["warmup_prefix"]),  # type: ignore[arg-type]
    ],
)
def test_timm_cosine_bad_arguments(build: Any, error: type, words: list[str]) -> None:
    with pytest.raises(error) as info:
        build()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
