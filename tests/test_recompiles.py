"""compiled reports each recompile once, in words, and never runs eagerly past its budget."""

from __future__ import annotations

import warnings

import pytest
import torch
from reference import mse

import fasttorch
from fasttorch._compile.recompiles import explain


class Config:
    problem_type: str | None = None


class SetsConfigOnFirstCall(torch.nn.Module):
    """Like a Hugging Face classifier: the first forward sets ``config.problem_type``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.config = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            self.config.problem_type = "regression"
        return self.lin(x)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.randn(n, 1)


def _run(model: torch.nn.Module, sizes: list[int], **compile_kwargs) -> list[str]:
    """The RecompileWarnings of a compiled step called on batches of ``sizes`` rows."""
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager", **compile_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in sizes:
            state, _ = step(state, _batch(n))
    mine = [w for w in caught if issubclass(w.category, fasttorch.RecompileWarning)]
    assert all(w.filename == __file__ for w in mine), "points at the caller's line"
    return [str(w.message) for w in mine]


def test_model_that_sets_its_config_on_the_first_call_is_reported_once():
    said = _run(SetsConfigOnFirstCall(), [8, 8, 8, 8])
    assert len(said) == 1, said
    assert "state.module.config.problem_type" in said[0]
    assert "before the first step" in said[0]
    assert "step 'mse'" in said[0] and "recompile 1" in said[0]


def test_config_set_before_the_first_step_does_not_recompile():
    model = SetsConfigOnFirstCall()
    model.config.problem_type = "regression"
    assert _run(model, [8, 8, 8]) == []


def test_changing_batch_size_is_reported_once_with_the_fix():
    # Dynamo makes dimension 0 dynamic after its first change: one recompile in all.
    said = _run(torch.nn.Linear(4, 1), [8, 8, 5, 5, 3, 8])
    assert len(said) == 1, said
    assert "changed size in dimension 0, from 8 to 5" in said[0]
    assert "drop_last=True" in said[0] and "mark_dynamic" in said[0]


@pytest.mark.parametrize("fullgraph", [True, False])
def test_past_the_budget_it_raises_instead_of_running_eagerly(fullgraph):
    # dynamic=False: every new batch size is a new compiled version. Budget 2 = the
    # first compile and one recompile; torch.compile would run the third size eagerly
    # (fullgraph=False) without a word.
    with pytest.raises(fasttorch.RecompileLimitError, match=r"budget of 2 .*from 8 to 5"):
        _run(
            torch.nn.Linear(4, 1),
            [8, 5, 3],
            dynamic=False,
            fullgraph=fullgraph,
            recompile_limit=2,
        )


def test_a_custom_step_callable_is_watched_too():
    state = fasttorch.TrainState.create(torch.nn.Linear(4, 1), fasttorch.optim.sgd(0.1))

    def evaluate(state, batch):
        return torch.func.functional_call(state.module, state.params, (batch[0],)).sum()

    fn = fasttorch.compiled(evaluate, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (8, 8, 6):
            fn(state, _batch(n))
    said = [str(w.message) for w in caught if w.category is fasttorch.RecompileWarning]
    assert len(said) == 1 and "function 'evaluate'" in said[0] and "from 8 to 6" in said[0]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_recompile_limit_is_checked_at_wrap_time(bad):
    with pytest.raises((TypeError, ValueError), match="recompile_limit"):
        fasttorch.compiled(fasttorch.step(mse), recompile_limit=bad)


@pytest.mark.parametrize(
    ("guard", "words"),
    [
        ("tensor 'args[1]' dtype mismatch. expected Float, actual Half", "the dtype of args[1]"),
        ("tensor 'args[1]' stride mismatch at index 0", "memory layout"),
        ("___check_obj_id(args[0].module.mode, 1234)", "args[0].module.mode changed"),
        ("len(args[1]) == 2", "number of items in args[1]"),
        ("___check_global_state()", "global settings"),
    ],
)
def test_guards_in_words(guard, words):
    what, fix = explain(guard, ())
    assert words in what and fix
