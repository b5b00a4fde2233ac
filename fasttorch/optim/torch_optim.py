"""The ``torch.optim`` algorithms as pure fasttorch optimizers, run by torch's own kernels.

:func:`from_torch` wraps a ``torch.optim`` class: torch validates the hyperparameters
(building the class over a placeholder, and over the parameters when a state is
created), the per-parameter state is torch's own
(same keys: ``exp_avg``, ``step``, ...) kept in the :class:`~fasttorch.optim.OptState`,
and each update calls the algorithm's functional form (``torch.optim.adam.adam`` and so
on) over the state's tensors: torch's single-tensor, foreach or fused code, not a copy
of its math. :func:`load_torch_state_dict` moves a ``torch.optim`` state into a
:class:`~fasttorch.TrainState`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

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
from fasttorch.optim._torch_algorithms import ALGORITHMS, REFUSED, Algorithm
from fasttorch.optim._torch_state_dict import load_torch_state_dict
from fasttorch.optim.lowbit import TorchaoOptimizer, from_torchao, is_torchao_optimizer

__all__ = ["TorchOptimizer", "from_torch", "load_torch_state_dict"]


@attrs.frozen
class TorchOptimizer:
    """A ``torch.optim`` algorithm as a fasttorch optimizer (built by :func:`from_torch`).

    ``options`` holds the keyword arguments given to :func:`from_torch` (without
    ``lr``) as sorted pairs; ``group`` is the parameter group torch built from them,
    defaults filled in. ``lr`` is kept as a Python float (or a schedule); a tensor
    ``lr`` becomes its value and ``lr_dtype`` its dtype (``None``: given as a float),
    so the optimizer stays hashable static configuration.

    Example:
        >>> opt = TorchOptimizer(torch.optim.Adam, 1e-3)
        >>> sorted(opt.init({"w": torch.zeros(2)}).slots)
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    cls: type[torch.optim.Optimizer]
    lr: LearningRate | Tensor
    options: tuple[tuple[str, Any], ...] = ()
    lr_dtype: torch.dtype | None = None
    group: tuple[tuple[str, Any], ...] = attrs.field(init=False, eq=False, repr=False)
    _algorithm: Algorithm = attrs.field(init=False, eq=False, repr=False)
    _kernel: Callable[..., None] = attrs.field(init=False, eq=False, repr=False)
    _accepted: frozenset[str] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        name = self.cls.__name__
        if name in REFUSED:
            raise ValueError(f"from_torch: torch.optim.{name} is not supported: {REFUSED[name]}.")
        if name not in ALGORITHMS or getattr(torch.optim, name, None) is not self.cls:
            raise TypeError(
                f"from_torch: expected one of the torch.optim classes "
                f"{sorted(ALGORITHMS)}, got {self.cls!r}. A new algorithm can be written "
                "as a fasttorch optimizer instead (see docs/optimizers.md)."
            )
        if isinstance(self.lr, Tensor):
            value, dtype = _tensor_lr(name, self.lr)
            object.__setattr__(self, "lr", value)
            object.__setattr__(self, "lr_dtype", dtype)
        check_lr(f"from_torch({name})", self.lr)
        options = dict(self.options)
        for k, why in _SWITCHES.items():
            if options.get(k):
                raise ValueError(
                    f"from_torch({name}): {k}={options[k]!r} is not supported (only "
                    f"False, torch's default): {why}. Leave it out (or pass {k}=False)."
                )
        placeholder = torch.zeros(2, 2, requires_grad=True)
        # torch validates the hyperparameters and fills in its defaults.
        try:
            group = dict(self._torch([placeholder]).param_groups[0])
        except (ValueError, TypeError, IndexError) as e:
            e.add_note(
                f"fasttorch: raised by torch.optim.{name}(params, lr={self.lr!r}, "
                f"**{options!r}) when from_torch checked the arguments: they are passed "
                f"to torch unchanged; see help(torch.optim.{name}) for the valid ones."
            )
            raise
        del group["params"]
        algorithm = ALGORITHMS[name]
        if algorithm.check is not None:
            algorithm.check(group)
        object.__setattr__(self, "group", tuple(sorted(group.items())))
        # Resolved here, outside any step: dynamo does not trace importlib.
        kernel = getattr(importlib.import_module(algorithm.module), algorithm.function)
        object.__setattr__(self, "_algorithm", algorithm)
        object.__setattr__(self, "_kernel", kernel)
        object.__setattr__(self, "_accepted", frozenset(inspect.signature(kernel).parameters))

    def _torch(self, params: list[Tensor]) -> torch.optim.Optimizer:
        """``cls(params, lr=..., **options)``: torch's own checks of the arguments (and,
        given the state's parameters, of each parameter: Muon's 2-D rule)."""
        lr: float | Tensor = self._lr_value()
        if self.lr_dtype is not None:  # torch's rules for a tensor lr apply
            lr = torch.tensor(lr, dtype=self.lr_dtype)
        cls: Any = self.cls  # each class has its own keyword arguments
        return cls(params, lr=lr, **dict(self.options))  # type: ignore[no-any-return]

    def _lr_value(self) -> float:
        if callable(self.lr):
            return float(self.lr(torch.zeros((), dtype=torch.int64)))
        return float(self.lr)  # type: ignore[arg-type]

    @property
    def update_outside_graphs(self) -> bool:
        """With ``fused=True``: torch's fused kernels are not traced (torch wraps them in
        ``torch.compiler.disable``), so a compiled CPU step that donates its state runs
        this update outside its graphs, as the eager step runs it: torch's fused kernel
        in place on the state's tensors."""
        return bool(dict(self.group).get("fused"))

    def check_compilable(self) -> None:
        """Raise if this optimizer cannot run inside a compiled step, saying why.

        ``fasttorch.compiled`` calls it before tracing, so the message is not buried
        in the compiler's own error (not for a CPU state whose update runs outside the
        graphs, :attr:`update_outside_graphs`: there the update, if traced after all,
        raises it).
        """
        name = self.cls.__name__
        if self._algorithm.eager_only:
            raise RuntimeError(
                f"from_torch({name}) cannot run in a compiled step: "
                f"{self._algorithm.eager_only}. Run the step eagerly (leave out "
                "fasttorch.compiled), or pick another algorithm."
            )
        if dict(self.group).get("fused"):
            raise RuntimeError(
                f"from_torch({name}, fused=True) cannot run in a graph: torch wraps its "
                "fused kernels in torch.compiler.disable (they are not traced). A compiled "
                "step runs such an update outside its graphs only on a CPU, in a step "
                "that donates its state (fasttorch.step's default). Elsewhere leave fused "
                "out (torch's capturable kernel is traced and fused by the compiler), or "
                "run the step eagerly."
            )

    def replace(self, **overrides: Any) -> TorchOptimizer:
        """The same algorithm with some hyperparameters replaced (for parameter groups)."""
        if "lr" in overrides:
            lr, dtype = overrides.pop("lr"), None
        else:
            lr, dtype = self.lr, self.lr_dtype
        options = _options({**dict(self.options), **overrides})
        return TorchOptimizer(self.cls, lr, options, lr_dtype=dtype)

    def init(self, params: Mapping[str, Tensor]) -> OptState:
        """Count 0, ``lr`` as a tensor, torch's fresh state per parameter.

        ``lr`` is a 1-element tensor, in float64 when it was given as a Python float
        (every float's exact value), in its own dtype when it was given as a tensor.
        Torch's rules for each parameter are checked here, with torch's own error:
        the class is built over the parameters (Muon refuses any that is not 2-D), so
        a state is refused when it is created, not inside its first step.
        """
        name = self.cls.__name__
        tensors = [p.detach() for p in params.values()]
        try:
            self._torch(tensors)
        except (ValueError, RuntimeError, TypeError) as e:
            e.add_note(
                f"fasttorch: raised by torch.optim.{name} over the state's parameters "
                f"({list(params)[:5]}...), checked when the state is created. Give "
                "these parameters another optimizer with fasttorch.optim.groups."
            )
            raise
        device = params_device(params)
        group = dict(self.group)
        slots: dict[str, dict[str, Tensor]] = {}
        for n, p in params.items():
            for key, t in self._algorithm.slots(p.detach(), group, self._lr_value()).items():
                slots.setdefault(key, {})[n] = t
        dtype = self.lr_dtype or torch.float64
        # Shape (1,), not 0-d: torch.compile reads a 0-d float64 CPU input on every
        # call (its implicit NaN guard calls .item()); a 1-element tensor is a tensor.
        hyper = (
            {}
            if callable(self.lr)
            else {"lr": torch.full((1,), self._lr_value(), dtype=dtype, device=device)}
        )
        return OptState(
            count=torch.zeros((), dtype=torch.int64, device=device), hyper=hyper, slots=slots
        )

    def learning_rate(self, opt_state: OptState, step: Tensor) -> Tensor:
        """``self.lr(step)`` for a schedule, else ``opt_state.hyper["lr"]`` (0-d)."""
        rate: LearningRate = self.lr  # type: ignore[assignment]  # a tensor: made a float
        return scheduled_or_fixed_lr(rate, opt_state, step).reshape(())

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
        if _compiling():  # compiled checks this before tracing; a backstop for torch.compile
            self.check_compilable()
        fn, accepted, algorithm = self._kernel, self._accepted, self._algorithm
        group = dict(self.group)

        def own(t: Tensor) -> Tensor:
            return t if inplace else t.clone()

        with torch.no_grad():
            lr = self.learning_rate(opt_state, step)
            p = [own(params[n]) for n in names]
            g = [own(grads[n]) for n in names]
            slots = {k: {n: own(t) for n, t in v.items()} for k, v in opt_state.slots.items()}
            lists: list[list[Any]] = []
            for key in algorithm.state_args:
                if key in slots:
                    lists.append([slots[key].get(n) for n in names])
                else:  # as torch's _init_group builds it
                    lists.append(algorithm.missing(len(names)))
            kwargs = {k: v for k, v in algorithm.kwargs(group).items() if k in accepted}
            kwargs.update(self._call_flags(p, group, accepted))
            if "lr" in accepted:  # Rprop reads it only to start its step sizes (init)
                kwargs["lr"] = self._kernel_lr(lr)
            if algorithm.traced is not None and _compiling():
                # torch's default form, its host floats as float64 tensors (no capturable)
                fn = algorithm.traced
                kwargs["capturable"] = False
                kwargs["lr"] = lr.to(self.lr_dtype or torch.float64)
            if "has_complex" in accepted:
                kwargs["has_complex"] = False  # TrainState.create refuses complex parameters
            # torch's capturable single-tensor form divides by lr: at lr 0 it writes
            # 0/0 = NaN where the moments are 0. torch's eager loop leaves the parameters
            # as they were at lr 0 (the moments do not depend on lr), so those are kept.
            guard = (
                algorithm.nan_at_zero_lr
                and kwargs.get("capturable", False)
                and not (kwargs.get("foreach") or kwargs.get("fused"))
            )
            old = (
                [params[n] if not inplace else t.clone() for n, t in zip(names, p)] if guard else []
            )
            fn(p, g, *lists, **kwargs)
            if guard:
                zero = kwargs["lr"] == 0
                p = [_keep_where(zero, o, t, inplace) for o, t in zip(old, p)]
        return dict(zip(names, p)), opt_state.replace(count=count, slots=slots)

    def _kernel_lr(self, lr: Tensor) -> float | Tensor:
        """The learning rate as torch's kernel takes it in this call.

        A float lr (or a schedule): eagerly on a CPU, the Python float (its exact value,
        read from host memory, nothing to wait for), as ``torch.optim.X(lr=float)``
        passes it; elsewhere (compiled, accelerators) a float32 tensor, as
        ``torch.tensor(lr)`` gives ``X(capturable=True, lr=torch.tensor(lr))``: a tensor,
        so that a new value is no new graph. A tensor lr: that tensor's value in its
        own dtype, as torch passes it.
        """
        if self.lr_dtype is not None:
            return lr.to(self.lr_dtype)
        if not _compiling() and lr.device.type == "cpu":
            return _host(lr)
        return lr.to(torch.float32)

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
    """The learning rate as a Python number, for torch's CPU kernels.

    Only on a CPU in eager mode: the value is already in host memory, nothing waits.
    """
    return float(lr)


