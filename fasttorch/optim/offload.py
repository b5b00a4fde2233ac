"""CPU offload: the optimizer state and update of a GPU model kept in host memory.

:func:`cpu_offload` is torchao's ``CPUOffloadOptimizer`` as a pure fasttorch optimizer:
the parameters of at least ``minimal_size`` values get a float32 copy in host memory,
their optimizer state lives there, and each update copies their gradients to the host,
runs the optimizer there (torch's fused CPU AdamW by default) and copies the new values
back; smaller parameters are updated on the device. torchao's class keeps hooks on the
module's parameters (``register_post_accumulate_grad_hook``), which a functional step
never fires, so it cannot be wrapped; this is the same algorithm over the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from fasttorch.optim._base import OptState, params_device
from fasttorch.optim.torch_optim import TorchOptimizer, from_torch

__all__ = ["CpuOffload", "cpu_offload"]

_HOST = "host_params"  # the slot holding the host copies of the offloaded parameters


@attrs.frozen
class CpuOffload:
    """``inner`` run in host memory for the parameters of at least ``minimal_size``
    values and on their device for the others (built by :func:`cpu_offload`)."""

    inner: TorchOptimizer
    minimal_size: int = 4096

    @property
    def lr(self) -> Any:
        return self.inner.lr

    def check_compilable(self) -> None:
        """Always raises: the update runs on the host between copies to and from the device."""
        raise RuntimeError(
            "cpu_offload cannot run in a compiled step: its update runs in host memory, "
            "between copies of the gradients to the host and of the new parameters back "
            "(torchao's CPUOffloadOptimizer steps eagerly as well). Run the step eagerly "
            "(leave out fasttorch.compiled), or compile the model alone."
        )

    def _split(self, params: Mapping[str, Tensor]) -> tuple[list[str], list[str]]:
        big = [n for n, p in params.items() if p.numel() >= self.minimal_size]
        return big, [n for n in params if n not in set(big)]

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """Host copies of the large parameters (pinned), ``inner``'s state for them in
        host memory, ``inner``'s state for the small ones on their device."""
        device = params_device(params)
        if device.type not in ("cuda", "xpu"):
            raise ValueError(
                f"cpu_offload: the parameters are on {device.type!r}. CPU offload moves "
                "the optimizer state of a model on a CUDA (or XPU) device into host "
                "memory (torchao's CPUOffloadOptimizer refuses other devices the same "
                "way: 'CPU Offload currently only supports CUDA & XPU'). On a CPU the "
                "state is in host memory already: give TrainState.create the optimizer "
                "itself, e.g. fasttorch.optim.from_torch(torch.optim.AdamW, fused=True)."
            )
        big, small = self._split(params)
        host = {n: params[n].detach().to("cpu", copy=True).pin_memory() for n in big}
        on_host = self.inner.init(host)
        on_device = self.inner.init({n: params[n] for n in small})
        slots: dict[str, dict[str, Tensor]] = {_HOST: host}
        for part in (on_host, on_device):
            for k, v in part.slots.items():
                slots.setdefault(k, {}).update(v)
        return OptState(count=on_device.count, hyper=on_host.hyper, slots=slots)

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        return self.inner.learning_rate(opt_state, step)

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        inplace: bool = False,
    ) -> tuple[dict[str, Tensor], OptState]:
        """``inner``'s update on the host for the large parameters (gradients copied
        there, new values copied back) and on the device for the small ones."""
        big, small = self._split(params)
        host = opt_state.slots[_HOST]
        count = opt_state.count.add_(1) if inplace else opt_state.count + 1

        def part(names: list[str], hyper: dict[str, Tensor]) -> OptState:
            slots = {k: {n: v[n] for n in names} for k, v in opt_state.slots.items() if k != _HOST}
            return OptState(count=opt_state.count, hyper=hyper, slots=slots)

        grads_host = {n: grads[n].to("cpu", non_blocking=True) for n in big}
        if big and params[big[0]].device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the copies have landed
        new_host, host_state = self.inner.update(
            {n: host[n] for n in big},
            grads_host,
            part(big, opt_state.hyper),
            step,
            inplace=inplace,
        )
        device = params_device(params)
        hyper_device = {k: v.to(device, non_blocking=True) for k, v in opt_state.hyper.items()}
        new_small, small_state = self.inner.update(
            {n: params[n] for n in small},
            {n: grads[n] for n in small},
            part(small, hyper_device),
            step,
            inplace=inplace,
        )
        out: dict[str, Tensor] = dict(new_small)
        for n in big:
            target = params[n] if inplace else torch.empty_like(params[n])
            out[n] = target.copy_(new_host[n], non_blocking=True)
        slots: dict[str, dict[str, Tensor]] = {_HOST: {**host, **new_host}}
        for st in (host_state, small_state):
            for k, v in st.slots.items():
                slots.setdefault(k, {}).update(v)
        return {n: out[n] for n in params}, opt_state.replace(count=count, slots=slots)


def cpu_offload(
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    lr: float | None = None,
    *,
    minimal_size: int = 4096,
    **hyperparams: Any,
) -> CpuOffload:
    """torchao's ``CPUOffloadOptimizer(params, cls, minimal_size=..., **hyperparams)``
    as a fasttorch optimizer: the optimizer state of a CUDA model in host memory.

    Parameters of at least ``minimal_size`` values keep a float32 copy in pinned host
    memory, with ``cls``'s state beside it; each update copies their gradients to the
    host, steps ``cls`` there (``from_torch(cls, ...)``: torch's own kernel, the fused
    CPU one for AdamW as torchao defaults to) and copies the new values to the device.
    Smaller parameters are stepped on the device by the same algorithm. The device
    holds no optimizer state for the large parameters. Eager steps only (the update
    runs on the host); refused on a CPU model (there is nothing to offload), when the
    state is created.

    Equivalent to::

        opt = torchao.optim.CPUOffloadOptimizer(model.parameters(), cls, **hyperparams)
        ...; opt.step()

    Args:
        cls: a ``torch.optim`` class :func:`~fasttorch.optim.from_torch` takes.
        lr: its learning rate (default: the class's own).
        minimal_size: parameters with fewer values stay on the device (torchao's 4096).
        **hyperparams: the class's other arguments; ``fused=True`` is the default for
            AdamW, as in torchao.

    Example:
        >>> import torch, fasttorch
        >>> opt = fasttorch.optim.cpu_offload(torch.optim.AdamW, 1e-3)
        >>> opt.inner.options
        (('fused', True),)
        >>> fasttorch.TrainState.create(torch.nn.Linear(2, 2), opt)
        Traceback (most recent call last):
        ...
        ValueError: cpu_offload: the parameters are on 'cpu'. CPU offload moves ...
    """
    if cls is torch.optim.AdamW and "fused" not in hyperparams:
        hyperparams["fused"] = True
    inner = from_torch(cls, lr, **hyperparams)
    if not isinstance(inner, TorchOptimizer):
        raise TypeError(f"cpu_offload takes a torch.optim class, got {cls!r}")
    return CpuOffload(inner, minimal_size)
