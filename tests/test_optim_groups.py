"""groups' module selectors against the grouping code people use, with torch.optim.AdamW.

Three ways torch users build "no weight decay on biases and normalization layers",
ported below from their sources at the size of a test (the logic as written there, the
parts these tests do not use left out, each cited): torchvision's ``set_weight_decay``,
timm's ``param_groups_weight_decay`` and nanoGPT's ``configure_optimizers``. Each test
checks that ``fasttorch.optim.groups`` puts every parameter in a group with the same
weight decay, then trains both for several steps.

Tolerance rule. Rule 1 (tests/README.md): fasttorch's ``adamw`` runs the operations of
``torch.optim.AdamW(foreach=True, capturable=True)`` with a tensor lr (tests/test_optim.py
holds them to the same bits), each group's update is the same optimizer on its own
parameters, and an eager fasttorch step computes the gradients with the same kernels as
``loss.backward()``: parameters equal bit for bit, with the hyperparameters given to
torch as the state holds them (float32). The compiled step (aot_eager) runs the eager
step's operations: equal to the eager one bit for bit.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Collection, Iterator
from typing import Any

import pytest
import torch
from reference import capturable_on_cpu as allow_capturable_on_cpu
from reference import f32
from tolerance import EXACT
from torch import nn

import fasttorch
from fasttorch import optim, schedules

LR = 0.01
STEPS = 4


WD = f32(0.05)


class Net(nn.Module):
    """An embedding (rows 6..9 never read: their gradient is 0), a LayerNorm, a linear
    layer with bias, a BatchNorm, a head without bias and a 2-d positional parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.pos = nn.Parameter(torch.randn(1, 6) * 0.1)
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(idx).mean(1) + self.pos)
        return self.head(torch.relu(self.bn(self.fc(h))))


def _loss(apply: Callable[..., torch.Tensor], batch: Any) -> torch.Tensor:
    idx, y = batch
    return nn.functional.mse_loss(apply(idx), y)


def _data(steps: int) -> list[Any]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randint(0, 6, (8, 5), generator=g), torch.randn(8, 3, generator=g))
        for _ in range(steps)
    ]


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


# ---------------------------------------------------------------- the ported code


