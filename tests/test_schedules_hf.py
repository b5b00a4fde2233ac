"""fasttorch.schedules.hf against transformers.get_scheduler, at every step."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from tolerance import gamma

from fasttorch import schedules

transformers = pytest.importorskip("transformers")

# Both sides run the same float64 operations in the same order (Hugging Face's in Python
# floats, ours as 0-d torch tensors). +, -, *, / are correctly rounded by IEEE 754 on any
# machine, so a formula made of them alone agrees bit for bit (rule 1, EXACT). cos, sqrt
# and pow are not: Python's libm and torch's vectorized kernels are each within one ulp
# (2u) of the exact value, so within 4u of each other, and each of the at most OPS
# operations after them (1 + c, halving, the min-lr blend, the max with 0, the product
# with the peak) may round the difference by one more u. Every quantity from there on is
# at most twice the peak (1 + cos <= 2), hence gamma(4 + OPS) * 2 * peak in float64.
OPS = 8


def libm_atol(peak: float) -> float:
    return gamma(4 + OPS, torch.float64) * 2 * peak


def _hf_lrs(name: str, peak: float, steps: int, **kwargs: Any) -> list[float]:
    """``param_groups[0]["lr"]`` before each ``opt.step()`` of a real optimizer under the
    ``LambdaLR`` that ``transformers.get_scheduler`` builds."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = transformers.get_scheduler(name, opt, **kwargs)
        lrs = []
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


# (name, peak, warmup, total, scheduler_specific_kwargs, libm: whether cos/sqrt/pow run)
CASES = [
    ("linear", 3e-4, 7, 50, {}, False),
    ("linear", 1.0, 0, 13, {}, False),
    ("linear", 0.1, 13, 13, {}, False),
    ("cosine", 3e-4, 7, 50, {}, True),
    ("cosine", 2e-3, 0, 33, {"num_cycles": 1.7}, True),
    ("cosine", 1.0, 10, 11, {"num_cycles": 0.25}, True),
    ("cosine_with_restarts", 3e-4, 5, 50, {"num_cycles": 3}, True),
    ("cosine_with_restarts", 1e-2, 0, 40, {}, True),
    ("cosine_with_restarts", 1.0, 4, 31, {"num_cycles": 2.5}, True),
    ("polynomial", 3e-4, 5, 50, {}, False),  # power 1: pow(x, 1) is x
    ("polynomial", 3e-4, 5, 50, {"power": 2.0, "lr_end": 1e-5}, True),
    ("polynomial", 0.5, 0, 21, {"power": 0.7, "lr_end": 0.0}, True),
    ("constant", 3e-4, None, None, {}, False),
    ("constant_with_warmup", 3e-4, 9, None, {}, False),
    ("constant_with_warmup", 1.0, 0, None, {}, False),
    ("inverse_sqrt", 3e-4, 9, None, {}, True),
    ("inverse_sqrt", 1.0, 9, None, {"timescale": 4}, True),
    ("inverse_sqrt", 1.0, 0, None, {"timescale": 7}, True),
    (
        "warmup_stable_decay",
        3e-4,
        6,
        50,
        {
            "num_decay_steps": 20,
            "warmup_type": "cosine",
            "decay_type": "1-sqrt",
            "min_lr_ratio": 0.1,
        },
        True,
    ),
    (
        "warmup_stable_decay",
        1.0,
        6,
        None,
        {"num_decay_steps": 20, "num_stable_steps": 7, "warmup_type": "1-sqrt", "num_cycles": 0.3},
        True,
    ),
    (
        "warmup_stable_decay",
        0.5,
        3,
        30,
        {"num_decay_steps": 9, "warmup_type": "linear", "decay_type": "linear"},
        False,
    ),
    (
        "warmup_stable_decay",
        0.5,
        0,
        None,
        {"num_decay_steps": 9, "num_stable_steps": 0, "decay_type": "cosine", "min_lr_ratio": 0.2},
        True,
    ),
    ("cosine_with_min_lr", 3e-4, 6, 40, {"min_lr": 1e-5}, True),
    ("cosine_with_min_lr", 1.0, 0, 40, {"min_lr_rate": 0.1, "num_cycles": 0.75}, True),
    ("cosine_warmup_with_min_lr", 3e-4, 6, 40, {"min_lr_rate": 0.05}, True),
    ("cosine_warmup_with_min_lr", 1.0, 6, 40, {"min_lr_rate": 0.0, "warmup_lr_rate": 0.2}, True),
]


