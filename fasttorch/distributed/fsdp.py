"""Sharded states: ``sync_on_last`` over a module sharded with FSDP2 (``fully_shard``).

FSDP2 owns the sharding: the module's parameters are ``DTensor`` shards, its hooks
all-gather them for each forward and reduce-scatter the gradients after the last
backward. A sharded ``TrainState`` holds this rank's shards (the same storage), so the
optimizer, clipping, loss scaling and EMA run on plain local tensors, and a donating
update writes into what FSDP2 all-gathers next. What FSDP2 does not do, this module
does around it, once per window:

* the window's microbatches backpropagate into the module's ``.grad`` as
  ``loss.backward()`` does (FSDP2 sees nothing else), with the gradient sync off for
  every microbatch but the last (``set_requires_gradient_sync``), so the only
  reduce-scatter is the last backward's; the units FSDP2 keeps gathered from forward
  to backward (``reshard_after_forward=False``, and the root) stay gathered to the
  last microbatch (``set_reshard_after_backward``), so they are all-gathered once per
  window, not once per microbatch;
* each microbatch's backward is seeded with ``mult * weight / reference``, the
  reference being the mean over ranks of the first microbatch's weight (one small
  all-reduce per window), so every rank's gradients carry the same factor and the
  reduced gradient is the mean over every sample of the global window, whatever the
  ranks' shard sizes (with equal weights the factor is exactly 1);
* one all-reduce after the backward carries the window's counts (weight, loss, the
  agreement checks of :func:`~fasttorch.distributed.reducer.check_agreement`) and the
  local sum of squares of the gradient shards, from which every rank gets the same
  global norm: clipping uses it, and an inf/NaN on any rank makes every rank skip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from fasttorch import _compat
from fasttorch._checks import warn_once
from fasttorch._core.phases import IntoGrad
from fasttorch._core.state import imported_class
from fasttorch._core.step import Sums, update_outside
from fasttorch.distributed.reducer import (
    DistributedStepError,
    SyncConfig,
    check_agreement,
    wait,
    window_counts,
)
from fasttorch.distributed.tensor_parallel import norm_shares
from fasttorch.phases import GradOut, Tensors, reciprocal, skip_empty_window
from fasttorch.state import TrainState, local_tensor, reshard
from fasttorch.window import InModule, Step

if TYPE_CHECKING:  # imported by the program that shards (import fasttorch leaves it out)
    from torch.distributed.tensor import DTensor

__all__ = ["ShardedWindow", "as_dtensor", "sharded_leaves", "sharded_parameters"]


def sharded_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's trainable parameters by name (``DTensor``s where FSDP2 sharded them).

    FSDP2 modules left unsharded by a forward without backward are resharded first.
    """
    reshard(module)
    return {k: p for k, p in module.named_parameters() if p.requires_grad}


def sharded_leaves(state: TrainState) -> dict[int, DTensor]:
    """The leaves of ``state`` that are shards, by index in ``tree_flatten`` order.

    A leaf is a shard of the module's ``DTensor`` parameter ``name`` when its path
    ends in ``name`` and it has that parameter's local shape: the parameter itself in
    ``params``, and what the optimizer and transforms keep per parameter
    (``opt_state/slots/exp_avg/name``, ``substates/ema/params/name``). Each maps to
    the parameter, whose mesh, placements and global shape describe it.
    """
    reshard(state.module)
    dtensor = imported_class("torch.distributed.tensor", "DTensor")
    by_name = {k: p for k, p in state.module.named_parameters() if isinstance(p, dtensor)}
    if not by_name:
        return {}
    out: dict[int, DTensor] = {}
    for i, (path, leaf) in enumerate(pytree.tree_flatten_with_path(state)[0]):
        last = path[-1] if path else None
        name = getattr(last, "key", None)
        p = by_name.get(name) if isinstance(name, str) else None
        if p is not None and isinstance(leaf, torch.Tensor) and leaf.shape == p._local_tensor.shape:
            out[i] = p
    return out


