"""Evaluation: a pure, compilable eval step and a running-mean metric record.

``eval_step(step)`` reuses the training step's ``loss`` phase (so the forward runs in
the training precision when ``with_amp`` was applied), without autograd, with the
module in evaluation mode, optionally on the EMA weights. Metrics stay on the device;
:class:`Mean` accumulates them there, and the loop reads them once, when it logs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from fasttorch import struct
from fasttorch._checks import warn_once
from fasttorch.phases import Batch, LossFn, LossPhase, Metrics, Tensors
from fasttorch.state import TrainState, check_alive, evaluating, is_sharded, reshard
from fasttorch.steps import Step
from fasttorch.steps import step as make_step
from fasttorch.substates import declares, eval_params

__all__ = ["Mean", "eval_step", "evaluate"]

EvalFn = Callable[[TrainState, Batch], Metrics]


def eval_step(step_or_loss_fn: Step | LossFn, *, use_ema: bool = False) -> EvalFn:
    """A pure ``(state, batch) -> metrics`` evaluation of the loss, no update.

    Runs the step's ``loss`` phase under ``torch.no_grad()`` with the module in
    evaluation mode (dropout off, BatchNorm reading its running statistics; the
    previous mode is restored after the call), and returns ``{"loss", "weight"}`` (and
    ``"aux"`` when the loss function returns it) as device tensors. Given a step with
    ``with_amp``, the forward runs under the same autocast. The state is not changed.
    ``compiled(eval_step(step))`` compiles it (any callable is accepted).

    Equivalent to::

        model.eval()
        with torch.no_grad(), torch.autocast(device_type, dtype):  # as in training
            loss = loss_fn(model, batch)  # or ema_model (its buffers too) with use_ema=True
        model.train()

    Args:
        step_or_loss_fn: a :class:`fasttorch.Step` (uncompiled: compile the
            evaluation itself), or a loss function ``(apply, batch) -> loss``.
        use_ema: evaluate the averaged parameters of ``fasttorch.ema`` (from
            ``state.substates["ema"]``) instead of ``state.params``, with the
            buffers the average keeps (BatchNorm running statistics averaged or
            copied, ``ema(..., buffers=...)``) in place of the live ones: those of
            the sub-state whose record declares ``eval_params`` (and
            ``eval_buffers``, :mod:`fasttorch.substates`), so another transform's
            average works the same way. An average that keeps none of the
            module's persistent floating buffers is evaluated with the live ones,
            and the first eager call warns once, saying what to set. On a state
            sharded with FSDP2 the averages' shards (and buffers) are copied into
            the module's own for the forward and the state's copied back after it
            (bitwise), which takes one more copy of this rank's parameter shards.

    Returns:
        The evaluation function, named after the step.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch.evaluation import eval_step
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> metrics = eval_step(loss_fn)(state, torch.randn(8, 4))
        >>> sorted(metrics), metrics["loss"].requires_grad, float(metrics["weight"])
        (['loss', 'weight'], False, 8.0)
    """
    loss: LossPhase
    if isinstance(step_or_loss_fn, Step):
        s = step_or_loss_fn
        if "compiled" in s.transforms:
            raise ValueError(
                f"eval_step: step {s.name!r} is compiled; pass the step before compiled "
                "and compile the evaluation instead: compiled(eval_step(step))"
            )
        averaged = [d.key for d in s.inits if declares(d.record, "eval_params")]
        if use_ema and len(averaged) != 1:
            raise ValueError(
                f"eval_step: use_ema=True but step {s.name!r} has "
                + (f"several averages ({averaged})" if averaged else "no ema")
                + f" (transforms: {', '.join(s.transforms) or 'none'}); evaluation swaps "
                "in the parameters of one sub-state that declares eval_params: wrap the "
                "step with fasttorch.ema(step, decay) once"
            )
        loss, name = s.loss, s.name
    elif callable(step_or_loss_fn):
        loss = make_step(step_or_loss_fn).loss
        name = getattr(step_or_loss_fn, "__name__", type(step_or_loss_fn).__name__)
    else:
        raise TypeError(
            "eval_step expects a fasttorch.Step or a loss function (apply, batch) -> loss, "
            f"got {type(step_or_loss_fn).__name__}"
        )

    checked: list[bool] = []  # the live-buffers warning: judged on the first eager call

    def evaluate(state: TrainState, batch: Batch) -> Metrics:
        eager = not torch.compiler.is_compiling()
        if eager:
            check_alive(state, f"eval_step({name})")
        params, buffers = state.params, state.buffers
        if use_ema:
            params, kept = _averages(state, name)
            if eager and not checked and len(kept) < len(buffers):
                checked.append(True)
                _warn_live_buffers(state, kept, name)
            buffers = {**buffers, **kept}
        module = state.module
        with evaluating(module), torch.no_grad():
            if use_ema and eager and is_sharded(module):
                with _averages_in_shards(state, params, kept):
                    out = loss(state, state.params, state.buffers, batch)
            else:
                out = loss(state, params, buffers, batch)
        metrics: Metrics = {"loss": out.value, "weight": out.weight}
        if out.aux is not None:
            metrics["aux"] = out.aux
        return metrics

    evaluate.__name__ = evaluate.__qualname__ = name
    # No update in its graph: compiled builds it as a step's gradient graphs, with the
    # C++ wrapper on a CPU (one C++ build, not one per kernel).
    evaluate.__fasttorch_forward_only__ = True  # type: ignore[attr-defined]
    return evaluate


def _averages(state: TrainState, name: str) -> tuple[Tensors, Tensors]:
    """The parameters and buffers the state's one sub-state with ``eval_params`` holds
    (the EMA's); its buffers are those of its ``eval_buffers`` field, else none."""
    found = eval_params(state.substates)
    if len(found) != 1:
        raise ValueError(
            f"eval_step({name}, use_ema=True): the state has "
            + (f"several averages ({[k for k, _ in found]})" if found else "no 'ema' sub-state")
            + f" (it has {sorted(state.substates)}); train it with a step wrapped in "
            "fasttorch.ema, or call that step's init(state) first"
        )
    key, params = found[0]
    field = declares(state.substates[key], "eval_buffers")
    buffers: Tensors = {} if field is None else getattr(state.substates[key], field)
    return params, buffers


def _warn_live_buffers(state: TrainState, kept: Tensors, name: str) -> None:
    """Warn once when the average keeps none of the module's persistent floating buffers:
    the averaged parameters then meet the live BatchNorm statistics (eager calls only)."""
    own = {k for k, _ in state.module.named_buffers()}
    live = [
        k
        for k in state.module.state_dict(keep_vars=True)
        if k in own and k not in kept and state.buffers[k].is_floating_point()
    ]
    if live:
        key = eval_params(state.substates)[0][0]
        warn_once(
            f"eval_step({name}, use_ema=True): sub-state {key!r} keeps no average of the "
            f"buffers {', '.join(live[:3])}{', ...' if len(live) > 3 else ''}, so the "
            "averaged parameters are evaluated with the live ones (BatchNorm statistics "
            "of the trained parameters, not of the average). Build the step with "
            "fasttorch.ema(step, decay, buffers='average') (timm ModelEmaV3's default) "
            "or buffers='copy'; a sub-state of your own declares eval_buffers"
        )


@contextlib.contextmanager
def _averages_in_shards(state: TrainState, averages: Tensors, buffers: Tensors) -> Iterator[None]:
    """The EMA's shards (and buffers) in the module's own, the state's back afterwards
    (bitwise).

    A sharded module runs over its own storage (FSDP2 all-gathers it), which is
    ``state.params`` and ``state.buffers``: the averages are copied in, and the
    parameters and buffers back out even if the forward raised. Its FSDP2 modules are
    resharded before (a root left unsharded by an earlier forward would not all-gather
    the averages) and after (so that no later forward reads the averages from an
    unsharded root).
    """
    names = list(state.params)
    shards = [state.params[k] for k in names] + [state.buffers[k] for k in buffers]
    saved = [t.clone() for t in shards]
    reshard(state.module)
    torch._foreach_copy_(shards, [averages[k] for k in names] + list(buffers.values()))
    try:
        yield
    finally:
        reshard(state.module)
        torch._foreach_copy_(shards, saved)


class Mean(struct.Record):
    """A running weighted mean kept on the device: ``total / count``.

    Immutable: :meth:`update` returns a new record, so it can be carried through a
    compiled evaluation loop. Nothing is read to the host until you call ``float()`` on
    :meth:`compute`'s result.

    Attributes:
        total: the weighted sum of the values (0-d).
        count: the sum of the weights (0-d).

    Example:
        >>> import torch
        >>> from fasttorch.evaluation import Mean
        >>> m = Mean.zeros()
        >>> m = m.update(torch.tensor(2.0), weight=3).update(torch.tensor(4.0), weight=1)
        >>> float(m.compute())
        2.5
    """

    total: torch.Tensor
    count: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Mean:
        """An empty mean (``compute()`` gives NaN until the first update)."""
        zero = torch.zeros((), dtype=dtype, device=device)
        return cls(total=zero, count=zero.clone())

    def update(self, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> Mean:
        """Add ``value`` (a mean over ``weight`` items) and return the new record.

        ``value`` may hold several values; ``weight`` broadcasts against it.
        """
        v = torch.as_tensor(value, device=self.total.device).to(self.total.dtype)
        w = torch.as_tensor(weight, device=self.total.device).to(self.total.dtype)
        w = w.expand_as(v) if w.ndim <= v.ndim else w
        return Mean(total=self.total + (v * w).sum(), count=self.count + w.sum())

    def merge(self, other: Mean) -> Mean:
        """The mean over both records' values (e.g. after an all-reduce of each field)."""
        return Mean(total=self.total + other.total, count=self.count + other.count)

    def compute(self) -> torch.Tensor:
        """``total / count`` as a 0-d device tensor."""
        return self.total / self.count


def evaluate(fn: EvalFn, state: TrainState, batches: Iterable[Batch]) -> dict[str, torch.Tensor]:
    """Mean of ``fn``'s ``loss`` (and floating 0-d ``aux``) over ``batches``, on the device.

    Each batch is weighted by its ``metrics["weight"]``, so the result is the mean over
    every sample (or token), whatever the batch sizes. No host sync happens here.

    Args:
        fn: an evaluation function, e.g. ``eval_step(step)`` or
            ``compiled(eval_step(step))``.
        state: the state to evaluate.
        batches: the evaluation batches (already on the state's device).

    Returns:
        ``{"loss": ..., **aux}`` as 0-d tensors.

    Example:
        >>> import torch, fasttorch
        >>> from fasttorch.evaluation import eval_step, evaluate
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> out = evaluate(eval_step(loss_fn), state, [torch.randn(8, 4), torch.randn(2, 4)])
        >>> sorted(out), out["loss"].shape
        (['loss'], torch.Size([]))
    """
    means: dict[str, Mean] = {}
    for batch in batches:
        m = fn(state, batch)
        values = {"loss": m["loss"]}
        aux = m.get("aux")
        if isinstance(aux, dict):
            values.update(
                {
                    k: v
                    for k, v in aux.items()
                    if isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point()
                }
            )
        for k, v in values.items():
            if k not in means:
                means[k] = Mean.zeros(v.device)
            means[k] = means[k].update(v, m["weight"])
    return {k: mean.compute() for k, mean in means.items()}
