"""Sub-states declare themselves: a transform written here, with only its declaration,
is checkpointed (per rank or replicated) and evaluated as its records say, and the
layers below the transforms name none of them (counted from the source with ``ast``)."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from reference import LayerNormNet, batches, mse
from test_import_cycles import _imports, _modules
from tolerance import EXACT

import fasttorch
from fasttorch import struct
from fasttorch.evaluation import eval_step
from fasttorch.substates import SubState

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fasttorch"
counters = torch._dynamo.utils.counters

# --------------------------------------------------------------------------- a new transform


class Lagged(struct.Record):
    """The parameters as they were before the latest update: evaluation swaps them in."""

    params: dict[str, torch.Tensor]

    eval_params: ClassVar[str] = "params"


class Tally(struct.Record):
    """Calls so far, and the position in a window of 3: each rank keeps its own."""

    calls: torch.Tensor
    position: int = struct.field(static=True, default=0)

    per_rank: ClassVar[bool] = True
    window_position: ClassVar[str] = "position"


LAGGED = SubState(
    "lagged", Lagged, lambda s: Lagged({k: p.detach().clone() for k, p in s.params.items()})
)
TALLY = SubState("tally", Tally, lambda s: Tally(torch.zeros((), dtype=torch.int64)))


def lagged(step: fasttorch.Step) -> fasttorch.Step:
    """A stateful transform, written as any user would: its phase and its declarations."""
    inner = step.update

    def update(state, g):
        before = {k: p.detach().clone() for k, p in state.params.items()}  # before in place
        tally: Tally = state.substates["tally"]
        new, metrics = inner(state, g)
        new = new.with_substate("lagged", Lagged(before))
        return new.with_substate("tally", Tally(tally.calls + 1, (tally.position + 1) % 3)), metrics

    return step.with_phases("lagged", update=update, substate=(LAGGED, TALLY))


def _trained(n: int):
    torch.manual_seed(0)
    step = lagged(fasttorch.step(mse))
    state = step.init(fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(1e-2)))
    history = []
    for b in batches(n, 16):
        state, _ = step(state, b)
        history.append({k: p.clone() for k, p in state.params.items()})
    return step, state, history


def test_a_new_transform_is_checkpointed_as_its_records_declare(tmp_path):
    checkpoint = pytest.importorskip("fasttorch.checkpoint")
    from torch.distributed.checkpoint import FileSystemReader

    step, state, history = _trained(4)
    for k, p in state.substates["lagged"].params.items():
        torch.testing.assert_close(p, history[-2][k], **EXACT)  # a copy: rule 1
    assert int(state.substates["tally"].calls) == 4 and state.substates["tally"].position == 1

    path = checkpoint.save(tmp_path, state, data={"next": 4})
    assert path.name == "step_000000004_micro1"  # the declared window position names it
    manifest = json.loads((path / "fasttorch.json").read_text())
    assert manifest["micro"] == 1
    assert manifest["statics"]["substates/tally/position"] == 1
    assert manifest["per_rank"] == ["rng", "substates/tally/calls"]  # per_rank: declared
    saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    assert "rank0/substates/tally/calls" in saved and "substates/tally/calls" not in saved
    assert "substates/lagged/params/inp.weight" in saved  # replicated: one copy, no rank
    assert not any(k.startswith("rank0/substates/lagged") for k in saved)

    torch.manual_seed(1)
    fresh = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(1e-2))
    loaded, data = checkpoint.load(path, step.init(fresh))
    assert data == {"next": 4}
    assert loaded.substates["tally"].position == 1 and int(loaded.substates["tally"].calls) == 4
    for k, p in state.substates["lagged"].params.items():
        torch.testing.assert_close(loaded.substates["lagged"].params[k], p, **EXACT)  # rule 1


def test_a_new_transform_is_swapped_in_by_evaluation_as_declared():
    step, state, _ = _trained(3)
    b = batches(1, 16, seed=3)[0]
    ref = copy.deepcopy(state.module)
    ref.load_state_dict(state.substates["lagged"].params, strict=False)
    ev = eval_step(step, use_ema=True)
    on_lagged = ev(state, b)["loss"]
    with torch.no_grad():
        # Rule 1: the same module's forward on the same input and parameters.
        torch.testing.assert_close(on_lagged, mse(ref.eval(), b), **EXACT)
    assert not torch.equal(on_lagged, eval_step(step)(state, b)["loss"])
    torch._dynamo.reset()
    counters.clear()
    fast = fasttorch.compiled(ev, backend="aot_eager")
    torch.testing.assert_close(fast(state, b)["loss"], on_lagged, **EXACT)  # rule 1
    assert not counters["graph_break"]


def test_declarations_are_checked_where_they_are_made():
    plain = fasttorch.step(mse)
    other = SubState("lagged", Lagged, lambda s: Lagged(dict(s.params)))
    with pytest.raises(ValueError, match=r"twice: sub-state 'lagged' is already declared"):
        lagged(plain).with_phases("twice", substate=other)
    with pytest.raises(TypeError, match=r"substate= takes .*SubState declarations, got tuple"):
        plain.with_phases("pairs", substate=(("k", dict),))  # type: ignore[arg-type]
    shared = lagged(plain).with_phases("again", substate=TALLY)  # one declaration, kept once
    assert [d.key for d in shared.inits] == ["lagged", "tally"]
    wrong = plain.with_phases("wrong", substate=SubState("tally", Tally, lambda s: {}))
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"mse: the init of sub-state 'tally' returned a dict"):
        wrong.init(state)
    with pytest.raises(ValueError, match=r"use_ema=True but step 'mse' has several averages"):
        eval_step(fasttorch.ema(lagged(plain), 0.9), use_ema=True)


def test_with_substate_keeps_the_others_in_order():
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    a, b = torch.zeros(()), torch.ones(())
    s2 = state.with_substate("a", a).with_substate("b", b).with_substate("a", b)
    assert list(s2.substates) == ["a", "b"] and s2.substates["a"] is b
    assert list(s2.without_substate("a").substates) == ["b"]
    assert s2.without_substate("zz") is s2 and state.substates == {}


# --------------------------------------------------------------------------- the source


def _sources() -> dict[str, Path]:
    return {name: f for name, f in _modules(ROOT, "fasttorch").items()}


def _is_transform(module: str) -> bool:
    return module == "fasttorch.transforms" or module.startswith("fasttorch.transforms.")


def test_checkpoint_and_evaluation_import_no_transform():
    mods = _sources()
    lower = [m for m in mods if m.startswith("fasttorch.checkpoint") or m == "fasttorch.evaluation"]
    for name in lower:  # every import, lazy ones inside functions too
        tree = ast.parse(mods[name].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
                assert not any(_is_transform(n) for n in [node.module or "", *names]), (
                    name,
                    ast.unparse(node),
                )
            elif isinstance(node, ast.Import):
                assert not any(_is_transform(a.name) for a in node.names), (name, ast.unparse(node))
    # Evaluation, followed through everything it imports, reaches no transform either.
    graph = {n: _imports(n, f, mods, False) for n, f in mods.items()}
    seen, todo = set(), ["fasttorch.evaluation"]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    assert not [m for m in seen if _is_transform(m)]


def _substates_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "substates"


def _literal_key(node: ast.AST) -> bool:
    """``state.substates["ema"]`` or ``state.substates.get("ema")``."""
    if isinstance(node, ast.Subscript):
        return _substates_attr(node.value) and isinstance(node.slice, ast.Constant)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and _substates_attr(node.func.value)
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
    )


def _merge(node: ast.AST) -> bool:
    """``{**state.substates, KEY: v}`` or ``{k: v for k, v in state.substates.items() ...}``."""
    if isinstance(node, ast.Dict):
        return any(k is None and _substates_attr(v) for k, v in zip(node.keys, node.values))
    return isinstance(node, ast.DictComp) and "substates.items()" in ast.unparse(node)


def _violations(name: str, tree: ast.AST) -> list[str]:
    """Keys written as literals, hand-written merges, and another transform's marks."""
    found = []
    for node in ast.walk(tree):
        mark = (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("__fasttorch_profiled")
            and name != "fasttorch.transforms.profiled"
        )
        # Merging is TrainState.with_substate's and without_substate's job.
        if _literal_key(node) or (_merge(node) and name != "fasttorch._core.state") or mark:
            found.append(ast.unparse(node))
    return found


def test_no_literal_keys_no_hand_written_merges_outside_their_transform():
    found = {}
    for name, f in _sources().items():
        bad = _violations(name, ast.parse(f.read_text()))
        if bad:
            found[name] = bad
    assert found == {}


def test_the_scan_finds_what_main_had():
    """The two checks above fail on the code they were written against."""
    old = """
from fasttorch.transforms.ema import KEY as EMA_KEY
def f(state, new, sub):
    ema = state.substates[EMA_KEY]
    window = state.substates.get("grad_accumulate")
    rest = {k: v for k, v in state.substates.items() if k != "x"}
    if getattr(step, "__fasttorch_profiled__", False):
        pass
    return new.replace(substates={**new.substates, "ema": sub})
"""
    bad = _violations("fasttorch.evaluation", ast.parse(old))
    assert len(bad) == 4, bad
