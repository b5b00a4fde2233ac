"""``compiled(regions=...)``: a model's repeated blocks as calls of one nested compile region.

A small model with three identical residual blocks: with regions the step equals the
step without them bit for bit (the region runs the same operations) and both equal the
hand-written loop; dynamo's graph calls one subgraph once per block; the user's module
is left as it was, also when the call raises; blocks with buffers, a model without
repeated blocks and ``"auto"`` on the CPU run without regions. aot_eager only.
"""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from reference import assert_params_close, batches, mse, reference_run
from tolerance import EXACT, params_atol, reference_error
from torch import nn

import fasttorch
from fasttorch import _checks, _compat
from fasttorch._compile import regions as _regions
from fasttorch._compile.region_aliases import RegionAliases, aliased_outputs

pytestmark = pytest.mark.skipif(
    _regions.unavailable() is not None,
    reason="regions need torch.compiler.nested_compile_region and torch.autograd.grad in "
    "the graph (torch >= 2.12, _compat.AUTOGRAD_GRAD_IN_GRAPH)",
)

LR = 1e-2
STEPS = 3
INVOKE = torch.ops.higher_order.invoke_subgraph


class Block(nn.Module):
    def __init__(self, width: int, norm: type[nn.Module] = nn.LayerNorm, p: float = 0.0):
        super().__init__()
        self.norm = norm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class Deep(nn.Module):
    """Input layer, ``depth`` residual blocks in an ``nn.ModuleList``, output layer."""

    def __init__(
        self, depth: int = 3, width: int = 16, norm: type[nn.Module] = nn.LayerNorm, p: float = 0.0
    ):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, norm, p) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class Branch(Block):
    """A block without its residual: the model adds it, ``h = h + branch(h)`` (as
    benchmarks.models.MLP does), so the region's input is still used after its call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class TwoKinds(nn.Module):
    """Blocks that add their residual (``Block``), then branches the model adds
    (``Branch``): two groups of regions, the two shapes that inductor's buffer reuse and
    in-place buffers each got wrong (_regions.inductor_options)."""

    def __init__(self, depth: int = 2, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.branches = nn.ModuleList(Branch(width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        for branch in self.branches:
            h = h + branch(h)
        return self.out(h)


class Graphs:
    """A backend that keeps dynamo's graphs and runs them as aot_eager does."""

    def __init__(self, fail: bool = False) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.calls: list[list[torch.fx.Node]] = []  # each graph's region calls, when given
        self.fail = fail

    def __call__(self, gm: torch.fx.GraphModule, example: list[torch.Tensor]):
        self.keep(gm)
        if self.fail:
            raise RuntimeError("boom in the backend")
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example)

    def keep(self, gm: torch.fx.GraphModule) -> None:
        # Read now: torch 2.15 empties a graph whose backend raised.
        self.graphs.append(gm)
        self.calls.append([n for n in gm.graph.nodes if n.target is INVOKE])

    def invokes(self) -> list[torch.fx.Node]:
        return [n for calls in self.calls for n in calls]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def build(precision: str) -> fasttorch.Step:
    s = fasttorch.step(mse)
    if precision == "bf16":
        s = fasttorch.clip_scaled(fasttorch.grad_accumulate(fasttorch.with_amp(s, "bf16"), 2), 1.0)
    return s


def train(model, step, data):
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR, weight_decay=0.1))
    for batch in data:
        state, _ = step(state, batch)
    return state


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_regions_equal_the_whole_step_and_the_hand_written_loop(precision):
    torch.manual_seed(0)
    model = Deep()
    data = batches(STEPS, 16)
    backends = {True: Graphs(), False: Graphs()}  # aot_eager, keeping dynamo's graphs
    states = {
        regions: train(
            copy.deepcopy(model),
            fasttorch.compiled(build(precision), backend=backend, regions=regions),
            data,
        )
        for regions, backend in backends.items()
    }
    assert len(backends[True].invokes()) == 3 and backends[False].invokes() == []
    # Rule 1: the region runs the same operations in the same order.
    with_regions, without = states[True], states[False]
    for k, p in without.params.items():
        torch.testing.assert_close(with_regions.params[k], p, **EXACT)
    for a, b in zip(
        pytree.tree_leaves(with_regions.opt_state), pytree.tree_leaves(without.opt_state)
    ):
        torch.testing.assert_close(a, b, **EXACT)
    # Rules 2 (+ 4 in bf16) against the hand-written loop, as tests/test_equivalence.py.
    n, clip = (2, 1.0) if precision == "bf16" else (1, None)
    windows = [list(zip(x.tensor_split(n), y.tensor_split(n))) for x, y in data]
    ref, _ = reference_run(model, windows, make_opt=adamw, precision=precision, clip=clip)
    error = reference_error(model, windows, make_opt=adamw, clip=clip)
    atol = params_atol(error.params, without.params, precision=precision, steps=STEPS, lr=LR)
    for state in (with_regions, without):
        assert_params_close(state, ref, rtol=0, atol=atol)