def torchvision_set_weight_decay(
    model: nn.Module,
    weight_decay: float,
    norm_weight_decay: float | None = None,
    norm_classes: list[type] | None = None,
    custom_keys_weight_decay: list[tuple[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """torchvision ``references/classification/utils.py``, ``set_weight_decay``
    (https://github.com/pytorch/vision/blob/d3beb52a00e16c71e821e192bcc592d614a490c0/references/classification/utils.py#L405,
    BSD-3-Clause). Its default ``norm_classes`` name torch's private ``_BatchNorm`` and
    ``_InstanceNorm``; the tests pass the classes instead."""
    norm_classes = tuple(norm_classes or ())
    params: dict[str, list[nn.Parameter]] = {"other": [], "norm": []}
    params_weight_decay: dict[str, float | None] = {
        "other": weight_decay,
        "norm": norm_weight_decay,
    }
    custom_keys = []
    if custom_keys_weight_decay is not None:
        for key, weight_decay in custom_keys_weight_decay:
            params[key] = []
            params_weight_decay[key] = weight_decay
            custom_keys.append(key)

    def _add_params(module: nn.Module, prefix: str = "") -> None:
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_custom_key = False
            for key in custom_keys:
                target_name = f"{prefix}.{name}" if prefix != "" and "." in key else name
                if key == target_name:
                    params[key].append(p)
                    is_custom_key = True
                    break
            if not is_custom_key:
                if norm_weight_decay is not None and isinstance(module, norm_classes):
                    params["norm"].append(p)
                else:
                    params["other"].append(p)

        for child_name, child_module in module.named_children():
            child_prefix = f"{prefix}.{child_name}" if prefix != "" else child_name
            _add_params(child_module, prefix=child_prefix)

    _add_params(model)

    param_groups = []
    for key in params:
        if len(params[key]) > 0:
            param_groups.append({"params": params[key], "weight_decay": params_weight_decay[key]})
    return param_groups


def timm_param_groups_weight_decay(
    model: nn.Module,
    weight_decay: float = 1e-5,
    no_weight_decay_list: Collection[str] = (),
) -> list[dict[str, Any]]:
    """timm ``timm/optim/_param_groups.py``, ``param_groups_weight_decay``
    (https://github.com/huggingface/pytorch-image-models, Apache-2.0), without its
    ``simple_params_list`` (a second optimizer's parameters, unused here)."""

    def _matches_pattern(name: str, patterns: Collection[str]) -> bool:
        return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)

    decay = []
    no_decay = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matches_pattern = _matches_pattern(name, no_weight_decay_list)
        if param.ndim <= 1 or name.endswith(".bias") or matches_pattern:
            no_decay.append(param)
        else:
            decay.append(param)

    groups = []
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    return groups


def nanogpt_optim_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT ``model.py``, ``GPT.configure_optimizers``, its groups
    (https://github.com/karpathy/nanoGPT/blob/master/model.py, MIT)."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    return [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]


# ------------------------------------------------------------------- the tests

NORMS: list[type] = list(optim.NORMALIZATION)

CASES: dict[str, tuple[Callable[[nn.Module], list[dict[str, Any]]], list[Any]]] = {
    # torchvision: custom keys first (bias, then the positional parameter), then norms.
    "torchvision": (
        lambda m: torchvision_set_weight_decay(
            m,
            WD,
            norm_weight_decay=0.0,
            norm_classes=NORMS,
            custom_keys_weight_decay=[("bias", 0.0), ("pos", 0.0)],
        ),
        [
            (optim.is_bias, {"weight_decay": 0.0}),
            ("pos", {"weight_decay": 0.0}),
            (optim.in_module(*optim.NORMALIZATION), {"weight_decay": 0.0}),
        ],
    ),
    # torchvision's norm_classes with the embedding added: no decay on embeddings either.
    "torchvision_embeddings": (
        lambda m: torchvision_set_weight_decay(
            m, WD, norm_weight_decay=0.0, norm_classes=[*NORMS, nn.Embedding]
        ),
        [(optim.in_module(*optim.NORMALIZATION, *optim.EMBEDDINGS), {"weight_decay": 0.0})],
    ),
    "timm": (
        lambda m: timm_param_groups_weight_decay(m, WD, no_weight_decay_list=["pos"]),
        [
            (
                lambda n, p: p.ndim <= 1 or optim.is_bias(n, p) or fnmatch.fnmatch(n, "pos"),
                {"weight_decay": 0.0},
            )
        ],
    ),
    "nanogpt": (
        lambda m: nanogpt_optim_groups(m, WD),
        [(lambda n, p: p.dim() < 2, {"weight_decay": 0.0})],
    ),
}

EXPECTED_NO_DECAY = {
    "torchvision": {"pos", "norm.weight", "norm.bias", "fc.bias", "bn.weight", "bn.bias"},
    "torchvision_embeddings": {"embed.weight", "norm.weight", "norm.bias", "bn.weight", "bn.bias"},
    "timm": {"pos", "norm.weight", "norm.bias", "fc.bias", "bn.weight", "bn.bias"},
    "nanogpt": {"norm.weight", "norm.bias", "fc.bias", "bn.weight", "bn.bias"},
}


@pytest.fixture
def capturable_on_cpu() -> Iterator[None]:
    """torch's capturable Adam on CPU tensors, outside torch.compile (tests/reference.py)."""
    with allow_capturable_on_cpu():
        yield


def _decay_by_name(model: nn.Module, torch_groups: list[dict[str, Any]]) -> dict[str, float]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g in torch_groups:
        for p in g["params"]:
            assert by_id[id(p)] not in out  # each parameter in one group
            out[by_id[id(p)]] = g["weight_decay"]
    return out


@pytest.mark.usefixtures("capturable_on_cpu")
@pytest.mark.parametrize("lr", [LR, 0.0, "warmup"], ids=["lr", "lr0", "warmup_from_0"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_groups_equal_the_grouping_code_people_use(case: str, lr: float | str) -> None:
    build_torch_groups, rules = CASES[case]
    schedule = schedules.linear_warmup(LR, 3) if lr == "warmup" else None
    model = _model()
    ref = copy.deepcopy(model)
    torch_groups = build_torch_groups(ref)
    want = _decay_by_name(ref, torch_groups)
    assert {n for n, wd in want.items() if wd == 0.0} == EXPECTED_NO_DECAY[case]

    opt = optim.groups(optim.adamw(schedule or lr, weight_decay=WD), rules)
    state = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    where = opt.assign(state.params, state.module)
    got = {n: float(opt.optimizers[i].weight_decay) for n, i in where.items()}  # type: ignore[attr-defined]
    assert got == want
    assert where == {n: i for i, names in enumerate(state.opt_state.names) for n in names}

    lr_of = (lambda k: float(schedule(torch.tensor(k)))) if schedule else (lambda k: lr)
    twin = torch.optim.AdamW(  # a donated CPU step's twin: torch's fused kernel
        torch_groups,
        lr=torch.tensor(lr_of(0)),
        betas=(f32(0.9), f32(0.999)),
        eps=f32(1e-8),
        fused=True,
    )
    data = _data(STEPS)
    for k, (idx, y) in enumerate(data):
        for g in twin.param_groups:
            g["lr"].fill_(lr_of(k))
        nn.functional.mse_loss(ref(idx), y).backward()
        twin.step()
        twin.zero_grad(set_to_none=True)
    eager = state
    compiled = fasttorch.TrainState.create(copy.deepcopy(model), opt)
    step = fasttorch.step(_loss)
    fast = fasttorch.compiled(fasttorch.step(_loss), backend="aot_eager")
    for batch in data:
        eager, _ = step(eager, batch)
        compiled, _ = fast(compiled, batch)
    for n, p in ref.named_parameters():
        assert bool(eager.params[n].isfinite().all()), n
        torch.testing.assert_close(eager.params[n], p.detach(), **EXACT, msg=f"{case}: {n}")
        torch.testing.assert_close(compiled.params[n], eager.params[n], **EXACT, msg=n)
        if lr == 0.0:  # nothing moves at lr 0, decay included (1 - 0 * wd)
            torch.testing.assert_close(p.detach(), dict(model.named_parameters())[n].detach())


def test_module_selectors_need_the_module() -> None:
    """A module selector reads the module; a state built from parameters alone cannot
    choose the groups: a clear error when it is built, naming the fix."""
    model = _model()
    opt = optim.groups(optim.adamw(LR), [(optim.in_module(nn.LayerNorm), {"weight_decay": 0.0})])
    params = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"in_module\(LayerNorm\).*TrainState\.create"):
        opt.init(params)
    state = opt.init(params, module=model)
    assert state.names[1] == ("norm.weight", "norm.bias")
    with pytest.raises(ValueError, match="'embed.weight', and Sequential has no submodule 'embed'"):
        opt.init(params, module=nn.Sequential(nn.LayerNorm(6)))
    with pytest.raises(TypeError, match="nn.Module classes"):
        optim.in_module(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module classes"):
        optim.in_module()
    inner = optim.groups(optim.adamw(LR), [(optim.in_module(nn.LayerNorm), {"lr": 0.1})])
    with pytest.raises(TypeError, match="inner groups chooses its parameters inside the step"):
        optim.groups(optim.sgd(LR), [("norm.*", inner)])


def test_with_module_reads_the_owning_module() -> None:
    """``with_module``'s predicate gets the submodule the parameter is registered on."""
    model = _model()
    seen: dict[str, type] = {}

    def record(name: str, p: torch.Tensor, module: nn.Module) -> bool:
        seen[name] = type(module)
        return isinstance(module, nn.Linear) and p.ndim == 2

    opt = optim.groups(optim.adamw(LR), [(optim.with_module(record), {"lr": 0.1})])
    state = fasttorch.TrainState.create(model, opt)
    assert state.opt_state.names[1] == ("fc.weight", "head.weight")
    assert seen == {
        "embed.weight": nn.Embedding,
        "pos": Net,
        "norm.weight": nn.LayerNorm,
        "norm.bias": nn.LayerNorm,
        "fc.weight": nn.Linear,
        "fc.bias": nn.Linear,
        "bn.weight": nn.BatchNorm1d,
        "bn.bias": nn.BatchNorm1d,
        "head.weight": nn.Linear,
    }
