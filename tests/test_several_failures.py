"""A several-model call that fails leaves its Models state usable when no member's step
wrote into it yet, and marks a donated one dead once one may have (as a one-model step:
tests/test_failed_calls.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_several import d_objective, g_objective, gan_calls, gan_models, gan_state
from tolerance import EXACT

import fasttorch
from fasttorch.state import DonatedStateError

# What the next call's losses do (a host-side switch, read while tracing under compiled):
# None trains; "loss" raises in D's loss, the first member's; "branch" branches on a
# tensor's value in D's loss (a graph that fullgraph=True refuses); "forward" raises in
# the shared forward; "later" raises in G's loss, after D's step updated in place.
FAIL: list[str | None] = [None]


def d_loss(apply: Any, batch: Any, models: Any) -> Any:
    real, z = batch
    if FAIL[0] == "loss":
        raise KeyError("'reals': a typo in the discriminator's loss")
    fake = models.outputs["fake"] if models.outputs else models["g"](z).detach()
    if FAIL[0] == "branch" and real.sum() > 0:  # refused by the compiler, never run
        return -d_objective(apply, real, fake)
    return d_objective(apply, real, fake)


def g_loss(apply: Any, batch: Any, models: Any) -> Any:
    real, z = batch
    if FAIL[0] == "later":
        raise KeyError("'z_dim': a typo in the generator's loss")
    fake = models.outputs["fake"] if models.outputs else apply(z)
    return g_objective(models["d"](fake), real.dtype)


def make_fake(apply: Any, batch: Any) -> Any:
    if FAIL[0] == "forward":
        raise ValueError("the generator's forward was given the wrong noise")
    return apply(batch[1])


def build(mode: str, shared: bool) -> fasttorch.Several:
    donate = mode != "eager copying"
    steps = {
        "d": fasttorch.model_step(d_loss, donate=donate),
        "g": fasttorch.model_step(g_loss, donate=donate),
    }
    gan = fasttorch.several(steps, outputs={"fake": ("g", make_fake)} if shared else None)
    return fasttorch.compiled(gan, backend="aot_eager") if mode == "compiled" else gan


def leaves(state: fasttorch.Models) -> dict[str, list[torch.Tensor]]:
    """Every tensor of every member (parameters, buffers, optimizer state, counters, rng)."""
    return {n: torch.utils._pytree.tree_leaves(m) for n, m in state.members.items()}


def assert_equal(state: fasttorch.Models, ref: fasttorch.Models) -> None:
    # The same operations on the same inputs (a second compile of the same code): rule 1.
    ours, theirs = leaves(state), leaves(ref)
    assert ours.keys() == theirs.keys()
    for n in ours:
        assert len(ours[n]) == len(theirs[n])
        for a, b in zip(ours[n], theirs[n]):
            torch.testing.assert_close(a, b, **EXACT)


CASES = [
    (mode, where, shared)
    for mode in ("eager donated", "eager copying", "compiled")
    for where, shared in (("loss", False), ("forward", True), ("later", False), ("later", True))
] + [("compiled", "branch", False)]  # only the compiler refuses a branch on a value


@pytest.mark.parametrize(
    ("mode", "where", "shared"),
    CASES,
    ids=[f"{m}-{w}-{'shared' if s else 'own'}" for m, w, s in CASES],
)
def test_a_failed_call_leaves_the_models_state_usable_until_a_member_wrote(
    mode: str, where: str, shared: bool
) -> None:
    # BatchNorm in eager: each error comes before the forward it would follow, so the
    # running statistics are untouched. (Compiled: before torch 2.12 a member's graph
    # cannot update another's statistics.)
    d, g = gan_models(batchnorm=mode != "compiled")
    calls = gan_calls(3)
    step, ref_step = build(mode, shared), build(mode, shared)
    state, ref = gan_state(d, g), gan_state(d, g)
    # Eager: one call first; compiled: the failure is the first call (nothing compiled).
    first = 0 if mode == "compiled" else 1
    for b in calls[:first]:
        state, _ = step(state, b)
    member = state["d"]
    FAIL[0] = where
    try:
        with pytest.raises(Exception) as info:
            step(state, calls[first])
    finally:
        FAIL[0] = None
    err = info.value
    notes = "".join(getattr(err, "__notes__", ()))
    assert "state passed to step" not in notes  # the member's sub-state: not the user's
    if where == "branch":
        assert fasttorch._compat.is_compile_error(err) or fasttorch._compat.is_compile_error(
            err.__cause__
        )
    else:
        assert "a typo" in str(err) or "wrong noise" in str(err)
    if where == "later" and mode != "eager copying":
        # D's step updated D's tensors in place before G's loss raised.
        assert (
            "donated and is now unusable" in notes and "model_step(loss_fn, donate=False)" in notes
        )
        with pytest.raises(DonatedStateError, match=r"failed part-way \(KeyError.*z_dim"):
            _ = state.members
        with pytest.raises(DonatedStateError, match=r"failed part-way \(KeyError"):
            _ = member.params
        return
    if mode == "eager copying":
        assert "still usable" not in notes and "unusable" not in notes
    else:
        assert f"the Models state passed to {step.name} is still usable" in notes
    for b in calls[first:]:
        state, metrics = step(state, b)
    for b in calls:
        ref, ref_metrics = ref_step(ref, b)
    assert int(state["d"].step) == int(ref["d"].step) == len(calls)
    assert_equal(state, ref)
    for n in ("d", "g"):
        torch.testing.assert_close(metrics[n]["loss"], ref_metrics[n]["loss"], **EXACT)


def test_the_note_names_the_batchnorm_statistics_a_forward_updated_before_the_error() -> None:
    """D's forward ran (its BatchNorm statistics updated in place, as d(x) in a plain
    loop) before cross_entropy refused float labels: the note says so."""

    def typo(apply: Any, batch: Any, models: Any) -> Any:
        real, z = batch
        out = apply(real)
        return torch.nn.functional.cross_entropy(out, out.argmax(1).float())

    d, g = gan_models()
    step = fasttorch.several({"d": fasttorch.model_step(typo), "g": fasttorch.model_step(g_loss)})
    state = gan_state(d, g)
    with pytest.raises(RuntimeError) as info:
        step(state, gan_calls(1)[0])
    notes = "".join(info.value.__notes__)
    assert "is still usable" in notes and "BatchNorm running statistics" in notes
    assert int(state["d"].step) == 0  # usable


def test_a_shared_loss_scale_refused_after_the_updates_kills_the_donated_state() -> None:
    """The members updated in place, then the shared scale is refused (one member is
    inside its accumulation window): the state holds this call's updates, so it is dead."""

    def member(loss_fn: Any, n: int) -> fasttorch.Step:
        s = fasttorch.with_amp(fasttorch.model_step(loss_fn), "fp16")
        return fasttorch.grad_accumulate(s, n, across_calls=True)

    d, g = gan_models()
    step = fasttorch.several(
        {"d": member(d_loss, 1), "g": member(g_loss, 2)}, share_loss_scale=True
    )
    state = gan_state(d, g)
    with pytest.raises(ValueError, match="same grad_accumulate n") as info:
        step(state, gan_calls(1)[0])
    assert "donated and is now unusable" in "".join(info.value.__notes__)
    with pytest.raises(DonatedStateError, match=r"failed part-way \(ValueError"):
        _ = state.members
