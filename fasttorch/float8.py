"""Float8 training with torchao: :func:`convert` the linear layers, :func:`with_float8` the step.

torchao's ``Float8Linear`` casts a linear layer's input, weight and output gradient to
float8 with dynamic scales (computed from each tensor's ``max |x|`` in the forward and
backward) and multiplies them with ``torch._scaled_mm``; the parameters stay in their
own dtype, so the optimizer, clipping, EMA and checkpoints see ordinary tensors. The
layer keeps no state between calls, so a step over a converted module stays pure. Two
parts, as torchtitan's float8 converter has two (``convert`` and its
``post_optimizer_hook``):

* :func:`convert`: swaps the chosen ``nn.Linear`` layers for ``Float8Linear`` (in place,
  before ``TrainState.create`` and before ``fully_shard``), with torchao's recipes
  (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``), torchtitan's filter
  (``filter_fqns``; layers whose dimensions are not multiples of 16 stay in high
  precision) and FSDP2's float8 all-gather;
* :func:`with_float8`: the step part. It checks, before the first call, that the
  state's module was converted and that its device computes float8 matrix products;
  under FSDP2 with float8 all-gather it computes every float8 weight's scale in one
  all-reduce before each call's forward (torchao's
  ``precompute_float8_dynamic_scale_for_fsdp``, which torchtitan runs after the
  optimizer step: the same values, since nothing changes the weights in between, and
  also right for a state just loaded from a checkpoint).

torchao is an optional dependency: ``pip install "fasttorch[ao]"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

from fasttorch._checks import warn_once
from fasttorch.state import TrainState, is_sharded
from fasttorch.steps import Step, check_wrap

__all__ = ["RECIPES", "convert", "float8_layers", "matmul_support", "with_float8"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's recipe names (``Float8LinearConfig.from_recipe_name``)."""

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]

INSTALL = 'pip install "fasttorch[ao]"'

# torch._scaled_mm needs both dimensions of the weight to be multiples of 16.
_ALIGN = 16


