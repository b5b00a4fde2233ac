"""A call that fails leaves its input state as it was, or unusable with a clear error;
inputs that cannot train are refused at call time (host-side checks of metadata)."""

from __future__ import annotations

import pytest
import torch
from reference import batches, mse
from tolerance import EXACT
from torch import nn

import fasttorch
from fasttorch import _compat
from fasttorch.state import DonatedStateError
from fasttorch.testing import assert_states_close


class EmbedNet(nn.Module):
    """BatchNorm on a float input, then an embedding: a bad index fails after the
    forward has updated the running statistics in place."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.lin = nn.Linear(4, 1)
        self.emb = nn.Embedding(10, 1)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bn(x)) + self.emb(idx)


def embed_loss(apply, batch):
    x, idx, y = batch
    return torch.nn.functional.mse_loss(apply(x, idx), y)


def _batch(bad: bool = False):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 10, (8,), generator=g)
    if bad:
        idx[5] = 50  # out of range
    return torch.randn(8, 4, generator=g), idx, torch.randn(8, 1, generator=g)


def _embed_state():
    torch.manual_seed(0)
    return fasttorch.TrainState.create(EmbedNet(), fasttorch.optim.adam(0.1))


def _embed_step(mode, accumulate, donate):
    s = fasttorch.step(embed_loss, donate=donate)
    if accumulate == "within":
        s = fasttorch.grad_accumulate(s, 2)
    elif accumulate == "across":
        s = fasttorch.grad_accumulate(s, 2, across_calls=True)
    if mode == "compiled":
        s = fasttorch.compiled(s, backend="aot_eager")
    return s


def _leaves(state):
    return [t.clone() for t in torch.utils._pytree.tree_leaves(state)]


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("accumulate", ["none", "within", "across"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_failed_call_leaves_the_state_intact_or_dead(mode, accumulate, donate):
    step = _embed_step(mode, accumulate, donate)
    state = _embed_state()
    for _ in range(2 if accumulate == "across" else 1):  # one update first (compiles)
        state, _ = step(state, _batch())
    assert int(state.step) == 1
    before = _leaves(state)
    bn_before = {k: b.clone() for k, b in state.buffers.items()}
    with pytest.raises(IndexError) as info:
        step(state, _batch(bad=True))
    notes = "".join(getattr(info.value, "__notes__", ()))
    if donate and mode == "compiled":
        # The graph ran: part of the results may be in its tensors.
        assert "donated and is now unusable" in notes
        with pytest.raises(DonatedStateError, match=r"failed part-way \(IndexError.*donate=False"):
            state.step  # noqa: B018
        return
    if donate:
        # The eager loss failed before anything was written, but for BatchNorm's running
        # statistics, which its forward updated in place (as model(x) in a plain loop).
        assert "still usable" in notes and "BatchNorm running statistics" in notes
        changed = [k for k, b in state.buffers.items() if not torch.equal(b, bn_before[k])]
        assert sorted(changed) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
        for k in changed:  # what the next comparison holds the state to
            state.buffers[k].copy_(bn_before[k])
    else:
        assert "still usable" not in notes
    after = torch.utils._pytree.tree_leaves(state)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    state, _ = step(state, _batch())  # still usable
    assert int(state.step) == (1 if accumulate == "across" else 2)


def test_a_compiled_kernel_that_fails_after_writing_a_counter_kills_the_donated_state():
    # Inductor schedules the step and optimizer counters' increments (which need no
    # data) before the embedding kernel that fails: the input state's counters went
    # 1 -> 2 and it stayed usable, one step off.
    step = fasttorch.compiled(fasttorch.step(embed_loss))
    state, _ = step(_embed_state(), _batch())
    with pytest.raises(RuntimeError, match="index out of bounds"):
        step(state, _batch(bad=True))
    with pytest.raises(DonatedStateError, match="failed part-way"):
        state.opt_state  # noqa: B018


def test_a_call_refused_before_its_phases_begin_leaves_a_donated_state_usable():
    step = fasttorch.grad_accumulate(fasttorch.step(mse), 2)
    state = fasttorch.TrainState.create(nn.Linear(8, 4), fasttorch.optim.sgd(0.1))
    x, y = batches(1, 8)[0]
    with pytest.raises(ValueError, match="same leading"):
        step(state, (x, y[:6]))
    state, _ = step(state, (x, y))
    assert int(state.step) == 1


def _typo_loss(apply, batch):
    """A classification loss whose labels are floats in a microbatch whose third item
    flags it (a notebook's typo): cross_entropy refuses them after the forward ran.
    (A host read of the flags: these steps run eagerly.)"""
    x, y = batch[0], batch[1]
    typo = len(batch) == 3 and bool(batch[2].any())
    labels = y.argmax(1).float() if typo else y.argmax(1)
    return torch.nn.functional.cross_entropy(apply(x), labels)


def _fresh(own: bool = True):
    """A state; ``own=False``: over copies of the model's tensors (as a loaded
    checkpoint), which an eager step runs through functional_call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    state = fasttorch.TrainState.create(model, fasttorch.optim.adam(0.01))
    return state if own else state.replace(params={k: p.clone() for k, p in state.params.items()})