def test_dropout_inside_a_region_draws_what_the_whole_step_draws():
    """Each block's dropout mask in a region is the one the inlined graph draws: the
    region's dropout reads the state's generator (fasttorch._core.state) in block order."""
    torch.manual_seed(0)
    model = Deep(p=0.3)
    data = batches(STEPS, 16)
    backends = {True: Graphs(), False: Graphs()}
    states = {
        regions: train(
            copy.deepcopy(model),
            fasttorch.compiled(build("bf16"), backend=backend, regions=regions),
            data,
        )
        for regions, backend in backends.items()
    }
    assert len(backends[True].invokes()) == 3
    for k, p in states[False].params.items():  # rule 1: the same operations and draws
        torch.testing.assert_close(states[True].params[k], p, **EXACT)
    assert torch.equal(states[True].rng, states[False].rng)


def test_the_block_is_traced_once_and_called_once_per_block_without_recompiles():
    torch.manual_seed(0)
    backend = Graphs()
    step = fasttorch.compiled(fasttorch.step(mse), backend=backend, regions=True)
    state = fasttorch.TrainState.create(Deep(), fasttorch.optim.adamw(LR))
    data = batches(STEPS, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fasttorch.RecompileWarning)
        state, _ = step(state, data[0])
        traced = len(backend.graphs)
        for batch in data[1:]:
            state, _ = step(state, batch)
    assert len(backend.graphs) == traced == 1
    calls = backend.invokes()
    assert len(calls) == 3
    assert len({n.args[0].target for n in calls}) == 1  # one subgraph, called three times
    subgraphs = [name for name, _ in backend.graphs[0].named_children()]
    assert len(subgraphs) == 1
    assert _compat.dynamo_counters()["stats"]["unique_graphs"] == 1


def _untouched(model: Deep, reference: Deep) -> None:
    for block in model.blocks:
        assert "forward" not in vars(block)
        assert block.forward.__func__ is type(block).forward
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), reference(x), **EXACT)  # rule 1: the same module


def test_the_users_module_is_left_as_it_was_also_when_the_call_raises():
    torch.manual_seed(0)
    model = Deep()
    reference = copy.deepcopy(model)
    step = fasttorch.compiled(fasttorch.step(mse, donate=False), backend="aot_eager", regions=True)
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR))
    step(state, batches(1, 16)[0])
    _untouched(model, reference)  # donate=False: the model's tensors are the state's

    def fails(apply, batch):
        apply(batch[0])
        raise RuntimeError("boom inside the loss")

    bad = fasttorch.compiled(fasttorch.step(fails, donate=False), backend="aot_eager", regions=True)
    with pytest.raises(Exception, match="boom inside the loss"):
        bad(state, batches(1, 16)[0])
    _untouched(model, reference)
    # Raised once the blocks were traced as regions (the graph holds them).
    backend = Graphs(fail=True)
    bad = fasttorch.compiled(fasttorch.step(mse, donate=False), backend=backend, regions=True)
    with pytest.raises(Exception, match="boom in the backend"):
        bad(state, batches(1, 16)[0])
    assert len(backend.invokes()) == 3
    _untouched(model, reference)


def test_blocks_with_buffers_run_without_regions():
    torch.manual_seed(0)
    _checks.warn_once.cache_clear()
    data = batches(1, 16)
    for regions in ("auto", True):
        backend = Graphs()
        step = fasttorch.compiled(fasttorch.step(mse), backend=backend, regions=regions)
        state = fasttorch.TrainState.create(Deep(norm=nn.BatchNorm1d), fasttorch.optim.adamw(LR))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(state, data[0])
        said = [str(w.message) for w in caught if "regions" in str(w.message)]
        if regions == "auto":
            assert said == []
        else:
            assert len(said) == 1 and "buffers" in said[0] and "BatchNorm" in said[0]
        assert backend.invokes() == []


def test_a_model_without_repeated_blocks_is_said_with_regions_true():
    torch.manual_seed(0)
    _checks.warn_once.cache_clear()
    backend = Graphs()
    step = fasttorch.compiled(fasttorch.step(mse), backend=backend, regions=True)
    state = fasttorch.TrainState.create(Deep(depth=1), fasttorch.optim.adamw(LR))
    with pytest.warns(UserWarning, match="no repeated blocks"):
        step(state, batches(1, 16)[0])
    assert backend.invokes() == []


