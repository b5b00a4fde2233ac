"""torchao's low-bit Adam and AdamW (8-bit, 4-bit, float8 states) as pure fasttorch optimizers.

:func:`from_torchao` wraps one of torchao's classes (``torchao.optim.AdamW8bit``,
``AdamW4bit``, ``AdamWFp8``, ``Adam8bit``, ``Adam4bit``, ``AdamFp8``): torchao builds
the states (its tensor subclasses ``OptimState8bit``/``OptimState4bit``/
``OptimStateFp8``, with its rule of which tensors are quantized), and each update
runs torchao's own per-parameter kernel ``single_param_adam``, not a copy of its
math. torchao is an optional dependency (``pip install fasttorch[ao]``).
:func:`state_bytes` counts what an optimizer state holds.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from fasttorch import _compat
from fasttorch.optim import _inner
from fasttorch.optim._base import LearningRate, OptState, check_lr, params_device
from fasttorch.optim._base import scheduled_or_fixed_lr as _lr_at

__all__ = ["TorchaoOptimizer", "from_torchao", "is_torchao_optimizer", "state_bytes"]

# torchao's optimizers whose update is ``single_param_adam`` over their own states.
LOW_BIT = ("Adam4bit", "Adam8bit", "AdamFp8", "AdamW4bit", "AdamW8bit", "AdamWFp8")
_MODULE = "torchao.optim"


def is_torchao_optimizer(cls: object) -> bool:
    """Whether ``cls`` is a class defined in ``torchao.optim`` (without importing torchao)."""
    return isinstance(cls, type) and cls.__module__.startswith(_MODULE)


@attrs.frozen
class TorchaoOptimizer:
    """A torchao low-bit Adam/AdamW as a fasttorch optimizer (built by :func:`from_torchao`).

    ``options`` holds the keyword arguments given to :func:`from_torchao` (without
    ``lr``) as sorted pairs; ``lr`` is a float or a schedule. The torchao optimizer
    built over a placeholder (which validated the arguments) is kept, unhashed, to
    build each parameter's states as torchao builds them.
    """

    cls: type
    lr: LearningRate
    options: tuple[tuple[str, Any], ...] = ()
    _built: Any = attrs.field(init=False, eq=False, repr=False)
    _kernel: Callable[..., None] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        name = self.cls.__name__
        if name not in LOW_BIT or getattr(_torchao_optim(), name, None) is not self.cls:
            offload = (
                " CPUOffloadOptimizer keeps hooks on the module's parameters, which a "
                "functional step never fills: use fasttorch.optim.cpu_offload instead."
                if name == "CPUOffloadOptimizer"
                else ""
            )
            raise TypeError(
                f"from_torchao: expected one of torchao.optim's {list(LOW_BIT)}, got "
                f"{self.cls!r}.{offload}"
            )
        check_lr(f"from_torchao({name})", self.lr)
        options = dict(self.options)
        if options.get("bf16_stochastic_round"):
            raise ValueError(
                f"from_torchao({name}): bf16_stochastic_round=True is not supported: "
                "torchao draws its rounding noise from torch's global generator inside "
                "the update, so the same state and batch would give different parameters "
                "(a fasttorch step is pure). Leave it out (False, torchao's default), or "
                "keep float32 parameters (autocast to bf16 with fasttorch.with_amp)."
            )
        if options.get("amsgrad"):
            raise ValueError(
                f"from_torchao({name}): amsgrad=True is not supported: torchao's kernel "
                "takes torch.maximum of a quantized state, which its state classes do not "
                "implement (torchao's own step() fails the same way, torchao 0.18). Leave "
                "it out, or use fasttorch.optim.from_torch(torch.optim.AdamW, amsgrad=True)."
            )
        lr0 = self._lr_value()
        cls: Any = self.cls
        built = cls([torch.zeros(2, requires_grad=True)], lr=lr0, **options)
        object.__setattr__(self, "_built", built)
        _inner.check_layout(f"from_torchao({name})", built._new_buffer(torch.zeros(4096), True))
        adam = importlib.import_module(f"{_MODULE}.adam")  # outside any step: not traced
        object.__setattr__(self, "_kernel", adam.single_param_adam)

    def _lr_value(self) -> float:
        if callable(self.lr):
            return float(self.lr(torch.zeros((), dtype=torch.int64)))
        return float(self.lr)

    @property
    def group(self) -> dict[str, Any]:
        """torchao's parameter group (defaults filled in), without ``params`` and ``lr``."""
        group = dict(self._built.param_groups[0])
        del group["params"], group["lr"]
        return group

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """torchao's fresh states: ``step`` (a float32 0-d tensor per parameter, as
        torchao keeps it), ``exp_avg`` and ``exp_avg_sq`` made by torchao: a quantized
        subclass for a tensor of at least 4096 values whose count is a multiple of the
        block size, plain zeros otherwise. ``lr`` is a float32 0-d tensor, as torchao
        holds it."""
        device = params_device(params)
        slots: dict[str, dict[str, Tensor]] = {"step": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for n, p in params.items():
            local = p.detach()
            slots["step"][n] = torch.zeros((), dtype=torch.float32, device=local.device)
            slots["exp_avg"][n] = self._built._new_buffer(local, True)
            slots["exp_avg_sq"][n] = self._built._new_buffer(local, False)
        hyper = (
            {}
            if callable(self.lr)
            else {"lr": torch.tensor(self._lr_value(), dtype=torch.float32, device=device)}
        )
        return OptState(
            count=torch.zeros((), dtype=torch.int64, device=device), hyper=hyper, slots=slots
        )

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        """``self.lr(step)`` for a schedule, else ``opt_state.hyper["lr"]`` (0-d float32)."""
        return _lr_at(self.lr, opt_state, step).reshape(()).to(torch.float32)

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        inplace: bool = False,
    ) -> tuple[dict[str, Tensor], OptState]:
        """One step of torchao's ``single_param_adam`` per parameter, over copies (or,
        inplace, the state's own tensors). Eagerly, the kernel is compiled as torchao
        compiles it (``torch.compile(single_param_adam, fullgraph=True,
        dynamic=False)``, the same cached code); in a compiled step it is traced into
        the step's graph."""
        names = list(params)
        count = opt_state.count.add_(1) if inplace else opt_state.count + 1
        group = self.group
        beta1, beta2 = group["betas"]
        compiling = torch.compiler.is_compiling()
        kernel = (
            self._kernel
            if compiling
            else torch.compile(self._kernel, fullgraph=True, dynamic=False)
        )

        def own(t: Tensor) -> Tensor:
            return t if inplace else _inner.clone(t)

        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            slots = {k: {n: own(t) for n, t in v.items()} for k, v in opt_state.slots.items()}
            out: dict[str, Tensor] = {}
            # torchao lifts dynamo's recompile limit the same way: one entry per shape.
            with contextlib.nullcontext() if compiling else _compat.no_recompile_limit():
                for n in names:
                    p = own(params[n])
                    slots["step"][n].add_(1)
                    kernel(
                        p,
                        grads[n],
                        slots["step"][n],
                        slots["exp_avg"][n],
                        slots["exp_avg_sq"][n],
                        None,  # max_exp_avg_sq: amsgrad is refused
                        lr,
                        beta1,
                        beta2,
                        group["weight_decay"],
                        group["eps"],
                        self._built.is_adamw,
                        False,
                    )
                    out[n] = p
        return out, opt_state.replace(count=count, slots=slots)


