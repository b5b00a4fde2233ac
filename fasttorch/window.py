"""The accumulation window: how one call of a step runs its gradients and its update.

Every call runs a window of ``n`` microbatches (one without ``grad_accumulate``): their
gradients are summed, each weighted by its sample (or token) count, and applied once.
A step declares its window (:class:`Window`): ``n``, ``across_calls`` and the record of
its sums (:class:`WindowSums`; ``grad_accumulate`` declares its ``AccumState``, in
``fasttorch/transforms/grad_accumulate.py``), and a :class:`Reduction` across ranks
(``sync_on_last``). :func:`run`, the step's default runner, is the one loop. Defined in
the step runtime (``fasttorch/_core/step.py``, beside the driver that calls it); this
is its public face.
"""

from __future__ import annotations

from fasttorch._core.step import (
    InModule,
    Reduction,
    Step,
    Sums,
    Window,
    WindowSums,
    apply_update,
    eager,
    kernel,
    memo,
    run,
)

__all__ = [
    "InModule",
    "Reduction",
    "Step",
    "Sums",
    "Window",
    "WindowSums",
    "apply_update",
    "eager",
    "kernel",
    "memo",
    "run",
]