def _raising_update(step):
    """A user's transform whose update phase fails after its inner update returned."""
    inner = step.update

    def update(state, g):
        new, metrics = inner(state, g)
        if fail[0]:  # a host-side switch, not a tensor value
            raise RuntimeError("the user's update failed")
        return new, metrics

    fail = [False]
    return step.with_phases("raising", update=update), fail


@pytest.mark.parametrize("own", [True, False], ids=["model's tensors", "copies"])
@pytest.mark.parametrize("where", ["loss", "update"])
@pytest.mark.parametrize("accumulate", ["none", "within", "across"])
def test_an_error_before_anything_is_written_leaves_a_donated_eager_state_usable(
    accumulate, where, own
):
    """A typo in the loss (or a user's update phase that fails before the commit)
    consumes nothing: the state steps on and equals one that never saw the error."""

    def build():
        s = fasttorch.step(_typo_loss)
        s, fail = _raising_update(s)
        if accumulate == "within":
            s = fasttorch.grad_accumulate(s, 2)
        elif accumulate == "across":
            s = fasttorch.grad_accumulate(s, 2, across_calls=True)
        return s, fail

    good = batches(4, 8)
    step, fail = build()
    state = _fresh(own)
    state, _ = step(state, good[0])
    if where == "loss":  # the typo in the second half: the second microbatch of two
        bad: tuple = (*good[1], (torch.arange(8) >= 4).float())
    else:
        bad, fail[0] = good[1], True
    with pytest.raises(RuntimeError) as info:
        step(state, bad)
    fail[0] = False
    notes = "".join(info.value.__notes__)
    if accumulate == "across" and where == "update":
        # The call's microbatch was added into the state's window before its update.
        assert "donated and is now unusable" in notes
        return
    assert "is still usable" in notes
    ref_step, _ = build()
    ref = _fresh(own)
    ref, _ = ref_step(ref, good[0])
    for batch in good[1:]:
        state, _ = step(state, batch)
        ref, _ = ref_step(ref, batch)
    assert int(state.step) == int(ref.step) > 0
    assert_states_close(state, ref, **EXACT)  # the same operations on the same inputs


@pytest.mark.parametrize("error", ["shape", "compile"])
def test_a_first_compiled_call_that_fails_before_anything_ran_leaves_the_state_usable(error):
    """A shape error found while tracing, or a graph the compiler refuses (a Python
    branch on a tensor under fullgraph=True): nothing ran, nothing was written."""

    def narrow(apply, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply(x[:, :5]), y)  # 5 columns for 8 inputs

    def branchy(apply, batch):
        x, y = batch
        out = apply(x)
        return (out - y).abs().mean() if y.sum() > 0 else (out - y).pow(2).mean()

    bad = fasttorch.compiled(
        fasttorch.step(narrow if error == "shape" else branchy), backend="aot_eager"
    )
    state = _fresh()
    with pytest.raises(Exception) as info:
        bad(state, batches(1, 8)[0])
    assert "is still usable" in "".join(info.value.__notes__)
    good = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    ref = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    fresh = _fresh()
    for batch in batches(2, 8):
        state, _ = good(state, batch)
        fresh, _ = ref(fresh, batch)
    assert_states_close(state, fresh, **EXACT)  # one compiled code on the same inputs