def _torchao_optim() -> Any:
    try:
        return importlib.import_module(_MODULE)
    except ImportError as e:
        raise ImportError(
            "fasttorch.optim.from_torchao needs torchao (>= 0.18), which is not installed. "
            "Install it with `pip install fasttorch[ao]` (or `pip install torchao`)."
        ) from e


def state_bytes(opt_state: OptState | Mapping[Any, Any]) -> int:
    """Bytes held by the per-parameter slots of ``opt_state`` (or by every tensor of a
    ``torch.optim`` optimizer's ``opt.state``): each tensor's elements, a tensor
    subclass counted by its inner tensors (8-bit codes, block scales, the quantization
    map), not by the dtype it shows.

    Example:
        >>> import torch
        >>> from fasttorch import optim
        >>> state = optim.adamw(1e-3).init({"w": torch.zeros(1000)})
        >>> state_bytes(state)  # two float32 moments: 8 bytes per parameter
        8000
        >>> w = torch.nn.Parameter(torch.zeros(1000))
        >>> opt = torch.optim.AdamW([w])
        >>> w.grad = torch.ones(1000); opt.step()
        >>> state_bytes(opt.state)  # the same two moments, and a float32 step count
        8004
    """
    tree: Any = opt_state.slots if isinstance(opt_state, OptState) else dict(opt_state)
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(_bytes(t) for t in leaves if isinstance(t, Tensor))


