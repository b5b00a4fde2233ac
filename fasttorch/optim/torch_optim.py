"""Any ``torch.optim`` algorithm as a pure fasttorch optimizer, run by torch's own kernels.

:func:`from_torch` wraps a ``torch.optim`` class: torch validates the hyperparameters
(building the class once over a placeholder), the per-parameter state is torch's own
(same keys: ``exp_avg``, ``step``, ...) kept in the :class:`~fasttorch.optim.OptState`,
and each update calls the algorithm's functional form (``torch.optim.adam.adam`` and so
on) over the state's tensors: torch's single-tensor, foreach or fused code, not a copy
of its math. :func:`load_torch_state_dict` moves a ``torch.optim`` state into a
:class:`~fasttorch.TrainState`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import Tensor

from fasttorch.optim._base import (
    LearningRate,
    OptState,
    check_lr,
    params_device,
    scheduled_or_fixed_lr,
)

if TYPE_CHECKING:
    from fasttorch.state import TrainState

__all__ = ["TorchOptimizer", "from_torch", "load_torch_state_dict"]

# The state lists each functional form takes after (params, grads), as torch's state keys.
_STATE_ARGS: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"),
    "SGD": ("momentum_buffer",),
    "RMSprop": ("square_avg", "grad_avg", "momentum_buffer", "step"),
    "Adagrad": ("sum", "step"),
    "Adadelta": ("square_avg", "acc_delta", "step"),
    "Adamax": ("exp_avg", "exp_inf", "step"),
    "NAdam": ("exp_avg", "exp_avg_sq", "mu_product", "step"),
    "RAdam": ("exp_avg", "exp_avg_sq", "step"),
    "ASGD": ("ax", "mu", "eta", "step"),
    "Rprop": ("prev", "step_size", "step"),
    "Adafactor": ("row_var", "col_var", "variance", "step"),
    "Muon": ("momentum_buffer",),
}
# The functional form of each class: module, function.
_FUNCTIONAL: dict[str, tuple[str, str]] = {
    "Adam": ("torch.optim.adam", "adam"),
    "AdamW": ("torch.optim.adam", "adam"),
    "SGD": ("torch.optim.sgd", "sgd"),
    "RMSprop": ("torch.optim.rmsprop", "rmsprop"),
    "Adagrad": ("torch.optim.adagrad", "adagrad"),
    "Adadelta": ("torch.optim.adadelta", "adadelta"),
    "Adamax": ("torch.optim.adamax", "adamax"),
    "NAdam": ("torch.optim.nadam", "nadam"),
    "RAdam": ("torch.optim.radam", "radam"),
    "ASGD": ("torch.optim.asgd", "asgd"),
    "Rprop": ("torch.optim.rprop", "rprop"),
    "Adafactor": ("torch.optim._adafactor", "adafactor"),
    "Muon": ("torch.optim._muon", "muon"),
}
_REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure several times per step, which "
    "a pure (state, batch) step cannot offer; fasttorch computes one gradient per step",
    "SparseAdam": "it updates from sparse gradients (nn.Embedding(sparse=True)), and "
    "fasttorch's gradients are dense; use torch.optim.Adam or AdamW",
}
# Group entries that are switches of the call, not hyperparameters.
_CONTROL = ("foreach", "fused", "capturable", "differentiable")


def _scalar(value: float, like: Tensor) -> Tensor:
    """A 0-d float32 tensor on ``like``'s device (torch's ``_get_scalar_dtype()``)."""
    return torch.tensor(float(value), dtype=torch.float32, device=like.device)


def _init_slots(name: str, p: Tensor, group: Mapping[str, Any], lr: float) -> dict[str, Tensor]:
    """Torch's fresh per-parameter state for ``p`` (as its ``_init_group`` builds it)."""
    z = torch.zeros_like
    step = _scalar(0.0, p)
    if name in ("Adam", "AdamW"):
        s = {"exp_avg": z(p), "exp_avg_sq": z(p)}
        if group["amsgrad"]:
            s["max_exp_avg_sq"] = z(p)
        return {**s, "step": step}
    if name == "Muon":
        return {"momentum_buffer": z(p)}
    if name == "SGD":
        return {"momentum_buffer": z(p)} if group["momentum"] != 0 else {}
    if name == "RMSprop":
        s = {"square_avg": z(p)}
        if group["centered"]:
            s["grad_avg"] = z(p)
        if group["momentum"] > 0:
            s["momentum_buffer"] = z(p)
        return {**s, "step": step}
    if name == "Adagrad":
        return {"sum": torch.full_like(p, group["initial_accumulator_value"]), "step": step}
    if name == "Adadelta":
        return {"square_avg": z(p), "acc_delta": z(p), "step": step}
    if name == "Adamax":
        return {"exp_avg": z(p), "exp_inf": z(p), "step": step}
    if name == "NAdam":
        return {"exp_avg": z(p), "exp_avg_sq": z(p), "mu_product": _scalar(1.0, p), "step": step}
    if name == "RAdam":
        return {"exp_avg": z(p), "exp_avg_sq": z(p), "step": step}
    if name == "ASGD":
        return {"ax": z(p), "mu": _scalar(1.0, p), "eta": _scalar(lr, p), "step": step}
    if name == "Rprop":
        return {"prev": z(p), "step_size": torch.full_like(p, lr), "step": step}
    if name == "Adafactor":
        # Torch keeps Adafactor's step on the CPU and reads it with .item() each update.
        cpu_step = torch.tensor(0.0, dtype=torch.float32)
        if p.dim() > 1:
            row = p.new_zeros((*p.shape[:-1], 1))
            col = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
            return {"row_var": row, "col_var": col, "step": cpu_step}
        return {"variance": z(p), "step": cpu_step}
    raise AssertionError(name)  # unreachable: from_torch checks the name