@pytest.mark.parametrize(
    ("name", "peak", "warmup", "total", "kwargs", "libm"),
    CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)],
)
def test_hf_matches_get_scheduler_at_every_step(
    name: str, peak: float, warmup: int | None, total: int | None, kwargs: dict, libm: bool
) -> None:
    # Past num_training_steps too: Hugging Face's values there are part of the schedule.
    steps = (total or 40) + 15
    ref = _hf_lrs(
        name,
        peak,
        steps,
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs=dict(kwargs),
    )
    ours = _ours(schedules.hf(name, peak, warmup_steps=warmup, total_steps=total, **kwargs), steps)
    if libm:
        atol = libm_atol(peak)
        bad = [(k, a, b) for k, (a, b) in enumerate(zip(ours, ref)) if abs(a - b) > atol]
        assert not bad, (atol, bad[:5])
    else:  # rule 1: only correctly rounded operations run, in the same order
        bad = [(k, a, b) for k, (a, b) in enumerate(zip(ours, ref)) if a != b]
        assert not bad, bad[:5]


def test_hf_accepts_a_scheduler_type() -> None:
    kind = transformers.SchedulerType("cosine")
    assert schedules.hf(kind, 1.0, warmup_steps=2, total_steps=9) == schedules.HFCosine(1.0, 2, 9)


def test_hf_covers_every_step_driven_scheduler_type() -> None:
    # Every SchedulerType of the installed transformers is built here, or refused with a
    # reason (the metric-driven ones); a new type makes this fail until it is added.
    for kind in transformers.SchedulerType:
        if kind.value in ("reduce_lr_on_plateau", "greedy"):
            with pytest.raises(ValueError, match="metric measured in the loop"):
                schedules.hf(kind.value, 1.0)
            continue
        kwargs: dict[str, Any] = {
            "warmup_stable_decay": {"num_decay_steps": 3},
            "cosine_with_min_lr": {"min_lr_rate": 0.1},
            "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
        }.get(kind.value, {})
        warmup = None if kind.value == "constant" else 2
        s = schedules.hf(kind.value, 1.0, warmup_steps=warmup, total_steps=10, **kwargs)
        assert callable(s), kind


