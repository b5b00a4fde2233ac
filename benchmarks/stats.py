"""The statistics of the suite, kept free of timing code so that they can be unit-tested.

* :func:`schedule`: rounds interleave the variants (A B C, A B C, ...), so slow drifts
  of the machine hit every variant alike.
* :func:`per_step`: a run's time per step is the median of its blocks.
* :func:`drifted_rounds`: a round whose baseline time per step is more than ``tol``
  (5%) away from the median over rounds of the baseline is discarded, and reported.
* :func:`summarize`: per variant, the median over the kept rounds of the time per step
  and of the ratio to the baseline measured in the same round.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Summary", "drifted_rounds", "payback_steps", "per_step", "schedule", "summarize"]


def schedule(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The run order: every round runs every variant once, in the given order.

    >>> schedule(["A", "B"], 3)
    [(0, 'A'), (0, 'B'), (1, 'A'), (1, 'B'), (2, 'A'), (2, 'B')]
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if len(set(variants)) != len(variants):
        raise ValueError(f"variants must be distinct, got {list(variants)}")
    return [(r, v) for r in range(rounds) for v in variants]


def per_step(block_seconds: Sequence[float], steps_per_block: int) -> float:
    """Seconds per step of one run: the median of its blocks over the block length.

    >>> per_step([1.0, 3.0, 2.0, 100.0, 2.5], 100)
    0.025
    """
    if not block_seconds:
        raise ValueError("no blocks were timed")
    if steps_per_block < 1:
        raise ValueError(f"steps_per_block must be >= 1, got {steps_per_block}")
    return statistics.median(block_seconds) / steps_per_block


def drifted_rounds(baseline: Mapping[int, float], tol: float = 0.05) -> dict[int, float]:
    """The rounds whose baseline time is more than ``tol`` away from the median of all.

    Returns ``{round: relative deviation}`` for the rounds to discard. The reference is
    the low median (a measured round, also for an even count), so at least one round
    is always kept.

    >>> drifted_rounds({0: 1.00, 1: 1.02, 2: 1.20})
    {2: 0.1764...}
    """
    if not baseline:
        return {}
    mid = statistics.median_low(baseline.values())
    out = {}
    for r, t in baseline.items():
        dev = abs(t - mid) / mid
        if dev > tol:
            out[r] = dev
    return out


@dataclass(frozen=True)
class Summary:
    """One variant over the kept rounds."""

    seconds_per_step: float
    ratio_to_baseline: float  # baseline time / variant time: > 1 is faster (a speed-up)
    ratio_min: float
    ratio_max: float
    rounds: int


def summarize(
    times: Mapping[str, Mapping[int, float]], baseline: str, keep: Sequence[int]
) -> dict[str, Summary]:
    """Per variant: median time per step and median per-round speed-up over ``baseline``.

    ``times[variant][round]`` is the seconds per step of that run; a variant missing
    from a kept round (it failed) is summarized over the rounds it has.
    """
    base = times[baseline]
    out: dict[str, Summary] = {}
    for v, by_round in times.items():
        rounds = [r for r in keep if r in by_round and r in base]
        if not rounds:
            continue
        ratios = [base[r] / by_round[r] for r in rounds]
        out[v] = Summary(
            seconds_per_step=statistics.median(by_round[r] for r in rounds),
            ratio_to_baseline=statistics.median(ratios),
            ratio_min=min(ratios),
            ratio_max=max(ratios),
            rounds=len(rounds),
        )
    return out


def payback_steps(compile_s: float, step_s: float, baseline_step_s: float) -> float | None:
    """Steps after which compiling has paid for itself against the baseline.

    ``None`` when the variant is not faster per step than the baseline (never pays).

    >>> payback_steps(10.0, 0.01, 0.02)
    1000.0
    """
    saved = baseline_step_s - step_s
    if saved <= 0:
        return None
    return max(compile_s, 0.0) / saved