def _functional_kwargs(name: str, group: Mapping[str, Any]) -> dict[str, Any]:
    """The group's hyperparameters under the functional form's keyword names."""
    out = {k: v for k, v in group.items() if k not in ("params", "lr", *_CONTROL)}
    if "betas" in out:
        out["beta1"], out["beta2"] = out.pop("betas")
    if name == "Rprop":
        out["etaminus"], out["etaplus"] = out.pop("etas")
        out["step_size_min"], out["step_size_max"] = out.pop("step_sizes")
    if name == "Adafactor":
        out["eps1"], out["eps2"] = out.pop("eps")
    if name == "AdamW":
        out["decoupled_weight_decay"] = True
    return out


@attrs.frozen
class TorchOptimizer:
    """A ``torch.optim`` algorithm as a fasttorch optimizer (built by :func:`from_torch`).

    ``options`` holds the keyword arguments given to :func:`from_torch` (without
    ``lr``) as sorted pairs; ``group`` is the parameter group torch built from them,
    defaults filled in.

    Example:
        >>> opt = TorchOptimizer(torch.optim.Adam, 1e-3)
        >>> sorted(opt.init({"w": torch.zeros(2)}).slots)
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    cls: type[torch.optim.Optimizer]
    lr: LearningRate
    options: tuple[tuple[str, Any], ...] = ()
    group: tuple[tuple[str, Any], ...] = attrs.field(init=False, eq=False, repr=False)
    _kernel: Callable[..., None] = attrs.field(init=False, eq=False, repr=False)
    _accepted: frozenset[str] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        name = self.cls.__name__
        if name in _REFUSED:
            raise ValueError(f"from_torch: torch.optim.{name} is not supported: {_REFUSED[name]}.")
        if name not in _FUNCTIONAL or getattr(torch.optim, name, None) is not self.cls:
            raise TypeError(
                f"from_torch: expected one of the torch.optim classes "
                f"{sorted(_FUNCTIONAL)}, got {self.cls!r}. A new algorithm can be written "
                "as a fasttorch optimizer instead (see docs/optimizers.md)."
            )
        check_lr(f"from_torch({name})", self.lr)
        options = dict(self.options)
        for k in ("capturable", "differentiable"):
            if k in options:
                raise ValueError(
                    f"from_torch({name}): {k}= is chosen by fasttorch (capturable on "
                    "accelerators and in compiled steps; differentiable never), got "
                    f"{k}={options[k]!r}. Leave it out."
                )
        lr0 = self._lr_value()
        placeholder = torch.zeros(2, 2, requires_grad=True)
        # torch validates the hyperparameters and fills in its defaults.
        group = dict(self.cls([placeholder], lr=lr0, **options).param_groups[0])
        del group["params"]
        if name == "SGD" and group["momentum"] != 0 and group["dampening"] != 0:
            raise ValueError(
                "from_torch(SGD): momentum with dampening != 0 is not supported: torch "
                "starts the buffer as a copy of the first gradient, a choice made on the "
                f"host (got dampening={group['dampening']!r}). Use "
                "fasttorch.optim.sgd(lr, momentum=..., dampening=...), which matches "
                "torch.optim.SGD there, or dampening=0."
            )
        object.__setattr__(self, "group", tuple(sorted(group.items())))
        # Resolved here, outside any step: dynamo does not trace importlib.
        module, attr = _FUNCTIONAL[name]
        kernel = getattr(importlib.import_module(module), attr)
        object.__setattr__(self, "_kernel", kernel)
        object.__setattr__(self, "_accepted", frozenset(inspect.signature(kernel).parameters))

    def _lr_value(self) -> float:
        if callable(self.lr):
            return float(self.lr(torch.zeros((), dtype=torch.int64)))
        return float(self.lr)

    def check_compilable(self) -> None:
        """Raise if this optimizer cannot run inside a compiled step, saying why.

        ``fasttorch.compiled`` calls it before tracing, so the message is not buried
        in the compiler's own error.
        """
        name = self.cls.__name__
        if name == "Adafactor":
            raise RuntimeError(
                "from_torch(Adafactor) cannot run in a compiled step: torch's Adafactor "
                "reads the step count and parameter norms with .item() in every update. "
                "Run the step eagerly (leave out fasttorch.compiled), or pick another "
                "algorithm."
            )
        if dict(self.group).get("fused"):
            raise RuntimeError(
                f"from_torch({name}, fused=True) cannot run in a compiled step: torch "
                "wraps its fused kernels in torch.compiler.disable (they are not traced). "
                "In a compiled step leave fused out (torch's capturable kernel is traced "
                "and fused by the compiler); keep fused=True for eager steps."
            )

    def replace(self, **overrides: Any) -> TorchOptimizer:
        """The same algorithm with some hyperparameters replaced (for parameter groups)."""
        lr = overrides.pop("lr", self.lr)
        return TorchOptimizer(self.cls, lr, _options({**dict(self.options), **overrides}))

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """Count 0, ``lr`` as a 0-d float32 tensor, torch's fresh state per parameter."""
        device = params_device(params)
        group = dict(self.group)
        slots: dict[str, dict[str, Tensor]] = {}
        for n, p in params.items():
            for key, t in _init_slots(
                self.cls.__name__, p.detach(), group, self._lr_value()
            ).items():
                slots.setdefault(key, {})[n] = t
        hyper = (
            {}
            if callable(self.lr)
            else {"lr": torch.tensor(float(self.lr), dtype=torch.float32, device=device)}
        )
        return OptState(
            count=torch.zeros((), dtype=torch.int64, device=device), hyper=hyper, slots=slots
        )

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        """``self.lr(step)`` for a schedule, else ``opt_state.hyper["lr"]``."""
        return scheduled_or_fixed_lr(self.lr, opt_state, step)

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        opt_state: OptState,
        step: Tensor,
        *,
        inplace: bool = False,
    ) -> tuple[dict[str, Tensor], OptState]:
        """One step of torch's functional kernel over copies (or, inplace, the tensors)."""
        names = list(params)
        count = opt_state.count.add_(1) if inplace else opt_state.count + 1
        if not names:
            return {}, opt_state.replace(count=count)
        name = self.cls.__name__
        if _compiling():  # compiled checks this before tracing; a backstop for torch.compile
            self.check_compilable()
        fn, accepted = self._kernel, self._accepted
        group = dict(self.group)
        keys = _STATE_ARGS[name]

        def own(t: Tensor) -> Tensor:
            return t if inplace else t.clone()

        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            p = [own(params[n]) for n in names]
            g = [own(grads[n]) for n in names]
            slots = {k: {n: own(t) for n, t in v.items()} for k, v in opt_state.slots.items()}
            lists: list[list[Any]] = []
            for key in keys:
                if key in slots:
                    lists.append([slots[key].get(n) for n in names])
                else:
                    # as torch's _init_group: None per parameter where it appends
                    # state.get(key), an empty list where it appends nothing
                    lists.append([None] * len(names) if name in ("SGD", "Adafactor") else [])
            kwargs = {k: v for k, v in _functional_kwargs(name, group).items() if k in accepted}
            kwargs.update(self._call_flags(p, group, accepted))
            if "lr" in accepted:  # Rprop reads it only to start its step sizes (init)
                cpu_eager = not (kwargs.get("fused") or _compiling()) and lr.device.type == "cpu"
                kwargs["lr"] = _host(lr) if cpu_eager else lr
            if "has_complex" in accepted:
                kwargs["has_complex"] = False
            fn(p, g, *lists, **kwargs)
        return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)

    def _call_flags(
        self, p: list[Tensor], group: Mapping[str, Any], accepted: frozenset[str]
    ) -> dict[str, Any]:
        flags: dict[str, Any] = {}
        for k in ("foreach", "fused"):
            if k in accepted and group.get(k) is not None:
                flags[k] = group[k]
        if "capturable" in accepted:
            # torch's capturable kernels keep the step count and lr on the device; its
            # eager check accepts accelerators only, so a CPU tensor in eager mode takes
            # the other path, which reads them as Python numbers (host memory, no sync).
            flags["capturable"] = _compiling() or p[0].device.type != "cpu"
        if "differentiable" in accepted:
            flags["differentiable"] = False
        return flags


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _host(lr: Tensor) -> float:
    """The learning rate as a Python number, for torch's non-capturable CPU kernels.

    Only on a CPU in eager mode: the value is already in host memory, nothing waits.
    """
    return lr.item()


