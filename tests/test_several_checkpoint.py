"""Checkpoints, evaluation and the testing kit over a fasttorch.Models state."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_several import (
    LR,
    _tensors,
    d_loss,
    g_loss,
    gan_calls,
    gan_models,
    gan_state,
    hand_gan,
    kd_loss,
    loop_error,
)
from tolerance import EXACT, params_atol

import fasttorch
from fasttorch import optim
from fasttorch.checkpoint import latest_models, load_models, save_models


def _step() -> fasttorch.Several:
    def member(loss_fn: Any) -> fasttorch.Step:
        s = fasttorch.with_amp(fasttorch.model_step(loss_fn), "fp16")
        return fasttorch.ema(fasttorch.grad_accumulate(s, 2, across_calls=True), 0.9)

    return fasttorch.several({"d": member(d_loss), "g": member(g_loss)})


def test_resume_mid_window_is_bit_exact(tmp_path: Any) -> None:
    d, g = gan_models()
    calls = gan_calls(5)
    step = _step()
    straight = gan_state(d, g)
    for b in calls:
        straight, _ = step(straight, b)

    state = gan_state(d, g)
    for b in calls[:3]:  # stops inside the second window (a microbatch accumulated)
        state, _ = step(state, b)
    name = save_models(tmp_path, state, data={"call": 3})
    assert name == "step_000000001_micro1"
    assert latest_models(tmp_path) == name
    del state
    template = step.init(gan_state(*gan_models(seed=9)))  # other values, same shapes
    resumed, data = load_models(tmp_path, latest_models(tmp_path), template)
    assert data == {"call": 3}
    for b in calls[data["call"] :]:
        resumed, _ = step(resumed, b)
    for tag in ("d", "g"):
        a, b_ = straight[tag], resumed[tag]
        fasttorch.testing.assert_states_close(a, b_, **EXACT, what=f"member {tag}")


def test_plain_save_load_and_resume_take_a_models_state(tmp_path: Any) -> None:
    """checkpoint.save / load / resume on a Models state, as save_models / load_models:
    resumed mid-window, bit for bit."""
    d, g = gan_models()
    calls = gan_calls(5)
    step = _step()
    straight = gan_state(d, g)
    for b in calls:
        straight, _ = step(straight, b)

    state = gan_state(d, g)
    for b in calls[:3]:
        state, _ = step(state, b)
    path = fasttorch.checkpoint.save(tmp_path, state, data={"call": 3})
    assert path == tmp_path / "step_000000001_micro1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "g"]  # one per member
    assert latest_models(tmp_path) == path.name
    del state
    loaded, data = fasttorch.checkpoint.load(path, step.init(gan_state(*gan_models(seed=9))))
    fresh = step.init(gan_state(*gan_models(seed=9)))
    resumed, data_r = fasttorch.checkpoint.resume(tmp_path, fresh, data={"call": 0})
    assert data == data_r == {"call": 3}
    for b in calls[3:]:
        loaded, _ = step(loaded, b)
        resumed, _ = step(resumed, b)
    for tag in ("d", "g"):
        for got in (loaded, resumed):
            fasttorch.testing.assert_states_close(straight[tag], got[tag], **EXACT, what=tag)
    empty = step.init(gan_state(d, g))
    assert fasttorch.checkpoint.resume(tmp_path / "none", empty, data=0) == (empty, 0)


def test_checkpoint_entry_points_say_what_a_models_state_needs(tmp_path: Any) -> None:
    state = gan_state(*gan_models())
    with pytest.raises(TypeError, match=r"async_save takes one model's TrainState.*\['d', 'g'\]"):
        fasttorch.checkpoint.async_save(tmp_path, state)
    with pytest.raises(TypeError, match="export one member: export_safetensors"):
        fasttorch.checkpoint.export_safetensors(state, tmp_path / "m.safetensors")
    with pytest.raises(TypeError, match="TrainState or a fasttorch.Models state as its state"):
        fasttorch.checkpoint.save(tmp_path, {"d": state["d"]})
    path = fasttorch.checkpoint.save(tmp_path, state)
    with pytest.raises(TypeError, match="as its template, got dict"):
        fasttorch.checkpoint.load(path, {"d": state["d"]})
    with pytest.raises(TypeError, match="as its template, got int"):
        fasttorch.checkpoint.resume(tmp_path, 3)
    assert not (tmp_path / "m.safetensors").exists()
    # The path save returned names every member's checkpoint, not one to export.
    with pytest.raises(fasttorch.checkpoint.CheckpointError, match=r"several models .*/d/step_0+'"):
        fasttorch.checkpoint.model_state_dict(path)
    member = fasttorch.checkpoint.model_state_dict(tmp_path / "d" / path.name)
    assert set(member) == set(state["d"].module.state_dict())


def test_an_interrupted_save_resumes_from_the_last_name_every_member_has(tmp_path: Any) -> None:
    d, g = gan_models()
    state = gan_state(d, g)
    save_models(tmp_path, state, name="a_first")
    fasttorch.checkpoint.save(tmp_path / "d", state["d"], name="b_second")  # g never saved
    assert latest_models(tmp_path) == "a_first"
    with pytest.raises(fasttorch.checkpoint.CheckpointError, match="every member"):
        load_models(tmp_path / "nothing", latest_models(tmp_path / "nothing"), state)


def test_eval_step_on_one_member_changes_nothing() -> None:
    d, g = gan_models()
    state = gan_state(d, g)
    step = fasttorch.several({"d": fasttorch.model_step(d_loss), "g": fasttorch.model_step(g_loss)})
    before = {k: v.clone() for k, v in state["d"].buffers.items()}
    metrics = step.eval_step("g")(state, gan_calls(1)[0])
    real, z = gan_calls(1)[0]
    d_ref, g_ref = copy.deepcopy(d).eval(), copy.deepcopy(g).eval()
    with torch.no_grad():
        out = d_ref(g_ref(z))
        want = torch.nn.functional.binary_cross_entropy_with_logits(out, torch.ones_like(out))
    torch.testing.assert_close(metrics["loss"], want, **EXACT)
    for k, v in state["d"].buffers.items():
        torch.testing.assert_close(v, before[k], **EXACT)
    assert state["d"].module.training and state["g"].module.training
    with pytest.raises(KeyError, match="no step for member 'x'"):
        step.eval_step("x")


def test_check_step_accepts_a_step_over_several_models() -> None:
    d, g = gan_models()
    calls = gan_calls(4)

    def reference(models: Any, batches: Any) -> dict[str, torch.Tensor]:
        ref_d, ref_g, _ = hand_gan(models["d"], models["g"], batches)
        return {
            **{f"d.{k}": p for k, p in ref_d.named_parameters()},
            **{f"g.{k}": p for k, p in ref_g.named_parameters()},
        }

    def factory() -> fasttorch.Models:
        return gan_state(d, g)

    d_step = fasttorch.model_step(d_loss, donate=False)
    step = fasttorch.several({"d": d_step, "g": fasttorch.model_step(g_loss, donate=False)})
    checks = ("pure", "dtype", "composes", "compiles", "no_host_sync", "reference")
    errors = loop_error(d, g, calls)
    errors.pop("loss")
    atol = params_atol(errors, _tensors(factory()))  # rule 2
    report = fasttorch.testing.check_step(
        step, factory, calls, reference=reference, checks=checks, rtol=0, atol=atol
    )
    assert report == {c: "ok" for c in checks}


def test_check_step_composes_each_member_and_catches_a_broken_one() -> None:
    """``composes`` wraps every member's step in each transform; a member whose loss
    works on whole batches only (it divides by rows - 4) breaks under grad_accumulate."""
    d, g = gan_models(batchnorm=False)
    calls = gan_calls(2)

    def whole_batches_only(apply: Any, batch: Any, models: Any) -> Any:
        return d_loss(apply, batch, models) / (batch[0].shape[0] - 4)

    def factory() -> fasttorch.Models:
        return gan_state(d, g)

    def check(d_fn: Any, g_step: fasttorch.Step) -> dict[str, str]:
        step = fasttorch.several({"d": fasttorch.model_step(d_fn), "g": g_step})
        return fasttorch.testing.check_step(step, factory, calls, checks=("composes",))

    g_ema = fasttorch.ema(fasttorch.model_step(g_loss), 0.5)  # applied: wrapped once
    assert check(d_loss, g_ema) == {"composes": "ok"}
    with pytest.raises(AssertionError, match=r"composes.*grad_accumulate\(step of member 'd'\)"):
        check(whole_batches_only, fasttorch.model_step(g_loss))


def _student_and_teacher() -> fasttorch.Models:
    torch.manual_seed(0)
    return fasttorch.Models.create(
        student=fasttorch.TrainState.create(torch.nn.Linear(6, 5), optim.adam(LR)),
        teacher=fasttorch.Frozen.create(torch.nn.Linear(6, 5)),
    )


def test_frozen_members_are_saved_and_restored_bit_for_bit(tmp_path: Any) -> None:
    state = _student_and_teacher()
    step = fasttorch.several({"student": fasttorch.model_step(kd_loss)})
    state, _ = step(state, (torch.randn(4, 6), torch.randint(0, 5, (4,))))
    # A Frozen member whose weights moved (a target network, a teacher loaded later).
    moved = {k: t + torch.randn_like(t) for k, t in state["teacher"].tensors.items()}
    state = fasttorch.Models(
        members={**state.members, "teacher": state["teacher"].replace(tensors=moved)}
    )
    save_models(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]  # carried by it
    template = _student_and_teacher()
    loaded, _ = load_models(tmp_path, latest_models(tmp_path), template)
    assert sorted(loaded.members) == ["student", "teacher"]
    assert isinstance(loaded["teacher"], fasttorch.Frozen)
    assert "several.frozen" not in loaded["student"].substates
    fasttorch.testing.assert_states_close(loaded["teacher"].tensors, moved, **EXACT)
    trained = state["student"].params
    fasttorch.testing.assert_states_close(loaded["student"].params, trained, **EXACT)
    # checkpoint.load and resume take the same path.
    again, _ = fasttorch.checkpoint.resume(tmp_path, _student_and_teacher())
    fasttorch.testing.assert_states_close(again["teacher"].tensors, moved, **EXACT)


def test_a_checkpoint_without_frozen_members_warns_and_keeps_the_template(tmp_path: Any) -> None:
    # Saved before Frozen members were saved: a state of the student alone stands for it.
    state = _student_and_teacher()
    save_models(tmp_path, fasttorch.Models.create(student=state["student"]))
    template = _student_and_teacher()
    with pytest.warns(UserWarning, match=r"holds no Frozen members.*\['teacher'\]"):
        loaded, _ = load_models(tmp_path, latest_models(tmp_path), template)
    assert loaded["teacher"] is template["teacher"]


def test_a_member_that_a_checkpoint_cannot_hold_is_refused_at_save(tmp_path: Any) -> None:
    state = _student_and_teacher()
    odd = fasttorch.Models(members={**state.members, "odd": {"w": torch.zeros(2)}})  # type: ignore[dict-item]
    with pytest.raises(fasttorch.checkpoint.CheckpointError, match=r"member 'odd' is a dict"):
        save_models(tmp_path, odd)
    assert not any(tmp_path.iterdir())