@pytest.mark.parametrize(
    ("build", "error", "words"),
    [
        (
            lambda: schedules.hf("cosin", 1.0),
            ValueError,
            ["unknown scheduler type 'cosin'", "cosine"],
        ),
        (
            lambda: schedules.hf("linear", 1.0, total_steps=10),
            ValueError,
            ["warmup_steps=", "num_warmup_steps"],
        ),
        (
            lambda: schedules.hf("cosine", 1.0, warmup_steps=2),
            ValueError,
            ["total_steps=", "num_training_steps"],
        ),
        (
            lambda: schedules.hf("linear", 1.0, warmup_steps=2, total_steps=9, num_cycles=2),
            TypeError,
            ["unexpected", "num_cycles", "none"],
        ),
        (
            lambda: schedules.hf("cosine", 1.0, warmup_steps=2, total_steps=9, power=2),
            TypeError,
            ["power", "num_cycles"],
        ),
        (
            lambda: schedules.hf("linear", 1.0, warmup_steps=12, total_steps=9),
            ValueError,
            ["warmup_steps=12", "total_steps=9"],
        ),
        (
            lambda: schedules.hf("linear", 1.0, warmup_steps=-1, total_steps=9),
            ValueError,
            ["warmup_steps", "-1"],
        ),
        (
            lambda: schedules.hf("linear", 1.0, warmup_steps=2.5, total_steps=9),
            TypeError,
            ["warmup_steps", "2.5"],
        ),
        (
            lambda: schedules.hf("linear", -1.0, warmup_steps=2, total_steps=9),
            ValueError,
            ["peak=-1.0", ">= 0"],
        ),
        (
            lambda: schedules.hf("polynomial", 1e-3, warmup_steps=2, total_steps=9, lr_end=1e-2),
            ValueError,
            ["lr_end=0.01", "smaller than peak"],
        ),
        (
            lambda: schedules.hf("polynomial", 1.0, warmup_steps=9, total_steps=9),
            ValueError,
            ["at least one step"],
        ),
        (
            lambda: schedules.hf("constant", 1.0, warmup_steps=5),
            ValueError,
            ["no warm-up", "constant_with_warmup"],
        ),
        (
            lambda: schedules.hf("inverse_sqrt", 1.0, warmup_steps=2, timescale=0),
            ValueError,
            ["timescale"],
        ),
        (
            lambda: schedules.hf("warmup_stable_decay", 1.0, warmup_steps=2, total_steps=9),
            ValueError,
            ["num_decay_steps"],
        ),
        (
            lambda: schedules.hf("warmup_stable_decay", 1.0, warmup_steps=2, num_decay_steps=3),
            ValueError,
            ["total_steps=", "num_stable_steps"],
        ),
        (
            lambda: schedules.hf(
                "warmup_stable_decay", 1.0, warmup_steps=5, total_steps=7, num_decay_steps=3
            ),
            ValueError,
            ["total_steps=7", "5 + 3"],
        ),
        (
            lambda: schedules.hf(
                "warmup_stable_decay",
                1.0,
                warmup_steps=2,
                total_steps=9,
                num_decay_steps=3,
                num_stable_steps=3,
            ),
            ValueError,
            ["2 + 3 + 3", "total_steps=9"],
        ),
        (
            lambda: schedules.hf(
                "warmup_stable_decay",
                1.0,
                warmup_steps=2,
                num_decay_steps=3,
                num_stable_steps=1,
                decay_type="exp",
            ),
            ValueError,
            ["decay_type", "'exp'", "1-sqrt"],
        ),
        (
            lambda: schedules.hf("cosine_with_min_lr", 1.0, warmup_steps=2, total_steps=9),
            ValueError,
            ["min_lr= and min_lr_rate="],
        ),
        (
            lambda: schedules.hf(
                "cosine_with_min_lr",
                1.0,
                warmup_steps=2,
                total_steps=9,
                min_lr=0.1,
                min_lr_rate=0.1,
            ),
            ValueError,
            ["exactly one"],
        ),
        (
            lambda: schedules.hf(
                "cosine_with_min_lr", 1.0, warmup_steps=2, total_steps=9, min_lr=2.0
            ),
            ValueError,
            ["min_lr_rate", "<= 1"],
        ),
        (lambda: schedules.hf("reduce_lr_on_plateau", 1.0), ValueError, ["set_hyperparams"]),
    ],
)
def test_hf_bad_arguments(build: Any, error: type, words: list[str]) -> None:
    with pytest.raises(error) as info:
        build()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_hf_cosine_is_not_the_shifted_cosine_after_the_end() -> None:
    # Hugging Face's cosine rises again past num_training_steps; fasttorch.schedules.cosine
    # stays at its end. hf keeps Hugging Face's values: step 2n - w is back at the peak.
    s = schedules.hf("cosine", 1.0, warmup_steps=2, total_steps=10)
    assert float(s(torch.tensor(10))) == pytest.approx(0.0, abs=libm_atol(1.0))
    assert math.isclose(float(s(torch.tensor(18))), 1.0, rel_tol=0, abs_tol=libm_atol(1.0))