def from_torch(
    cls: type[torch.optim.Optimizer], lr: LearningRate = 1e-3, **hyperparams: Any
) -> TorchOptimizer:
    """A ``torch.optim`` algorithm as a pure fasttorch optimizer, run by torch's kernels.

    Every algorithm that updates from gradients alone: Adam, AdamW, SGD, RMSprop,
    Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, Adafactor and Muon. Torch
    checks ``hyperparams`` (its own errors) and fills in its defaults; each update calls
    the algorithm's functional form (``torch.optim.adam.adam``, ...) over the state's
    tensors, so the numbers are torch's own. The per-parameter state is torch's, under
    torch's keys (``state.opt_state.slots["exp_avg"][name]``, ``...["step"][name]``),
    and ``lr`` is a 0-d tensor in ``opt_state.hyper`` (or a schedule), so changing it
    (:func:`~fasttorch.optim.set_hyperparams`) does not recompile; the other
    hyperparameters are fixed (a new value is a new optimizer).

    How torch runs it: in a compiled step, and eagerly on an accelerator, with
    ``capturable=True`` (step count and lr stay on the device; no host sync), the path
    torch itself takes for ``torch.compile(opt.step)`` (SGD, Adagrad and Muon have no
    capturable form: eagerly on an accelerator torch reads their lr on the host, unless
    ``fused=True``); eagerly on a CPU, torch's default
    CPU path, which reads the step count and lr as Python numbers (host memory, nothing
    to wait for) and gives the same bits as ``torch.optim.X(...).step()``. ``foreach=``
    and ``fused=`` are passed on (``fused=True``: Adam, AdamW, SGD, Adagrad; eager
    steps only, as torch does not let a compiler trace its fused kernels).
    Adafactor reads parameter norms with ``.item()`` in every update (torch's code), so
    it runs eagerly but cannot be compiled with ``fullgraph=True``. Muon takes 2-D
    parameters only: give the others another optimizer with :func:`groups`.

    Equivalent to::

        opt = cls(model.parameters(), lr=lr, **hyperparams)
        ...; opt.step()

    Args:
        cls: the ``torch.optim`` class, e.g. ``torch.optim.AdamW``.
        lr: a float >= 0, or a schedule ``step -> 0-d tensor`` (``fasttorch.schedules``).
        **hyperparams: the class's other keyword arguments (``betas``, ``weight_decay``,
            ``foreach``, ``fused``, ...), except ``capturable`` and ``differentiable``.

    Returns:
        A :class:`TorchOptimizer`.

    Raises:
        ValueError: for LBFGS (needs a closure) and SparseAdam (sparse gradients), for
            ``capturable``/``differentiable``, for SGD with momentum and dampening, and
            for what torch itself refuses.
        TypeError: ``cls`` is not a ``torch.optim`` optimizer class.

    Example:
        >>> import torch, fasttorch
        >>> opt = fasttorch.optim.from_torch(torch.optim.AdamW, 0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> sorted(state.slots)
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> params, state = opt.update(params, {"w": torch.ones(2)}, state, torch.tensor(0))
        >>> params["w"]
        tensor([0.8500, 0.8500])
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"from_torch expects a torch.optim class such as torch.optim.AdamW, got {cls!r}"
        )
    return TorchOptimizer(cls, lr, _options(hyperparams))


def _options(hyperparams: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Sorted pairs, lists (``betas=[0.9, 0.99]``) as tuples: the optimizer is static
    configuration of the state, compared and hashed by the compiler's guards."""
    return tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in hyperparams.items())
    )