def as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as a shard of a ``DTensor`` laid out as ``like`` (no copy)."""
    from torch.distributed.tensor import DTensor  # loaded: ``like`` is one

    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


class _ShardedInto(IntoGrad):
    """The window's seeds, relative to the mean over ranks of the first weight."""

    def __init__(self, config: SyncConfig) -> None:
        self.config = config

    def reference(self, weight: torch.Tensor) -> torch.Tensor:
        total = weight.detach().to(torch.float64).clone()
        wait(
            dist.all_reduce(total, group=self.config.group, async_op=True),
            self.config,
            "the window's first microbatch weight",
        )
        ranks = dist.get_world_size(self.config.group)
        return (total / ranks).to(weight.dtype)


def _check(config: SyncConfig, step: Step, state: TrainState) -> list[Any]:
    """The FSDP2 modules of ``state.module`` (root first), after checking the call."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedStepError(
            "sync_on_last over a sharded state needs torch.distributed: launch with "
            "torchrun and call fasttorch.distributed.setup() before fully_shard"
        )
    if not step.donate:
        raise ValueError(
            f"step {step.name!r}: a sharded state cannot be trained with donate=False. "
            "Its parameters are the module's own shards, which FSDP2 all-gathers for "
            "every forward, so a step must update them in place. Build the step with "
            "fasttorch.step(loss_fn) (donate=True), and keep copies with "
            "fasttorch.checkpoint.save instead"
        )
    from torch.distributed.fsdp import FSDPModule

    roots = [m for m in state.module.modules() if isinstance(m, FSDPModule)]
    if not isinstance(state.module, FSDPModule):
        raise ValueError(
            f"step {step.name!r}: the state's module {type(state.module).__name__} has "
            "children sharded with fully_shard but is not sharded itself. Call "
            "fully_shard(model) on the root too, after its blocks (as torchtitan does): "
            "the root's hooks drive the whole forward and backward"
        )
    if not step.is_eager:
        update = (
            "the update runs outside any graph too, as on every CPU with an optimizer "
            'that runs torch\'s fused kernel (docs/optimizers.md, "Opaque update")'
            if update_outside(step, state)
            else "compiled compiles the update only (unscale, clip, optimizer, EMA: one graph)"
        )
        warn_once(
            "compiled: the state is sharded with FSDP2, whose hooks run outside any "
            f"graph, so {update}; the forward and backward run as the module runs them: "
            "eagerly, unless its blocks were compiled before fully_shard (block.compile(), "
            'as torchtitan does): docs/distributed.md, "Sharding"'
        )
    return roots


def _check_storage(step: Step, state: TrainState, params: dict[str, torch.Tensor]) -> None:
    """Raise unless ``state.params`` are the module's own shards (what FSDP2 gathers)."""
    for k, p in params.items():
        mine = state.params.get(k)
        if mine is None or mine.data_ptr() != local_tensor(p).data_ptr():
            raise ValueError(
                f"step {step.name!r}: the state's parameter {k!r} is not the module's own "
                "shard. FSDP2 all-gathers the module's shards for every forward, so a "
                "sharded state must hold them (the same storage), or its updates would "
                "never reach the model. This happens with a state loaded by "
                "fasttorch.checkpoint.load(path, template) without inplace=True, or built "
                "before fully_shard. Load with checkpoint.load(path, template, "
                "inplace=True), or build the state with TrainState.create(model, ...) "
                "after fully_shard"
            )


def _kept_gathered(roots: list[Any]) -> list[Any]:
    """The FSDP2 units whose parameters stay gathered between a window's microbatches.

    Those FSDP2 keeps unsharded from forward to backward anyway (sharded with
    ``reshard_after_forward=False``, and the root): keeping them to the next
    microbatch's forward adds nothing to the peak, which is at the end of a forward,
    and saves an all-gather per unit per microbatch. The others (``True``, FSDP2's
    default, chosen for memory) reshard after each backward, as FSDP2 does.
    """
    keep = []
    for m in roots:
        kept = _compat.fsdp_keeps_params_after_forward(m)
        if kept is None:
            warn_once(
                "sync_on_last over FSDP2: this torch release does not show whether a "
                f"unit ({type(m).__name__}) was sharded with reshard_after_forward=False, "
                "so every unit reshards after each microbatch's backward and is "
                "all-gathered again for the next (FSDP2's default; correct, more traffic)"
            )
        elif kept:
            keep.append(m)
    return keep