def test_auto_does_not_use_regions_yet(monkeypatch):
    torch.manual_seed(0)
    backend = Graphs()
    step = fasttorch.compiled(fasttorch.step(mse), backend=backend)  # regions="auto"
    state = fasttorch.TrainState.create(Deep(), fasttorch.optim.adamw(LR))
    step(state, batches(1, 16)[0])
    assert backend.graphs and backend.invokes() == []
    # The policy itself: not yet on CUDA nor on the CPU; other backends, mixed devices no.
    assert not _regions.CUDA_AUTO and _regions.CPU_AUTO_MIN_BLOCKS is None
    assert not _regions.wanted("auto", {"cuda"}, 3, "inductor")
    assert not _regions.wanted("auto", {"cpu"}, 48, "inductor")
    assert not _regions.wanted("auto", {"cuda"}, 3, "aot_eager")
    assert not _regions.wanted("auto", {"cuda", "cpu"}, 3, "inductor")
    assert _regions.wanted(True, {"cpu"}, 3, "aot_eager")
    # The switches, once a GPU run (or a CPU measurement) sets them.
    monkeypatch.setattr(_regions, "CUDA_AUTO", True)
    monkeypatch.setattr(_regions, "CPU_AUTO_MIN_BLOCKS", 4)
    assert _regions.wanted("auto", {"cuda"}, 3, "inductor")
    assert _regions.wanted("auto", {"cpu"}, 4, "inductor")
    assert not _regions.wanted("auto", {"cpu"}, 3, "inductor")


def test_regions_turn_the_cpp_wrapper_off_and_add_the_alias_pass_first():
    opts = {"backend": "inductor", "options": {"max_autotune": False}}
    inner = _regions.inductor_options(opts)["options"]
    assert isinstance(inner.pop("post_grad_custom_pre_pass"), RegionAliases)
    assert inner == {"max_autotune": False, "cpp_wrapper": False}  # reuse as inductor's default
    assert _regions.inductor_options({"backend": "aot_eager"}) == {"backend": "aot_eager"}

    def theirs(graph):
        pass

    asked = {"backend": "inductor", "options": {"post_grad_custom_pre_pass": theirs}}
    both = _regions.inductor_options(asked)["options"]["post_grad_custom_pre_pass"]
    assert isinstance(both, _compat.CombinedGraphPass)
    assert isinstance(both.passes[0], RegionAliases) and both.passes[1:] == [theirs]
    assert both.uuid() is None  # theirs has no cache key: inductor caches nothing
    assert RegionAliases().uuid() is not None


class AfterAliasPass:
    """An aot_autograd backend that runs RegionAliases on each graph AOT autograd hands
    it, as inductor does, records what it saw and left, and runs the graph as it is."""

    def __init__(self):
        self.aliased: list[tuple[str, int]] = []  # (graph, output index) of the regions
        self.still_read: list[tuple[str, int]] = []  # aliasing outputs read after the pass
        self.views: list[object] = []  # the nodes' targets the pass added to the callers

    def compile(self, gm: torch.fx.GraphModule, example):
        before = {n.name for n in gm.graph.nodes}
        calls = [n for n in gm.graph.nodes if n.target is INVOKE]
        found = {c: aliased_outputs(getattr(gm, c.args[0].target)) for c in calls}
        RegionAliases()(gm.graph)
        gm.graph.lint()
        gm.recompile()
        for call, outs in found.items():
            self.aliased += [(call.name, i) for i in outs]
            self.still_read += [
                (call.name, u.args[1])
                for u in call.users
                if u.target is operator.getitem and u.args[1] in outs and u.users
            ]
        self.views += [n.target for n in gm.graph.nodes if n.name not in before]
        return gm