def _keep_where(zero: Tensor, old: Tensor, new: Tensor, inplace: bool) -> Tensor:
    """``old`` where the 0-d ``zero`` is true, else ``new`` (into ``new`` in place)."""
    kept = torch.where(zero, old, new)
    return new.copy_(kept) if inplace else kept


def _tensor_lr(name: str, lr: Tensor) -> tuple[float, torch.dtype]:
    """A tensor lr's value and dtype, checked as torch checks it (one value)."""
    if lr.numel() != 1 or not lr.is_floating_point():
        raise ValueError(
            f"from_torch({name}): a tensor lr must hold one floating-point value, got a "
            f"{lr.dtype} tensor of shape {tuple(lr.shape)}. Pass e.g. torch.tensor(1e-3)."
        )
    return float(lr.detach().reshape(())), lr.dtype


def _default_lr(cls: type[torch.optim.Optimizer]) -> float:
    """The ``lr`` default of ``cls.__init__`` (torch's: Adadelta 1.0, Adagrad 1e-2, ...)."""
    default = inspect.signature(cls.__init__).parameters["lr"].default
    if not isinstance(default, (int, float)):
        raise TypeError(f"from_torch: torch.optim.{cls.__name__} has no default lr; pass lr=")
    return float(default)


# The switches whose True changes how torch computes, and why fasttorch leaves them out.
_SWITCHES = {
    "capturable": "fasttorch chooses it: it runs torch's capturable kernel in compiled "
    "steps and on accelerators, where the step count stays on the device; eagerly on a "
    "CPU torch itself refuses capturable=True (its capturable kernels take accelerators "
    "only)",
    "differentiable": "it lets autograd differentiate through the update (torch then "
    "runs the step with gradients enabled, by another code path); fasttorch's update is "
    "not part of an autograd graph",
}