def _bytes(t: Tensor) -> int:
    if hasattr(type(t), "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return sum(_bytes(getattr(t, k)) for k in names)
    return t.numel() * t.element_size()


def from_torchao(cls: type, lr: LearningRate | None = None, **hyperparams: Any) -> TorchaoOptimizer:
    """A torchao low-bit Adam/AdamW as a pure fasttorch optimizer, run by torchao's kernel.

    ``cls`` is one of ``torchao.optim``'s ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``,
    ``Adam8bit``, ``Adam4bit``, ``AdamFp8``. torchao checks ``hyperparams`` and fills in
    its defaults (``weight_decay`` 1e-2 for the AdamW forms, ``block_size`` 256 for
    8-bit and float8, 128 for 4-bit). The states are torchao's own, under its keys
    (``state.opt_state.slots["exp_avg"][name]``, ``...["step"][name]``): quantized
    tensor subclasses for parameters of at least 4096 values whose count is a multiple
    of ``block_size``, float32 zeros for the rest (bitsandbytes' rule, torchao's code).
    Each update calls torchao's ``single_param_adam`` per parameter, as torchao's
    ``step()`` does. ``lr`` is a float32 0-d tensor in ``opt_state.hyper`` (or a
    schedule), so changing it does not recompile. ``fasttorch.optim.from_torch(cls,
    ...)`` with a torchao class comes here.

    What a step equals: ``cls(params, lr=lr, **hyperparams)`` stepped the same way.
    Eagerly, bit for bit: the same kernel compiled the same way (torchao compiles it
    with the default backend; under ``torch.compiler.set_stance("force_eager")`` both
    run it eagerly). In a compiled step the kernel is traced into the step's graph, so
    it runs with that graph's backend: with ``backend="aot_eager"`` it equals torchao's
    loop under ``set_stance("force_eager")`` bit for bit.

    Refused: ``bf16_stochastic_round=True`` (it draws from torch's global generator
    inside the update: not pure), ``amsgrad=True`` (torchao's kernel fails on its own
    quantized states), and any other class (``CPUOffloadOptimizer``: see
    :func:`fasttorch.optim.cpu_offload`).

    Equivalent to::

        opt = torchao.optim.AdamW8bit(model.parameters(), lr=lr, **hyperparams)
        ...; opt.step()

    Args:
        cls: the torchao class, e.g. ``torchao.optim.AdamW8bit``.
        lr: a float >= 0 or a schedule ``step -> 0-d tensor``; default 1e-3 (torchao's).
        **hyperparams: ``betas``, ``eps``, ``weight_decay``, ``block_size``.

    Returns:
        A :class:`TorchaoOptimizer`.

    Raises:
        ImportError: torchao is not installed.
        TypeError: ``cls`` is not one of the classes above.
        ValueError: ``bf16_stochastic_round=True``, ``amsgrad=True``, or what torchao
            itself refuses.

    Example:
        >>> import pytest, torch
        >>> ao = pytest.importorskip("torchao.optim")  # the optional extra fasttorch[ao]
        >>> opt = from_torchao(ao.AdamW8bit, 1e-3)
        >>> state = opt.init({"w": torch.zeros(64, 64), "b": torch.zeros(64)})
        >>> type(state.slots["exp_avg"]["w"]).__name__
        'OptimState8bit'
        >>> state_bytes(state)  # 2 x (4096 codes + 16 scales + a 256-entry map) + b + steps
        10888
    """
    _torchao_optim()
    if not isinstance(cls, type):
        raise TypeError(
            f"from_torchao expects a torchao.optim class such as AdamW8bit, got {cls!r}"
        )
    return TorchaoOptimizer(cls, 1e-3 if lr is None else lr, _options(hyperparams))


def _options(hyperparams: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in hyperparams.items())
    )