# --------------------------------------------------------------------------- call-time checks


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_an_empty_batch_is_refused_before_it_updates(mode):
    step = fasttorch.step(mse)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    state = fasttorch.TrainState.create(nn.Linear(8, 4), fasttorch.optim.adamw(0.1))
    with pytest.raises(ValueError, match=r"batch\[0\] has 0 rows.*Skip empty batches"):
        step(state, (torch.zeros(0, 8), torch.zeros(0, 4)))
    assert int(state.step) == 0  # refused before anything ran: the state is usable


def test_an_empty_trailing_tensor_is_not_an_empty_batch():
    def loss_fn(apply, batch):
        x, y, boxes = batch  # e.g. an image without boxes
        return mse(apply, (x, y)) + boxes.sum()

    state = fasttorch.TrainState.create(nn.Linear(8, 4), fasttorch.optim.sgd(0.1))
    x, y = batches(1, 8)[0]
    state, _ = fasttorch.step(loss_fn)(state, (x, y, torch.zeros(0, 4)))
    assert int(state.step) == 1


@pytest.mark.parametrize(
    ("mode", "accumulate"), [("eager", False), ("compiled", False), ("compiled", True)]
)
def test_a_batch_wider_than_the_parameters_is_refused_with_its_dtypes(mode, accumulate):
    step = fasttorch.step(mse)
    if accumulate:
        step = fasttorch.grad_accumulate(step, 2)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    state = fasttorch.TrainState.create(nn.Linear(8, 4), fasttorch.optim.sgd(0.1))
    x, y = batches(1, 8)[0]
    state, _ = step(state, (x, y))
    with pytest.raises(
        ValueError, match=r"batch\[0\] is float64 but the parameters are float32.*x.to\("
    ):
        step(state, (x.double(), y.double()))
    state, _ = step(state, (x, y))  # refused before it ran: still usable
    assert int(state.step) == 2


def test_narrower_batches_and_float64_models_are_accepted():
    x, y = batches(1, 8)[0]
    state = fasttorch.TrainState.create(nn.Linear(8, 4).double(), fasttorch.optim.sgd(0.1))
    state, _ = fasttorch.step(mse)(state, (x.double(), y.double()))

    def half_input(apply, batch):
        x, y = batch
        return mse(apply, (x.float(), y))

    state = fasttorch.TrainState.create(nn.Linear(8, 4), fasttorch.optim.sgd(0.1))
    state, _ = fasttorch.step(half_input)(state, (x.half(), y))
    assert int(state.step) == 1


def test_a_loss_function_with_the_wrong_signature_is_refused_at_step_time():
    def three(model, x, y):
        return mse(model, (x, y))

    with pytest.raises(
        TypeError, match=r"three\(model, x, y\) cannot be called as three\(apply, batch\)"
    ):
        fasttorch.step(three)

    def one(batch):
        return batch

    with pytest.raises(TypeError, match=r"takes two arguments: apply"):
        fasttorch.step(one)
    # Signatures that can be bound are accepted, and so are callables without one.
    fasttorch.step(lambda apply, batch, scale=1.0: mse(apply, batch) * scale)
    fasttorch.step(lambda *args: mse(*args))
    fasttorch.step(torch.nn.functional.mse_loss)  # a builtin-backed callable


# --------------------------------------------------------------------------- empty windows