class ShardedWindow(InModule):
    """A window over a state sharded with FSDP2, for the ``.grad`` engine of
    :mod:`fasttorch.window` (``sync_on_last``'s reduction installs it)."""

    value_dtype = torch.float64

    def __init__(self, config: SyncConfig, step: Step, state: TrainState, n: int) -> None:
        roots = _check(config, step, state)
        params = sharded_parameters(state.module)
        _check_storage(step, state, params)
        super().__init__(params, _ShardedInto(config))
        self.config = config
        self.module = state.module
        self.root = roots[0]
        self.keep = _kept_gathered(roots) if n > 1 else []
        # Parameters held whole by several ranks (replicated over tensor parallelism)
        # count their square once in the global norm: empty for plain FSDP2.
        self.shares = norm_shares(params, config.group)
        self._weights: dict[Any, torch.Tensor] = {}

    def before(self, i: int, n: int) -> None:
        """Sync (reduce-scatter) and reshard on the last microbatch only."""
        self.root.set_requires_gradient_sync(i == n - 1)
        for m in self.keep:
            m.set_reshard_after_backward(i == n - 1, recurse=False)

    def after(self) -> None:
        """FSDP2's defaults back; a window that failed part-way leaves nothing gathered."""
        self.root.set_requires_gradient_sync(True)
        for m in self.keep:
            m.set_reshard_after_backward(True, recurse=False)
        reshard(self.module)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``t``."""
        return local_tensor(t)

    def _share_weights(self, grads: Tensors, like: torch.Tensor) -> torch.Tensor:
        """:func:`norm_shares` in the order of ``grads``, made once per set of names."""
        key = (tuple(grads), like.device)
        if key not in self._weights:
            w = [self.shares.get(k, 1.0) for k in grads]
            self._weights[key] = torch.tensor(w, dtype=like.dtype, device=like.device)
        return self._weights[key]

    def mean(
        self,
        step: Step,
        state: TrainState,
        grads: Tensors,
        unused: frozenset[str],
        sums: Sums,
        last: GradOut,
    ) -> GradOut:
        """The window's mean over every rank, its norm agreed on by all of them.

        FSDP2 reduce-scattered only the parameters with a gradient and left the others'
        ``.grad`` None, as ``torch.optim`` then skips: so does the update (FSDP2 needs
        every rank to agree on that set, or its reduce-scatter does not match).
        """
        config, into, n = self.config, self.into, sums.count
        assert sums.value is not None and sums.weight is not None
        ts = list(grads.values())
        # One kernel per step of this, not per tensor: on a GPU each launch costs more
        # than the arithmetic of a norm.
        squares = torch.stack(torch._foreach_norm(ts)).to(torch.float64).square()
        if self.shares:
            squares = squares * self._share_weights(grads, squares)
        sumsq = squares.sum()
        counts = window_counts(sums.weight, sums.value, n, state.step, sumsq)
        wait(
            dist.all_reduce(counts, group=config.group, async_op=True),
            config,
            "the window's sample counts and gradient norm",
        )
        check_agreement(counts, config, n)
        total, ranks = counts[0], counts[2]
        assert into.first is not None
        # The reduced gradient is sum_(r,i) w_ri * grad_ri * mult / (n * ranks * reference)
        # (FSDP2 averages over ranks; mult is 1/n times any loss scale), the window's mean
        # times the loss scale times total / (n * ranks * reference): a factor the shards
        # carry to the update phase as their scale, which divides it out in the pass that
        # unscales (fused into the update graph under compiled), not in a pass of its own.
        # It is exactly 1 with equal weights.
        factor = total / (n * ranks * into.first.to(torch.float64))
        if last.scale is not None:
            factor = factor * last.scale.to(torch.float64)
        scale = factor.to(torch.float32)
        norm = counts[7].sqrt().to(torch.float32) * reciprocal(scale)
        window = GradOut(
            grads=grads,
            value=(counts[1] / total).to(last.value.dtype),
            weight=total.to(torch.float32),
            aux=last.aux,  # the window's mean aux replaces it in the metrics
            scale=scale,
            norm=norm,
            counted=last.counted,
            unused=unused,
        )
        return skip_empty_window(window)