def test_the_alias_pass_has_callers_read_a_regions_inputs_not_its_outputs():
    """RegionAliases on the graphs of TwoKinds' step (both kinds of block): every output
    of a region that is one of its inputs, or a view of one (the weights a linear layer
    saves transposed), is read by no one after the pass; the graph it leaves trains the
    model as the step without regions does. The inductor test runs it under inductor."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    seen = AfterAliasPass()

    def keep(gm, example):
        return make_boxed_func(seen.compile(gm, example))

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    torch.manual_seed(0)
    model = TwoKinds()
    data = batches(2, 8)
    step = fasttorch.compiled(fasttorch.step(mse), backend=backend, regions=True)
    state = train(copy.deepcopy(model), step, data)
    assert _regions._CACHE.get(state.module) is not None
    assert seen.aliased and seen.still_read == []
    # Views repeated (a weight's transpose), not only inputs read again; nothing else.
    assert seen.views and all(getattr(t, "is_view", False) for t in seen.views), seen.views
    plain = train(
        copy.deepcopy(model), fasttorch.compiled(fasttorch.step(mse), backend=backend), data
    )
    for k, p in plain.params.items():  # rule 1: the same operations, read from the same memory
        torch.testing.assert_close(state.params[k], p, **EXACT)


@pytest.mark.parametrize("value", ["yes", 1, None, "True"])
def test_an_unknown_value_is_refused_at_wrap_time(value):
    with pytest.raises(ValueError, match=r"regions must be True, False or 'auto'; got"):
        fasttorch.compiled(fasttorch.step(mse), backend="aot_eager", regions=value)


def test_regions_true_is_refused_where_it_cannot_apply():
    def custom(state, batch):
        return state, {}

    with pytest.raises(ValueError, match="custom"):
        fasttorch.compiled(custom, backend="aot_eager", regions=True)
    with pytest.raises(ValueError, match="cpp_wrapper"):
        fasttorch.compiled(fasttorch.step(mse), options={"cpp_wrapper": True}, regions=True)
    with pytest.raises(ValueError, match="backend 'eager'.*aot_eager"):
        fasttorch.compiled(fasttorch.step(mse), backend="eager", regions=True)
    fasttorch.compiled(fasttorch.step(mse), backend="eager")  # "auto": no regions there
    vm = fasttorch.vmapped(fasttorch.step(mse), 2)
    with pytest.raises(ValueError, match="vmapped"):
        fasttorch.compiled(vm, backend="aot_eager", regions=True)
    fasttorch.compiled(vm, backend="aot_eager")  # "auto": compiled without regions
    pair = fasttorch.several({"a": fasttorch.step(mse), "b": fasttorch.step(mse)})
    with pytest.raises(ValueError, match="several models"):
        fasttorch.compiled(pair, backend="aot_eager", regions=True)


class RefusesRegions(Graphs):
    """aot_eager, except for a graph that calls a region (a compiler that cannot)."""

    def __call__(self, gm: torch.fx.GraphModule, example: list[torch.Tensor]):
        self.keep(gm)
        if self.calls[-1]:
            raise NotImplementedError("no regions here")
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example)


def test_auto_compiles_without_regions_where_they_fail_to_compile(monkeypatch):
    monkeypatch.setattr(_regions, "wanted", lambda *args: True)  # "auto" on, here
    _checks.warn_once.cache_clear()
    torch.manual_seed(0)
    model = Deep()
    data = batches(2, 16)
    backend = RefusesRegions()
    step = fasttorch.compiled(fasttorch.step(mse), backend=backend)
    with pytest.warns(UserWarning, match="compiled without them"):
        state = train(copy.deepcopy(model), step, data)
    assert len(backend.graphs) == 2  # with regions (refused), then without: no more
    assert len(backend.invokes()) == 3 and not backend.calls[1]
    plain = train(
        copy.deepcopy(model), fasttorch.compiled(fasttorch.step(mse), backend="aot_eager"), data
    )
    for k, p in plain.params.items():  # rule 1: the same graph
        torch.testing.assert_close(state.params[k], p, **EXACT)
    # regions=True raises instead.
    strict = fasttorch.compiled(fasttorch.step(mse), backend=RefusesRegions(), regions=True)
    with pytest.raises(Exception, match="no regions here"):
        train(copy.deepcopy(model), strict, data)


def test_blocks_are_grouped_by_class_tensors_and_settings():
    model = Deep()
    assert [len(g) for g in _regions.find_groups(model)[0]] == [3]
    model.blocks[1].fc1.window = 4  # a per-layer setting: blocks 0 and 2 still match
    assert [[id(b) for b in g] for g in _regions.find_groups(model)[0]] == [
        [id(model.blocks[0]), id(model.blocks[2])]
    ]
    model.blocks[2].fc1.register_forward_hook(lambda *args: None)  # would be skipped
    groups, why = _regions.find_groups(model)
    assert groups == [] and "hooks" in why


@pytest.mark.slow
def test_regions_compile_with_inductor_and_train_as_the_hand_written_loop():
    """The one inductor test: a region's forward and backward subgraphs built with the
    Python wrapper (the C++ one cannot call them) train the model as the loop does.

    Two groups of regions, 8 rows a batch (not the width, 16), inductor's buffer reuse
    and in-place buffers on (its defaults). Without the alias pass
    (_region_aliases.RegionAliases) parameters ended up to 1.16 from the eager step's
    with buffer reuse (Deep's ``Block`` LayerNorm weights were right at 16 rows) and up
    to 0.039 with in-place buffers alone (_regions.inductor_options)."""
    torch.manual_seed(0)
    model = TwoKinds()
    data = batches(2, 8)
    step = fasttorch.compiled(fasttorch.step(mse), regions=True)
    _checks.warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"compiled\(regions=True\)")  # not refused
        state = train(copy.deepcopy(model), step, data)
    assert [len(g) for g in _regions.find_groups(model)[0]] == [2, 2]
    blocks = _regions._CACHE.get(state.module)
    assert blocks is not None and blocks.count == 4  # both groups ran as regions
    windows = [[b] for b in data]
    ref, _ = reference_run(model, windows, make_opt=adamw)
    error = reference_error(model, windows, make_opt=adamw)
    assert_params_close(state, ref, rtol=0, atol=params_atol(error.params, state.params))


def test_cuda_graphs_capture_a_step_with_regions():
    """Inductor's own CUDA graph predicate, run on the CPU (fasttorch.testing.check_cudagraphs),
    accepts the microbatch and update graphs of a step whose blocks are regions."""
    torch.manual_seed(0)
    model = Deep()
    state = fasttorch.TrainState.create(model, fasttorch.optim.adamw(LR))
    step = fasttorch.clip_scaled(fasttorch.grad_accumulate(fasttorch.step(mse), 2), 1.0)
    step = fasttorch.compiled(step, backend="aot_eager", regions=True)
    reports = fasttorch.testing.check_cudagraphs(step, state, batches(3, 16))
    assert _regions._CACHE.get(model) is not None  # judged with the blocks as regions
    assert [r.name for r in reports] == ["micro", "close"]
    assert all(r.captured and not r.reasons for r in reports), reports


def _calling_graph(sizes_inside: bool) -> torch.fx.GraphModule:
    """A graph that calls a region returning a view of its input ``x`` (its size read
    inside the region, or passed in as the region's input ``n``) and ``x * 2``, and
    reads the view after the call."""
    sub = torch.fx.Graph()
    x, n = sub.placeholder("x"), sub.placeholder("n")
    size = sub.call_function(torch.ops.aten.sym_size.int, (x, 0)) if sizes_inside else n
    view = sub.call_function(torch.ops.aten.view.default, (x, [size, -1]))
    sub.output((view, sub.call_function(torch.ops.aten.mul.Tensor, (x, 2))))
    root = torch.nn.Module()
    root.region = torch.fx.GraphModule(torch.nn.Module(), sub)
    g = torch.fx.Graph()
    a, k = g.placeholder("a"), g.placeholder("k")
    call = g.call_function(INVOKE, (g.get_attr("region"), "r", a, k))
    first, second = (g.call_function(operator.getitem, (call, i)) for i in range(2))
    g.output((g.call_function(torch.ops.aten.add.Tensor, (first, 1)), second))
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("sizes_inside", [False, True])
def test_the_alias_pass_repeats_a_view_outside_or_has_the_region_copy_it(sizes_inside):
    """A view whose size the region computes cannot be repeated by its caller: the
    region returns a copy of it instead (one copy, nothing aliased); a size that is the
    region's input is the caller's operand, and the view is repeated outside."""
    gm = _calling_graph(sizes_inside)
    a = torch.arange(12.0).reshape(3, 4)
    want = gm(a, 3)
    assert list(aliased_outputs(gm.region)) == [0]
    RegionAliases()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    got = gm(a, 3)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, **EXACT)
    # The region is changed only where the view could not be repeated.
    assert bool(aliased_outputs(gm.region)) is not sizes_inside
    read = [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[1] == 0]
    copies = gm.region.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)
    if sizes_inside:  # the caller still reads output 0, now a copy made in the region
        assert len(read) == 1 and len(copies) == 1
        assert got[0].untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    else:  # the caller reads a's own view
        assert read == [] and copies == []
        views = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
        a_node, k_node = gm.graph.find_nodes(op="placeholder")
        assert len(views) == 1 and views[0].args == (a_node, [k_node, -1])


def test_the_alias_pass_refuses_a_call_it_does_not_know():
    gm = _calling_graph(False)
    call = next(n for n in gm.graph.nodes if n.target is INVOKE)
    call.args = call.args[:-1]  # one operand fewer than the region's inputs
    with pytest.raises(RuntimeError, match=r"does not know.*Pass regions=False"):
        RegionAliases()(gm.graph)