def load_torch_state_dict(
    state: TrainState,
    state_dict: Mapping[str, Any],
    *,
    names: Sequence[str] | None = None,
    steps: int | None = None,
) -> TrainState:
    """``state`` with a ``torch.optim`` optimizer's ``state_dict()`` loaded into it.

    Moves a run from a plain loop onto fasttorch mid-training: the per-parameter state
    (moments, momentum buffers, step counts) goes into ``state.opt_state``, converted
    to the dtype and device of the state's own tensors, and the number of steps taken
    into ``state.step`` and ``opt_state.count`` (schedules continue where they were).
    With one parameter group its ``lr`` becomes ``opt_state.hyper["lr"]`` (unless the
    learning rate is a schedule). Parameters themselves come from the module, as usual.

    Equivalent to ``opt.load_state_dict(state_dict)`` on the plain loop's optimizer.

    Args:
        state: a state built with the same algorithm (``from_torch(torch.optim.X)``, or
            fasttorch's ``adam``/``adamw``/``sgd``, whose slots have torch's names).
        state_dict: ``opt.state_dict()`` of the torch optimizer.
        names: the parameter name of each of torch's parameter indices (in the order
            the optimizer was given them); default ``list(state.params)``, right for
            ``torch.optim.X(model.parameters())`` when every parameter is trained.
        steps: optimizer steps taken so far; default torch's own ``"step"`` count
            (needed for SGD, whose state has none).

    Returns:
        A new ``TrainState``; ``state`` is unchanged.

    Raises:
        ValueError: the parameter counts differ, torch's state has an entry this
            optimizer does not keep (e.g. ``amsgrad`` on one side only), a shape
            differs, or the step count is unknown.

    Example:
        >>> import torch, fasttorch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> state = fasttorch.TrainState.create(
        ...     model, fasttorch.optim.from_torch(torch.optim.AdamW, 0.1))
        >>> state = fasttorch.optim.load_torch_state_dict(state, opt.state_dict())
        >>> int(state.step), state.opt_state.slots["exp_avg"]["bias"]
        (1, tensor([0.1000]))
    """
    names = list(state.params) if names is None else list(names)
    indices = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(indices) != len(names):
        raise ValueError(
            f"load_torch_state_dict: the torch optimizer has {len(indices)} parameters and "
            f"the state trains {len(names)} ({names[:5]}...). Pass names=[...] giving the "
            "fasttorch parameter name of each torch parameter, in the optimizer's order."
        )
    by_index = dict(zip(indices, names))
    opt_state = state.opt_state
    slots = {k: dict(v) for k, v in opt_state.slots.items()}
    taken: int | None = None
    for index, entries in state_dict["state"].items():
        name = by_index[index]
        for key, value in entries.items():
            if key == "step" and "step" not in slots:
                taken = int(value)
                continue
            if key not in slots or name not in slots[key]:
                raise ValueError(
                    f"load_torch_state_dict: torch's state of {name!r} has {key!r}, which "
                    f"{type(state.optimizer).__name__} does not keep (it keeps "
                    f"{sorted(k for k, v in slots.items() if name in v)}). Build the "
                    "fasttorch optimizer with the same algorithm and options."
                )
            old = slots[key][name]
            value = torch.as_tensor(value)
            if value.shape != old.shape:
                raise ValueError(
                    f"load_torch_state_dict: {key!r} of {name!r} has shape "
                    f"{tuple(value.shape)} in torch's state, {tuple(old.shape)} here."
                )
            slots[key][name] = value.detach().to(dtype=old.dtype, device=old.device).clone()
            if key == "step":
                taken = int(value)
    taken = steps if steps is not None else taken
    if taken is None:
        raise ValueError(
            "load_torch_state_dict: torch's state does not say how many steps were taken "
            "(SGD keeps no count); pass steps=N, the number of optimizer steps so far."
        )
    hyper = dict(opt_state.hyper)
    groups_ = state_dict["param_groups"]
    if len(groups_) == 1 and "lr" in hyper:
        hyper["lr"] = torch.as_tensor(float(groups_[0]["lr"]), dtype=hyper["lr"].dtype).to(
            hyper["lr"].device
        )
    count = torch.full_like(opt_state.count, taken)
    return state.replace(
        opt_state=opt_state.replace(count=count, hyper=hyper, slots=slots),
        step=torch.full_like(state.step, taken),
    )