def _torchao(api: str) -> ModuleType:
    """``torchao.float8``, or an ``ImportError`` that says how to install it."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as e:
        raise ImportError(
            f"{api}: float8 training runs torchao's Float8Linear, and torchao is not "
            f"installed ({e}). Install it with {INSTALL} (torchao>=0.18), or leave "
            "float8 out of the step"
        ) from e


def matmul_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` multiplies float8 matrices (``torch._scaled_mm``), and why.

    CUDA needs compute capability 8.9 or more (Ada, Hopper and later). A CPU has no
    float8 matrix products: there torchao's emulation (``emulate=True``: the scaled
    products computed in float32, the float8 rounding kept) trains, for tests.

    Example:
        >>> from fasttorch import float8
        >>> float8.matmul_support("cpu")[0]
        False
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available in this process"
        cap = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if cap >= (8, 9):
            return True, f"{name} (compute capability {cap[0]}.{cap[1]}) has float8 tensor cores"
        return False, (
            f"{name} has compute capability {cap[0]}.{cap[1]}; float8 matrix products "
            "need 8.9 or more (Ada, Hopper and later)"
        )
    if device.type == "meta":
        return True, "a meta tensor holds no data; the device is checked at the first step"
    return False, f"torch has no float8 matrix products on {device.type!r} devices"


def _check_device(api: str, device: torch.device, emulate: bool) -> None:
    ok, why = matmul_support(device)
    if not (ok or emulate):
        raise ValueError(
            f"{api}: the float8 layers are on {device}, where float8 cannot run: {why}. "
            "Train on a GPU of compute capability 8.9 or more (H100, L4, RTX 4090), or "
            "convert with emulate=True (float32 products with float8 rounding: for "
            "testing numerics, not speed)"
        )


def _config(ao: ModuleType, recipe: str, emulate: bool, all_gather: bool) -> Any:
    if recipe not in RECIPES:
        raise ValueError(
            f"float8.convert: recipe must be one of {', '.join(map(repr, RECIPES))} "
            f"(torchao's names), got {recipe!r}"
        )
    if all_gather and recipe != "tensorwise":
        raise ValueError(
            f"float8.convert: enable_fsdp_float8_all_gather=True needs recipe='tensorwise', "
            f"got {recipe!r}: the weight is cast to float8 with one scale per tensor before "
            "FSDP2 gathers it, and the rowwise recipes scale each row of each operand "
            "differently. Use recipe='tensorwise', or gather in high precision "
            "(enable_fsdp_float8_all_gather=False)"
        )
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def _misaligned(layer: nn.Linear) -> bool:
    return layer.in_features % _ALIGN != 0 or layer.out_features % _ALIGN != 0


def _chosen(
    module: nn.Module,
    filter_fqns: Sequence[str],
    module_filter_fn: Callable[[nn.Module, str], bool] | None,
) -> tuple[list[str], list[str]]:
    """The linear layers to convert, and those left in high precision for their shape."""
    chosen, misaligned = [], []
    for fqn, m in module.named_modules():
        if not isinstance(m, nn.Linear) or any(f in fqn for f in filter_fqns):
            continue
        if module_filter_fn is not None:
            if not module_filter_fn(m, fqn):
                continue
            if _misaligned(m):
                raise ValueError(
                    f"float8.convert: module_filter_fn chose {fqn or 'the root'!r} "
                    f"(Linear {m.in_features} -> {m.out_features}), which float8 cannot "
                    f"take: float8 matrix products need in_features and out_features to "
                    f"be multiples of {_ALIGN}. Leave it out in module_filter_fn (or in "
                    "filter_fqns), or pad the layer"
                )
        elif _misaligned(m):
            misaligned.append(fqn)
            continue
        chosen.append(fqn)
    return chosen, misaligned


def convert(
    module: nn.Module,
    recipe: Recipe = "tensorwise",
    *,
    filter_fqns: Sequence[str] = ("output",),
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    emulate: bool = False,
    enable_fsdp_float8_all_gather: bool = False,
) -> nn.Module:
    """Swap ``module``'s linear layers for torchao's ``Float8Linear``, in place.

    Call it on the model before ``TrainState.create`` (and before ``fully_shard``): the
    layers keep their parameters (the same tensors, under the same names), so the state,
    the optimizer and checkpoints are those of the plain model. A layer is converted
    unless its name contains one of ``filter_fqns`` (torchtitan's rule; by default
    the output head, ``"output"``) or ``module_filter_fn(layer, fqn)`` says no. A
    layer whose dimensions are not multiples of 16 stays in high precision with a
    warning saying so, unless ``module_filter_fn`` chose it, which is an error.

    Equivalent to::

        config = Float8LinearConfig.from_recipe_name(recipe)
        config = dataclasses.replace(config, emulate=emulate,
                                     enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)
        torchao.float8.convert_to_float8_training(
            module, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)

    Args:
        module: the model (its root may not itself be a ``Linear``).
        recipe: torchao's recipe: ``"tensorwise"`` (one scale per tensor; the fastest),
            ``"rowwise"`` (one scale per row; more accurate),
            ``"rowwise_with_gw_hp"`` (rowwise, the weight gradient in high precision).
        filter_fqns: layers whose qualified name contains one of these stay as they are.
        module_filter_fn: ``(layer, fqn) -> bool``, torchao's filter, applied after
            ``filter_fqns``.
        emulate: compute the scaled products in float32 (the float8 rounding kept): runs
            on any device, for tests; the only way on a CPU.
        enable_fsdp_float8_all_gather: FSDP2 gathers the float8 weights (half the bytes
            of bf16); ``"tensorwise"`` only. Wrap the step in :func:`with_float8` so
            their scales are computed in one all-reduce.

    Returns:
        ``module``, converted.

    Raises:
        ImportError: torchao is not installed (``pip install "fasttorch[ao]"``).
        ValueError: an unknown recipe, float8 all-gather with a rowwise recipe, no
            layer to convert, a chosen layer of the wrong shape, a module already
            converted or already sharded, or a device without float8 matrix products
            and ``emulate=False``.

    Example:
        >>> import pytest; ao = pytest.importorskip("torchao")
        >>> import torch, fasttorch
        >>> from fasttorch import float8
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
        ...                             torch.nn.Linear(32, 16))
        >>> model = float8.convert(model, "tensorwise", emulate=True)
        >>> float8.float8_layers(model)
        ['0', '2']
        >>> state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(1e-3))
        >>> step = float8.with_float8(fasttorch.step(lambda apply, x: apply(x).pow(2).mean()))
        >>> state, metrics = step(state, torch.randn(8, 16))
    """
    ao = _torchao("float8.convert")
    if not isinstance(module, nn.Module):
        raise TypeError(f"float8.convert expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.Linear):
        raise ValueError(
            "float8.convert: the root module is a Linear, which cannot be swapped in "
            "place; wrap it in a module (nn.Sequential(linear)) and convert that"
        )
    done = float8_layers(module)
    if done:
        raise ValueError(
            f"float8.convert: the module already has float8 layers ({', '.join(done[:3])}"
            f"{', ...' if len(done) > 3 else ''}); convert it once"
        )
    if _sharded_now(module):
        raise ValueError(
            "float8.convert: the module is already sharded with FSDP2 (fully_shard); "
            "convert it first, then shard it, as torchtitan does: FSDP2 must see the "
            "float8 layers' weights to gather them in float8"
        )
    if isinstance(filter_fqns, str):
        raise TypeError(
            f"float8.convert: filter_fqns must be a sequence of names, got the string "
            f"{filter_fqns!r}; write filter_fqns=({filter_fqns!r},)"
        )
    config = _config(ao, recipe, emulate, enable_fsdp_float8_all_gather)
    chosen, misaligned = _chosen(module, tuple(filter_fqns), module_filter_fn)
    if not chosen:
        raise ValueError(
            f"float8.convert: no linear layer of {type(module).__name__} to convert "
            f"(filter_fqns={tuple(filter_fqns)!r}; left out for their shape: "
            f"{misaligned or 'none'}). float8 applies to nn.Linear layers whose "
            f"dimensions are multiples of {_ALIGN}"
        )
    layers = dict(module.named_modules())
    for device in sorted({layers[f].weight.device for f in chosen}, key=str):
        _check_device("float8.convert", device, emulate)
    if misaligned:
        warn_once(
            f"float8.convert: {len(misaligned)} linear layer(s) stay in high precision "
            f"because float8 matrix products need dimensions that are multiples of "
            f"{_ALIGN}: {', '.join(misaligned[:5])}{', ...' if len(misaligned) > 5 else ''}. "
            "Pass filter_fqns to leave them out explicitly"
        )
    names = set(chosen)
    ao.convert_to_float8_training(
        module, config=config, module_filter_fn=lambda m, fqn: fqn in names
    )
    return module


def _sharded_now(module: nn.Module) -> bool:
    # Not fasttorch.state.is_sharded, which remembers its answer per module: the module
    # converted here is sharded next.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", ())
    return any(isinstance(m, kind) for m in module.modules())


def float8_layers(module: nn.Module) -> list[str]:
    """The qualified names of ``module``'s torchao ``Float8Linear`` layers (``[]`` if
    torchao was never imported)."""
    found = sys.modules.get("torchao.float8.float8_linear")
    cls = getattr(found, "Float8Linear", None)
    if cls is None:
        return []
    return [fqn for fqn, m in module.named_modules() if isinstance(m, cls)]


class _Float8Hook:
    """Before each call: the checks (once per module), then the FSDP2 scales."""

    def __init__(self, precompute: bool) -> None:
        self.precompute = precompute
        self.checked: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    def before(self, step: Step, state: TrainState) -> None:
        module = state.module
        gathers = self.checked.get(module)
        if gathers is None:
            gathers = self.checked[module] = _check_module(step, module, state.device)
        if gathers and self.precompute:
            ao = importlib.import_module("torchao.float8")
            # One all-reduce of every float8 weight's max |w| (as torchtitan does after
            # the optimizer step); FSDP2's pre-all-gather then casts with these scales.
            ao.precompute_float8_dynamic_scale_for_fsdp(module)

    def after(self, step: Step, new: TrainState) -> None:
        pass


def _check_module(step: Step, module: nn.Module, device: torch.device) -> bool:
    """Raise unless ``module`` has float8 layers on a device that runs them; return
    whether FSDP2 gathers any of their weights in float8."""
    api = f"with_float8 (step {step.name!r})"
    fqns = float8_layers(module)
    if not fqns:
        raise ValueError(
            f"{api}: the state's module ({type(module).__name__}) has no float8 layers. "
            "Convert the model before building its state: "
            "model = fasttorch.float8.convert(model, 'tensorwise'); "
            "state = fasttorch.TrainState.create(model, opt)"
        )
    layers = dict(module.named_modules())
    gathers = False
    for fqn in fqns:
        layer = layers[fqn]
        _check_device(api, layer.weight.device, layer.config.emulate)
        gathers = gathers or layer.config.enable_fsdp_float8_all_gather
        high = layer.config.cast_config_input_for_grad_weight.scaling_type.value == "disabled"
        if high and device.type == "cpu" and "with_amp" in step.transforms:
            raise ValueError(
                f"{api}: layer {fqn!r} (recipe 'rowwise_with_gw_hp') cannot train under "
                "with_amp on a CPU: torchao's Float8Linear follows CUDA's autocast only, so "
                "its weight-gradient product, kept in high precision, would multiply the "
                "float32 input by a bf16 output gradient and fail in the backward (torchao's "
                "own loop fails the same way). On a CPU use recipe 'rowwise' or "
                "'tensorwise', or leave with_amp out; on a GPU this recipe works under it"
            )
    return gathers and is_sharded(module)


def with_float8(step: Step, *, precompute_fsdp_scales: bool = True) -> Step:
    """Train the float8 layers of a module converted by :func:`convert`.

    A converted module trains float8 by itself (its layers cast as they run); this
    transform adds what belongs to the step. Before the first call it checks that the
    state's module has float8 layers and that their device multiplies float8 matrices
    (or they emulate). When FSDP2 gathers the weights in float8
    (``enable_fsdp_float8_all_gather=True``), it computes every float8 weight's scale
    in one all-reduce before each call's forward, instead of one per weight during the
    all-gathers (``precompute_fsdp_scales``; torchtitan's
    ``float8.precompute_float8_dynamic_scale_for_fsdp``). Host-side and outside any
    graph: it composes with every transform, ``compiled`` included.

    Equivalent to::

        precompute_float8_dynamic_scale_for_fsdp(model)  # FSDP2 float8 all-gather only
        for batch in loader:
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            precompute_float8_dynamic_scale_for_fsdp(model)  # the same, once a step

    Args:
        step: a step built by :func:`fasttorch.step`, possibly transformed.
        precompute_fsdp_scales: compute the scales in one all-reduce (FSDP2 float8
            all-gather only; without it each weight's all-gather reduces its own).

    Raises:
        ImportError: torchao is not installed (``pip install "fasttorch[ao]"``).

    Example:
        >>> import pytest; ao = pytest.importorskip("torchao")
        >>> import torch, fasttorch
        >>> from fasttorch import float8
        >>> state = fasttorch.TrainState.create(torch.nn.Sequential(torch.nn.Linear(16, 16)),
        ...                                     fasttorch.optim.sgd(0.1))
        >>> step = float8.with_float8(fasttorch.step(lambda apply, x: apply(x).sum()))
        >>> step(state, torch.randn(4, 16))
        Traceback (most recent call last):
        ...
        ValueError: with_float8 (step '<lambda>'): the state's module (Sequential) has no ...
    """
    check_wrap(step, "with_float8")
    _torchao("with_float8")
    if not isinstance(precompute_fsdp_scales, bool):
        raise TypeError(
            "with_float8: precompute_fsdp_scales must be True or False, got "
            f"{precompute_fsdp_scales!r}"
        )
    return step.with_phases("with_float8", hooks=(*step.hooks, _Float8Hook(precompute_fsdp_scales)))