def masked(apply, batch):
    """A token loss: the mean over the rows the mask keeps (none: weight 0)."""
    x, y, mask = batch
    per_row = ((apply(x) - y) ** 2).mean(-1)
    count = mask.sum()
    return fasttorch.Loss((per_row * mask).sum() / count.clamp(min=1), weight=count)


def _masked_batch(keep: float, seed: int = 0):
    x, y = batches(1, 8, seed=seed)[0]
    return x, y, torch.full((8,), keep)


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_window_with_total_weight_zero_skips_its_update(mode, across):
    step = fasttorch.grad_accumulate(fasttorch.step(masked), 2, across_calls=across)
    if mode == "compiled":
        step = fasttorch.compiled(step, backend="aot_eager")
    state = fasttorch.TrainState.create(nn.Linear(8, 4), fasttorch.optim.adamw(0.1))
    calls = 2 if across else 1
    for _ in range(calls):
        state, m = step(state, _masked_batch(1.0))
    assert not bool(m["skipped"])
    before = _leaves((state.params, state.opt_state))
    for _ in range(calls):
        state, m = step(state, _masked_batch(0.0, seed=1))  # every row masked out
    assert bool(m["skipped"])
    after = torch.utils._pytree.tree_leaves((state.params, state.opt_state))
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # no NaN, no decay
    assert int(state.step) == 2  # the step counter advances, as for any skip
    for _ in range(calls):
        state, m = step(state, _masked_batch(1.0, seed=2))
    assert not bool(m["skipped"]) and int(state.opt_state.count) == 2


def test_a_counted_window_that_is_not_empty_gives_the_same_bits():
    def counted(apply, batch):
        x, y = batch
        return fasttorch.Loss(mse(apply, batch), weight=torch.tensor(float(len(x))))

    results = []
    for loss_fn in (mse, counted):
        torch.manual_seed(0)
        state = fasttorch.TrainState.create(nn.Linear(8, 4), fasttorch.optim.adamw(0.1))
        step = fasttorch.grad_accumulate(fasttorch.step(loss_fn), 2)
        for b in batches(3, 8):
            state, _ = step(state, b)
        results.append(state)
    for k in results[0].params:
        assert torch.equal(results[0].params[k], results[1].params[k]), k


# --------------------------------------------------------------------------- compiled errors


def _float_labels(apply, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(apply(x), y.argmax(1).float())  # LINE: labels


def _raises(apply, batch):
    x, y = batch
    if x.shape[0] == 8:  # a shape, known while tracing
        raise ValueError(f"a batch of {x.shape[0]} rows is not supported here")  # LINE: raise
    return torch.nn.functional.mse_loss(apply(x), y)


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(marker))


@pytest.mark.parametrize("loss_fn", [_float_labels, _raises], ids=["kernel", "raise"])
def test_a_users_error_in_a_compiled_step_is_reported_as_the_users_own(loss_fn):
    """Not forty lines of tracer output: the user's exception type and message, then
    the user's file and line, with dynamo's report kept as the cause."""
    step = fasttorch.compiled(fasttorch.step(loss_fn), backend="aot_eager")
    state = _fresh()
    with pytest.raises(Exception) as info:
        step(state, batches(1, 8)[0])
    err = info.value
    expected = RuntimeError if loss_fn is _float_labels else ValueError
    assert type(err) is expected
    assert _compat.is_compile_error(err.__cause__)  # the compiler's report, on the chain
    if loss_fn is _raises:
        assert str(err) == "a batch of 8 rows is not supported here"  # as eagerly
    else:  # the meta kernel's words for the fake-tensor run, whatever the release
        assert str(err) and str(err) in str(err.__cause__)
    marker = "# LINE: labels" if loss_fn is _float_labels else "# LINE: raise"
    notes = err.__notes__
    assert notes[0] == notes[0].splitlines()[0]  # one line each
    assert notes[0].startswith(f'fasttorch: raised at File "{__file__}", line {_line(marker)}')
    assert "still usable" in notes[-1]
    state, _ = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")(state, batches(1, 8)[0])
    assert int(state.step) == 1
