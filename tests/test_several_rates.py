"""Members at their own rates: a WGAN-GP critic steps five times per generator step.

The plain loop updates the critic on every batch and the generator on every fifth.
``gan.only("d")`` is the call that steps the critic alone: the generator's loss does
not run (no forward, no gradient), its state stays as it is, and under ``compiled``
both kinds of call share the members' graphs (no recompile, whatever the pattern).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from tolerance import EXACT
from torch import nn

import fasttorch
from fasttorch import optim

LR = 2.0**-8  # a power of two: the same number as a Python float and as a float32
N_CRITIC, LAMBDA = 5, 10.0


def models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    g = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 4))
    d = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    return g, d


def batches(k: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(8, 4, generator=gen),  # real
            torch.randn(8, 3, generator=gen),  # z
            torch.rand(8, 1, generator=gen),  # the gradient penalty's interpolation weights
        )
        for _ in range(k)
    ]


def critic_objective(d: Any, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor) -> Any:
    """WGAN-GP's critic loss: Wasserstein estimate plus the gradient penalty."""
    mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(d(mixed).sum(), mixed, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return d(fake).mean() - d(real).mean() + LAMBDA * penalty


def wgan_loop(g0: nn.Module, d0: nn.Module, data: Sequence[Any]) -> tuple[nn.Module, nn.Module]:
    g, d = copy.deepcopy(g0), copy.deepcopy(d0)
    g_opt = torch.optim.Adam(g.parameters(), lr=LR, betas=(0.5, 0.9))
    d_opt = torch.optim.Adam(d.parameters(), lr=LR, betas=(0.5, 0.9))
    for i, (real, z, eps) in enumerate(data):
        fake = g(z).detach()
        d_loss = critic_objective(d, real, fake, eps)
        d_opt.zero_grad()
        d_loss.backward()
        d_opt.step()
        if (i + 1) % N_CRITIC == 0:
            for p in d.parameters():
                p.requires_grad_(False)
            g_loss = -d(g(z)).mean()
            g_opt.zero_grad()
            g_loss.backward()
            g_opt.step()
            for p in d.parameters():
                p.requires_grad_(True)
    return g, d


G_LOSS_CALLS: list[int] = []


def d_loss(apply: Any, batch: Any, models: Any) -> Any:
    real, z, eps = batch
    return critic_objective(apply, real, models["g"](z).detach(), eps)


def g_loss(apply: Any, batch: Any, models: Any) -> Any:
    G_LOSS_CALLS.append(1)
    real, z, eps = batch
    return -models["d"](apply(z)).mean()


def g_loss_plain(apply: Any, batch: Any, models: Any) -> Any:
    real, z, eps = batch
    return -models["d"](apply(z)).mean()


def opt() -> optim.Optimizer:
    return optim.from_torch(torch.optim.Adam, lr=LR, betas=(0.5, 0.9))


def state(g: nn.Module, d: nn.Module, make: Any = opt) -> fasttorch.Models:
    return fasttorch.Models.create(
        d=fasttorch.TrainState.create(copy.deepcopy(d), make()),
        g=fasttorch.TrainState.create(copy.deepcopy(g), make()),
    )


def train(gan: fasttorch.Several, s: fasttorch.Models, data: Sequence[Any]) -> fasttorch.Models:
    critic = gan.only("d")
    for i, b in enumerate(data):
        s, _ = (gan if (i + 1) % N_CRITIC == 0 else critic)(s, b)
    return s


def test_critic_at_five_steps_per_generator_step_equals_the_loop() -> None:
    g, d = models()
    data = batches(10)
    ref_g, ref_d = wgan_loop(g, d, data)
    gan = fasttorch.several({"d": fasttorch.model_step(d_loss), "g": fasttorch.model_step(g_loss)})
    G_LOSS_CALLS.clear()
    s = train(gan, state(g, d), data)
    assert len(G_LOSS_CALLS) == 2  # the generator's loss ran on its two calls only
    assert int(s["d"].step) == 10 and int(s["g"].step) == 2
    for tag, ref in (("d", ref_d), ("g", ref_g)):
        member = s[tag]
        assert isinstance(member, fasttorch.TrainState)
        for k, v in ref.named_parameters():
            torch.testing.assert_close(member.params[k], v.detach(), **EXACT)


def test_subsets_share_the_members_graphs_under_compiled() -> None:
    g, d = models()
    data = batches(10)
    gan = fasttorch.several(
        {"d": fasttorch.model_step(d_loss), "g": fasttorch.model_step(g_loss_plain)}
    )
    eager = train(gan, state(g, d, lambda: optim.adam(LR, betas=(0.5, 0.9))), data)
    counters = torch._dynamo.utils.counters
    counters.clear()
    fast = train(
        fasttorch.compiled(gan, backend="aot_eager"),
        state(g, d, lambda: optim.adam(LR, betas=(0.5, 0.9))),
        data,
    )
    assert counters["stats"]["unique_graphs"] == 2  # one per member, for both kinds of call
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    for tag in ("d", "g"):
        for k, p in eager[tag].params.items():
            torch.testing.assert_close(fast[tag].params[k], p, **EXACT)


def test_only_names_members_it_steps() -> None:
    gan = fasttorch.several({"d": fasttorch.model_step(d_loss), "g": fasttorch.model_step(g_loss)})
    with pytest.raises(ValueError, match=r"\['x'\] are not among them"):
        gan.only("x")
    with pytest.raises(ValueError, match=r"give one or more"):
        gan.only()
    assert gan.only("d").names == ["d", "g"] and gan.only("d").idle == ("g",)


def test_a_shared_forward_of_an_idle_member_runs_without_gradient() -> None:
    """The generator's forward as a shared output: on critic-only calls it runs for the
    critic (no graph kept), on full calls the generator also backpropagates through it.
    G is unchanged between its forward and its step, so this is the loop's arithmetic."""
    g, d = models()
    data = batches(10)
    ref_g, ref_d = wgan_loop(g, d, data)

    def d_shared(apply: Any, batch: Any, models: Any) -> Any:
        real, z, eps = batch
        return critic_objective(apply, real, models.outputs["fake"], eps)

    def g_shared(apply: Any, batch: Any, models: Any) -> Any:
        return -models["d"](models.outputs["fake"]).mean()

    gan = fasttorch.several(
        {"d": fasttorch.model_step(d_shared), "g": fasttorch.model_step(g_shared)},
        outputs={"fake": ("g", lambda apply, batch: apply(batch[1]))},
    )
    s = train(gan, state(g, d), data)
    for tag, ref in (("d", ref_d), ("g", ref_g)):
        member = s[tag]
        assert isinstance(member, fasttorch.TrainState)
        for k, v in ref.named_parameters():
            torch.testing.assert_close(member.params[k], v.detach(), **EXACT)
