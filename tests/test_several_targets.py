"""Target networks: a Frozen member that follows a trained one by polyak averaging.

The DQN loop keeps ``target = copy.deepcopy(q)`` and, every ``k`` updates of ``q``,
moves it towards ``q``: ``t.data.mul_(1 - tau).add_(tau * p.data)``. The TD target
reads the target network, and a proximal term reads its parameters directly. Here the
target is ``Frozen.create(copy.deepcopy(q), follows="q", tau=..., every=k)``, updated
inside the step, read through ``models["target"]`` and ``models["target"].params``,
and saved and resumed with the rest of the state.
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
from fasttorch.checkpoint import latest_models, load_models, save_models

LR = 2.0**-7  # a power of two: the same number as a Python float and as a float32
TAU, EVERY, GAMMA, PROX = 0.25, 2, 0.875, 0.125


def q_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def transitions(k: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(8, 4, generator=gen),
            torch.randint(0, 3, (8,), generator=gen),
            torch.randn(8, generator=gen),
            torch.randn(8, 4, generator=gen),
        )
        for _ in range(k)
    ]


def dqn_loop(q0: nn.Module, batches: Sequence[Any]) -> tuple[nn.Module, nn.Module, list[float]]:
    """The plain DQN update with a polyak-averaged target network, on deep copies."""
    q = copy.deepcopy(q0)
    target = copy.deepcopy(q0)
    opt = torch.optim.Adam(q.parameters(), lr=LR)
    log = []
    for i, (obs, act, rew, nxt) in enumerate(batches):
        with torch.no_grad():
            td = rew + GAMMA * target(nxt).max(-1).values
        q_sa = q(obs).gather(1, act[:, None]).squeeze(1)
        loss = nn.functional.mse_loss(q_sa, td)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (i + 1) % EVERY == 0:
            for t, p in zip(target.parameters(), q.parameters()):
                t.data.mul_(1 - TAU).add_(TAU * p.data)
        log.append(float(loss.detach()))
    return q, target, log


def q_loss(apply: Any, batch: Any, models: Any) -> Any:
    obs, act, rew, nxt = batch
    w = models["target"].params  # another member's parameters, read directly (detached)
    hidden = torch.relu(nn.functional.linear(nxt, w["0.weight"], w["0.bias"]))
    td = rew + GAMMA * nn.functional.linear(hidden, w["2.weight"], w["2.bias"]).max(-1).values
    q_sa = apply(obs).gather(1, act[:, None]).squeeze(1)
    return nn.functional.mse_loss(q_sa, td)


def q_loss_forward(apply: Any, batch: Any, models: Any) -> Any:
    obs, act, rew, nxt = batch
    td = rew + GAMMA * models["target"](nxt).max(-1).values  # the target's forward
    q_sa = apply(obs).gather(1, act[:, None]).squeeze(1)
    return nn.functional.mse_loss(q_sa, td)


def make_state(q0: nn.Module, opt: Any = None) -> fasttorch.Models:
    return fasttorch.Models.create(
        q=fasttorch.TrainState.create(
            copy.deepcopy(q0), opt if opt is not None else optim.from_torch(torch.optim.Adam, lr=LR)
        ),
        target=fasttorch.Frozen.create(copy.deepcopy(q0), follows="q", tau=TAU, every=EVERY),
    )


def run(step: Any, state: fasttorch.Models, batches: Sequence[Any]) -> Any:
    log = []
    for b in batches:
        state, m = step(state, b)
        log.append(float(m["q"]["loss"]))
    return state, log


def assert_equal(ours: dict[str, torch.Tensor], ref: nn.Module) -> None:
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours[k], v, **EXACT, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("loss_fn", [q_loss, q_loss_forward], ids=["params", "forward"])
@pytest.mark.parametrize("donate", [True, False], ids=["donated", "copying"])
def test_target_network_equals_the_dqn_loop_bit_for_bit(loss_fn: Any, donate: bool) -> None:
    q0 = q_net()
    batches = transitions(5)
    ref_q, ref_target, ref_log = dqn_loop(q0, batches)
    step = fasttorch.several({"q": fasttorch.model_step(loss_fn, donate=donate)})
    state = make_state(q0)
    first = state
    state, log = run(step, state, batches)
    assert_equal(state["q"].params, ref_q)
    target = state["target"]
    assert isinstance(target, fasttorch.Frozen)
    assert_equal(target.tensors, ref_target)
    assert log == ref_log  # the same bits: the TD targets read the same target network
    if not donate:  # the input state's target network is as it was
        assert_equal(first["target"].tensors, q0)


def test_target_network_compiled_equals_eager_bit_for_bit() -> None:
    q0 = q_net()
    batches = transitions(5)
    step = fasttorch.several({"q": fasttorch.model_step(q_loss)})
    eager, _ = run(step, make_state(q0, optim.adam(LR)), batches)
    counters = torch._dynamo.utils.counters
    counters.clear()
    fast, _ = run(
        fasttorch.compiled(step, backend="aot_eager"), make_state(q0, optim.adam(LR)), batches
    )
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0 and not counters["graph_break"]
    for k, t in eager["target"].tensors.items():
        torch.testing.assert_close(fast["target"].tensors[k], t, **EXACT)
    for k, p in eager["q"].params.items():
        torch.testing.assert_close(fast["q"].params[k], p, **EXACT)


def test_target_network_is_saved_and_resumed_bit_for_bit(tmp_path: Any) -> None:
    q0 = q_net()
    batches = transitions(5)
    step = fasttorch.several({"q": fasttorch.model_step(q_loss)})
    whole, _ = run(step, make_state(q0), batches)
    state, _ = run(step, make_state(q0), batches[:3])  # stops between two target updates
    save_models(tmp_path, state)
    resumed, _ = load_models(tmp_path, latest_models(tmp_path), make_state(q_net(seed=5)))
    resumed, _ = run(step, resumed, batches[3:])
    for k, t in whole["target"].tensors.items():
        torch.testing.assert_close(resumed["target"].tensors[k], t, **EXACT)
    for k, p in whole["q"].params.items():
        torch.testing.assert_close(resumed["q"].params[k], p, **EXACT)


def test_target_network_errors_are_raised_at_create_time() -> None:
    q0 = q_net()
    with pytest.raises(ValueError, match=r"tau must be in \(0, 1\].*got tau=0"):
        fasttorch.Frozen.create(copy.deepcopy(q0), follows="q", tau=0)
    with pytest.raises(ValueError, match=r"every must be an integer >= 1, got 0"):
        fasttorch.Frozen.create(copy.deepcopy(q0), follows="q", every=0)
    with pytest.raises(ValueError, match=r"name the member it follows"):
        fasttorch.Frozen.create(copy.deepcopy(q0), tau=0.5)
    trained = fasttorch.TrainState.create(copy.deepcopy(q0), optim.sgd(LR))
    with pytest.raises(ValueError, match=r"follows 'p', which is missing"):
        fasttorch.Models.create(q=trained, t=fasttorch.Frozen.create(q_net(), follows="p"))
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"their tensors differ"):
        fasttorch.Models.create(q=trained, t=fasttorch.Frozen.create(other, follows="q"))


def test_a_loss_reads_a_trained_members_parameters_and_buffers() -> None:
    seen: dict[str, Any] = {}

    def student_loss(apply: Any, batch: Any, models: Any) -> Any:
        seen["params"], seen["buffers"] = models["teacher"].params, models["teacher"].buffers
        x, y = batch
        return nn.functional.mse_loss(apply(x), y)

    def teacher_loss(apply: Any, batch: Any, models: Any) -> Any:
        x, y = batch
        return nn.functional.mse_loss(apply(x), y)

    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    state = fasttorch.Models.create(
        teacher=fasttorch.TrainState.create(teacher, optim.sgd(LR)),
        student=fasttorch.TrainState.create(nn.Linear(4, 3), optim.sgd(LR)),
    )
    step = fasttorch.several(
        {
            "teacher": fasttorch.model_step(teacher_loss),
            "student": fasttorch.model_step(student_loss),
        }
    )
    state, _ = step(state, (torch.randn(8, 4), torch.randn(8, 3)))
    t = state["teacher"]
    assert isinstance(t, fasttorch.TrainState)
    assert sorted(seen["params"]) == sorted(t.params) and sorted(seen["buffers"]) == sorted(
        t.buffers
    )
    for k, p in seen["params"].items():  # the teacher as just updated, detached
        assert not p.requires_grad
        torch.testing.assert_close(p, t.params[k], **EXACT)