def from_torch(
    cls: type[torch.optim.Optimizer], lr: LearningRate | Tensor | None = None, **hyperparams: Any
) -> TorchOptimizer | TorchaoOptimizer:
    """A ``torch.optim`` algorithm as a pure fasttorch optimizer, run by torch's kernels.

    Covered: Adam, AdamW, SGD, RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD,
    Rprop, Adafactor and Muon, with every option torch tests on a CPU
    (tests/test_optim_db.py runs torch's own ``optim_db``). Torch checks
    ``hyperparams`` (its own errors) and fills in its defaults; each update calls the
    algorithm's functional form (``torch.optim.adam.adam``, ...) over the state's
    tensors, so the numbers are torch's own. The per-parameter state is torch's, under
    torch's keys (``state.opt_state.slots["exp_avg"][name]``, ``...["step"][name]``),
    and ``lr`` is a 1-element tensor in ``opt_state.hyper`` (or a schedule), so
    changing it (:func:`~fasttorch.optim.set_hyperparams`) does not recompile; the
    other hyperparameters are fixed (a new value is a new optimizer).

    ``lr`` left out is the class's own default (its ``__init__``'s: Adadelta 1.0;
    Adagrad, RMSprop, Rprop, ASGD, Adafactor 1e-2; Adamax, NAdam 2e-3; the others
    1e-3). A Python float keeps its exact value (held in float64); a tensor ``lr`` is
    taken as torch takes one (its value, in its dtype).

    What a step equals:

    - eagerly on a CPU, ``torch.optim.X(params, lr=lr, **hyperparams)`` stepped the
      same way, bit for bit: torch's default CPU kernel (or ``fused=True``'s), given
      the lr as the Python float (a tensor lr: as that tensor) and the step count as
      torch keeps it (host memory, nothing to wait for);
    - compiled, Adam, AdamW, Adamax, NAdam and RAdam: torch's default
      (non-capturable) form, its host arithmetic (step count, bias corrections, step
      size) in float64 tensors, so no host read and no recompile: on a CPU with
      ``backend="aot_eager"`` (eager's kernels) bit for bit ``torch.optim.X(params,
      lr=lr, **hyperparams)`` stepped eagerly (NAdam and RAdam with ``foreach=True``:
      within the last bits, as torch's foreach and single-tensor forms differ); a
      compiler generating its own kernels (inductor) rounds within its rules;
    - compiled, the other classes (and eagerly on an accelerator, all of them), torch's
      ``capturable=True`` kernel
      with the lr as a float32 tensor (``torch.tensor(lr)``; a tensor lr as given), so
      that step count and lr stay on the device and a new lr is no new graph: what
      ``torch.compile`` of ``X(..., capturable=True, lr=torch.tensor(lr)).step`` runs
      (SGD, Adagrad and Muon have no capturable form: eagerly on an accelerator
      torch reads their lr on the host, unless ``fused=True``). One exception: at
      ``lr == 0`` torch's capturable single-tensor Adam and AdamW divide 0 by 0 where
      the moments are 0 (an unused embedding row) and write NaN; there the old
      parameters are kept, as torch's eager loop keeps them (a ``torch.where``, no
      host read).

    The fast compile form is ``fused=True`` (Adam, AdamW, SGD, Adagrad: the classes
    with one) on a CPU: a compiled step that donates its state runs torch's fused
    kernel outside its graphs, as the eager step does, so the update costs no compile
    time, as :func:`~fasttorch.optim.adamw`'s (docs/optimizers.md, "Opaque update");
    torch does not let a compiler trace its fused kernels, so elsewhere (a GPU,
    ``donate=False``) a compiled step refuses ``fused=True``, saying so. Without it,
    and for the other classes, compiled, the update is traced, and inductor generates
    code for every parameter tensor's update, so the cold compile grows with the model
    (at 12 GPT layers the traced AdamW took 32.5 s of an 81.6 s first step,
    docs/benchmarks_compile.md). ``fused=True`` is not the default because its bits
    are torch's fused form's, not the default form's that this function equals.

    ``foreach=`` and ``fused=`` are passed on (``fused=True``: Adam, AdamW, SGD,
    Adagrad); ``capturable=False`` and ``differentiable=False`` (torch's defaults) are
    accepted. Adafactor reads parameter norms with ``.item()`` in every update (torch's
    code), so it runs eagerly but cannot be compiled with ``fullgraph=True``. Torch's
    rules for each parameter are checked when the state is created: Muon takes 2-D
    parameters only (give the others another optimizer with :func:`groups`).

    Equivalent to::

        opt = cls(model.parameters(), lr=lr, **hyperparams)
        ...; opt.step()

    Args:
        cls: the ``torch.optim`` class, e.g. ``torch.optim.AdamW``.
        lr: a float >= 0, a 1-element tensor, or a schedule ``step -> 0-d tensor``
            (``fasttorch.schedules``); default: the class's own.
        **hyperparams: the class's other keyword arguments (``betas``, ``weight_decay``,
            ``foreach``, ``fused``, ...); ``capturable`` and ``differentiable`` only as
            False.

    A class of ``torchao.optim`` (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, ...) is
    handed to :func:`~fasttorch.optim.lowbit.from_torchao`, which runs torchao's own
    kernel over its quantized states.

    Returns:
        A :class:`TorchOptimizer` (a :class:`~fasttorch.optim.lowbit.TorchaoOptimizer`
        for a torchao class).

    Raises:
        ValueError: for LBFGS (needs a closure) and SparseAdam (sparse gradients), for
            ``capturable=True``/``differentiable=True``, for SGD with momentum and
            dampening, and for what torch itself refuses (``TrainState.create`` also
            raises torch's error for a parameter the class refuses).
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
        >>> fasttorch.optim.from_torch(torch.optim.Adadelta).lr  # torch's default
        1.0
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"from_torch expects a torch.optim class such as torch.optim.AdamW, got {cls!r}"
        )
    if is_torchao_optimizer(cls):  # torchao's low-bit Adam/AdamW: fasttorch.optim.lowbit
        if isinstance(lr, Tensor):
            raise TypeError(f"from_torch({cls.__name__}): pass lr as a float or a schedule")
        return from_torchao(cls, lr, **hyperparams)
    if lr is None:  # LBFGS and SparseAdam are refused before lr matters
        lr = _default_lr(cls) if cls.__name__ in ALGORITHMS else 1e-3
    return TorchOptimizer(cls, lr, _options(hyperparams))


def _options(hyperparams: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Sorted pairs, lists (``betas=[0.9, 0.99]``) as tuples: the optimizer is static
    configuration of the state, compared and hashed by the compiler's guards."""
    return tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in hyperparams.items())
    )
