"""``compiled(..., regions=...)``: a model's repeated blocks as one nested compile region.

A model's blocks (the children of an ``nn.ModuleList`` or ``nn.Sequential`` of one
class, with the same parameter names, shapes and dtypes: ``model.blocks``,
``model.layers``, ``model.h``) each run as a call of one
``torch.compiler.nested_compile_region``, so AOT autograd traces the block's forward
and backward once and inductor generates their code once, for every layer. Dynamo
still traces each block's call and merges the identical subgraphs afterwards: it
reuses a region's trace only for a region without side effects, and the swap of the
block's tensors into the template is one (docs/design.md). The rest of the step
(loss, backward, accumulation, clipping, update) stays in the step's graphs.

How: the region is ``run(tensors, *args, **kwargs)``, which runs a parameterless copy
of the block (its tensors on the meta device, made once per group) under
``torch.func.functional_call`` with the tensors it is given. While a compiled kernel
of the step runs (never otherwise), each block's ``forward`` is an instance attribute
that calls the region with the block's own parameters: under the step's
``functional_call`` those are tensors made inside the graph, which a region cannot take
as free variables ("Freevar has no source", ``torch/_dynamo/variables/invoke_subgraph.py``),
only as arguments. The attribute is removed when the kernel returns or raises.

Only where it is safe (:func:`refusal`, :func:`find_groups`); :func:`wanted` is the
one place that decides what ``"auto"`` means (docs/design.md, "Recompiles, warm
starts, regional compilation").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.utils import parametrize

from fasttorch import _compat
from fasttorch._checks import warn_once
from fasttorch._compile.inductor_options import with_pass_first
from fasttorch._compile.region_aliases import RegionAliases
from fasttorch._core.state import call_with, is_sharded, tied_names
from fasttorch.state import TrainState
from fasttorch.substates import any_declares

__all__ = [
    "CPU_AUTO_MIN_BLOCKS",
    "Blocks",
    "RegionsOption",
    "check_option",
    "choose",
    "find_groups",
    "wanted",
]

RegionsOption: TypeAlias = "bool | Literal['auto']"

# "auto" on a step whose tensors are all on the CPU uses regions from this many blocks
# on; None: never. Inductor's C++ wrapper cannot call a region (up to torch 2.14; torch
# 2.15 fails to compile a region called twice: :func:`inductor_options`), so a CPU graph
# with regions goes back to the Python wrapper, which calls each kernel from Python, and no
# kernel fuses across a region's edge. Side by side (docs/benchmarks_steady.md, torch's
# default two threads on two cores, with the alias pass) the steps with regions ran
# 0.88x the whole step's speed on a 4-layer GPT, 0.84x at 12 layers, 0.90x at 24 and
# 0.83x on a 12-block MLP; the whole step with the Python wrapper alone 0.89x, 0.96x,
# 0.93x and 1.00x. A share of every step lost, against a shorter cold compile: not set.
CPU_AUTO_MIN_BLOCKS: int | None = None

# Whether "auto" uses regions on a step whose tensors are all on CUDA. Not yet: regions
# have never run on a GPU here, and on the CPU inductor computed wrong gradients for
# them until the alias pass (:func:`inductor_options`). The GPU command
# (benchmarks/gpu.py) runs tests/test_gpu.py, whose regions test is the check to pass
# first, and its part 4 measures their cold compile and steady step against the whole
# step's at GPT-2 124M's sizes (on a torch that can run regions: 2.12 or later).
CUDA_AUTO = False

_VALID = "True, False or 'auto'"


def wanted(option: RegionsOption, devices: set[str], blocks: int, backend: object) -> bool:
    """Whether a step with tensors on ``devices`` and ``blocks`` repeated blocks uses
    regions, given that it may (the policy, in one place).

    ``True``/``False`` as given. ``"auto"``: only for the inductor backend (the others
    generate no code, where a region saves nothing), and only when every tensor is on
    CUDA (Triton kernels) and :data:`CUDA_AUTO` is set (not yet), or on the CPU from
    :data:`CPU_AUTO_MIN_BLOCKS` blocks on (never yet).
    """
    if option != "auto":
        return bool(option)
    if backend != "inductor":
        return False
    if devices == {"cuda"}:
        return CUDA_AUTO
    return devices == {"cpu"} and CPU_AUTO_MIN_BLOCKS is not None and blocks >= CPU_AUTO_MIN_BLOCKS


def unavailable() -> str | None:
    """Why this torch cannot run a step's blocks as regions, or ``None``."""
    if not hasattr(torch.compiler, "nested_compile_region"):
        return f"torch {torch.__version__} has no torch.compiler.nested_compile_region"
    if not _compat.AUTOGRAD_GRAD_IN_GRAPH:
        return (
            f"on torch {torch.__version__} a compiled step's gradients come from "
            "torch.func.grad, which does not trace nested compile regions (torch >= 2.12 "
            "uses torch.autograd.grad in the graph)"
        )
    return None


def check_option(
    regions: object,
    *,
    transforms: tuple[str, ...] | None,
    cpp_wrapper: object = None,
    several: bool = False,
    backend: object = "inductor",
) -> RegionsOption:
    """The ``regions`` option a step is compiled with; raise now where ``True`` cannot be
    honoured (wrap time).

    ``transforms``: the step's, or ``None`` for a custom callable (no model is known to
    it). ``cpp_wrapper``: the caller's inductor option of that name. ``several``: the
    step of several models (not supported: each member's step is compiled without).
    ``backend``: ``torch.compile``'s (``"eager"`` cannot run a region).
    """
    if not (
        regions is True or regions is False or (isinstance(regions, str) and regions == "auto")
    ):
        raise ValueError(f"compiled: regions must be {_VALID}; got {regions!r}")
    where = None
    if transforms is None:
        where = "a custom (state, batch) callable, which is compiled whole"
    elif several:
        where = "the step of several models"
    elif "vmapped" in transforms:
        where = "a population (vmapped), whose members are differentiated with torch.func.grad"
    if regions is not True:
        return False if where is not None else regions  # type: ignore[return-value]
    why = unavailable()
    if why is None and where is not None:
        why = f"regions are for one model's step built by fasttorch.step, not {where}"
    if why is None and backend == "eager":
        why = (
            "backend 'eager' runs dynamo's graph without AOT autograd, and a region is a "
            "higher-order op that needs it (AssertionError: fake_mode should be enabled "
            "for HOPs); use backend='aot_eager' to check graph capture"
        )
    if why is None and cpp_wrapper:
        why = (
            "options={'cpp_wrapper': True} was given, and inductor's C++ wrapper cannot "
            "call a nested compile region (up to torch 2.14: NotImplementedError in "
            "cpp_wrapper_cpu.codegen_invoke_subgraph; torch 2.15's C++ fails to compile "
            "for a region called more than once)"
        )
    if why is not None:
        raise ValueError(f"compiled(regions=True): {why}. Pass regions=False or 'auto'")
    return True


def refusal(state: TrainState) -> str | None:
    """Why this state's blocks may not run as regions, or ``None`` (conservative)."""
    why = unavailable()
    if why is not None:
        return why
    if any_declares(state.substates, "functional_grads"):
        return "a population's members are differentiated with torch.func.grad under vmap"
    if is_sharded(state.module):
        return "the model is sharded with FSDP2, whose hooks run outside any graph"
    return None


# --------------------------------------------------------------------------- blocks

_INTERNAL = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping attributes


def _value(v: Any) -> Any:
    """A hashable stand-in for a module attribute: equal for equal settings."""
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v))
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_value(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((_value(k), _value(x)) for k, x in v.items()))
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return ("value", type(v), v)


def _key(block: nn.Module) -> Any:
    """What must be equal for two blocks to share a region: class, tensors, modes and
    every other attribute of every submodule (a per-layer setting such as a sliding
    window is an attribute)."""

    def tensors(named: Iterator[tuple[str, torch.Tensor]]) -> tuple[Any, ...]:
        return tuple((n, t.shape, t.dtype, t.device, t.requires_grad) for n, t in named)

    settings = tuple(
        (
            name,
            type(m),
            m.training,
            tuple((k, _value(v)) for k, v in vars(m).items() if k not in _INTERNAL),
        )
        for name, m in block.named_modules()
    )
    return (type(block), tensors(block.named_parameters()), settings)


def _why_not(block: nn.Module) -> str | None:
    """Why ``block`` may not run as a region, whatever its siblings."""
    name = type(block).__name__
    if any(True for _ in block.buffers()):
        return (
            f"the {name} blocks hold buffers (BatchNorm running statistics are updated in "
            "place, which a region's reuse cannot carry)"
        )
    if "forward" in vars(block) or _compat.is_optimized_module(block):
        return (
            f"the {name} blocks' forward is already replaced (an instance attribute, or "
            "torch.compile)"
        )
    for m in block.modules():
        hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
        if (m is not block and any(hooks)) or parametrize.is_parametrized(m):
            return f"a module inside the {name} blocks has hooks or parametrizations"
        if _compat.compiled_in_place(m):
            return f"a module inside the {name} blocks was compiled with Module.compile()"
    return None


def find_groups(module: nn.Module) -> tuple[list[list[nn.Module]], str | None]:
    """The model's groups of repeated blocks, outermost first, and why none (if none).

    A group is two or more children of one ``nn.ModuleList``/``nn.Sequential`` with the
    same :func:`_key`, each holding parameters and submodules (a single layer gains
    nothing from a region). Blocks inside a block are not looked at.
    """
    groups: list[list[nn.Module]] = []
    inside: set[int] = set()
    reason: str | None = None
    for m in module.modules():
        if id(m) in inside or not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        by_key: dict[Any, list[nn.Module]] = {}
        for child in m.children():
            if next(child.children(), None) is None or next(child.parameters(), None) is None:
                continue
            by_key.setdefault(_key(child), []).append(child)
        for blocks in by_key.values():
            if len(blocks) < 2:
                continue
            why = next(filter(None, map(_why_not, blocks)), None)  # a hook on any one
            if why is not None:
                reason = reason or why
                continue
            groups.append(blocks)
            inside.update(id(x) for b in blocks for x in b.modules())
    if not groups and reason is None:
        reason = (
            "the model has no repeated blocks (two or more children of an nn.ModuleList or "
            "nn.Sequential of one class, with the same parameter names, shapes, dtypes and "
            "settings)"
        )
    return groups, reason


_NAMES = iter(range(1 << 62))


def _region(block: nn.Module) -> Callable[..., Any]:
    """The nested compile region that runs a block of ``block``'s group."""
    meta = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in block.parameters()
    }
    template = copy.deepcopy(block, meta).to("meta")
    # The ties known once: functional_call would walk the template for them per call,
    # and dynamo traces each block's call (1.5 s of a 12-layer GPT step's tracing).
    ties = tied_names(template)

    def run(tensors: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return call_with(template, (tensors, {}), ties, args, kwargs)

    # A code object of its own: dynamo keys a region's reuse cache by code object
    # (compared by value), and two groups' templates are not interchangeable.
    code = run.__code__.replace(co_name=f"fasttorch_region_{next(_NAMES)}")
    own = types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__)
    region: Callable[..., Any] = torch.compiler.nested_compile_region(own)
    return region


def _forward(region: Callable[..., Any], block: nn.Module) -> Callable[..., Any]:
    # Where each parameter lives, found once: a named_parameters() walk per call is
    # traced per block (generators, a memo set, one frame per submodule).
    where = [
        (name, owner, leaf)
        for name, _ in block.named_parameters()
        for owner, leaf in [_owner(block, name)]
    ]

    def forward(*args: Any, **kwargs: Any) -> Any:
        # The tensors the block holds now: under the step's functional_call, the state's.
        tensors = {name: owner._parameters[leaf] for name, owner, leaf in where}
        return region(tensors, *args, **kwargs)

    return forward


def _owner(block: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule of ``block`` that holds parameter ``name``, and its name there."""
    path, _, leaf = name.rpartition(".")
    return (block.get_submodule(path) if path else block), leaf


def _modes(block: nn.Module) -> tuple[bool, ...]:
    return tuple(m.training for m in block.modules())


class Blocks:
    """A model's groups of blocks, each group's region, and each block's replacement."""

    def __init__(self, module: nn.Module, groups: list[list[nn.Module]]) -> None:
        self.module = weakref.ref(module)
        self.count = sum(len(g) for g in groups)
        self.forwards: list[tuple[nn.Module, Callable[..., Any]]] = []
        for group in groups:
            region = _region(group[0])
            self.forwards += [(b, _forward(region, b)) for b in group]
        # The modes each group's template copied: a block trained in another mode later
        # (block.eval()) runs as it is, which recompiles.
        self.modes = [_modes(b) for b, _ in self.forwards]

    @contextlib.contextmanager
    def installed(self, args: tuple[Any, ...]) -> Iterator[None]:
        """Each block's ``forward`` replaced while the body runs, when ``args`` hold this
        model's state (another model's state runs as it is: a recompile)."""
        state = next((a for a in args if isinstance(a, TrainState)), None)
        if (
            state is None
            or state.module is not self.module()
            or any("forward" in vars(b) for b, _ in self.forwards)
        ):
            yield
            return
        done: list[nn.Module] = []
        try:
            for block, forward in self.forwards:
                vars(block)["forward"] = forward
                done.append(block)
            yield
        finally:
            for block in done:
                vars(block).pop("forward", None)

    def wrap(self, fn: Callable[..., Any], *, retry: bool) -> Callable[..., Any]:
        """``fn`` (a compiled kernel) called with the blocks replaced.

        ``retry``: when its first call fails to compile (a dynamo or backend error:
        under ``fullgraph=True`` nothing ran), warn once and run ``fn`` from then on
        without regions (``regions="auto"``: regions never cost a working step).
        """
        state = {"first": True, "off": False}

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if state["off"]:
                return fn(*args, **kwargs)
            first, state["first"] = state["first"], False
            try:
                with self.installed(args):
                    return fn(*args, **kwargs)
            except Exception as err:
                if not (retry and first and _compat.is_compile_error(err)):
                    raise
                state["off"] = True
                warn_once(
                    "compiled(regions='auto'): compiling the model's blocks as nested "
                    "compile regions failed, so this step is compiled without them "
                    "(pass regions=False to skip the attempt). torch said: "
                    f"{type(err).__name__}: {str(err)[:2000]}"
                )
                return fn(*args, **kwargs)

        return call


_CACHE: weakref.WeakKeyDictionary[nn.Module, Blocks] = weakref.WeakKeyDictionary()


def choose(option: RegionsOption, args: tuple[Any, ...], backend: object) -> Blocks | None:
    """The blocks a kernel first called with ``args`` runs as regions, or ``None``.

    With ``option=True`` every reason for ``None`` is warned about once.
    """
    if option is False:
        return None
    state = next((a for a in args if isinstance(a, TrainState)), None)
    if state is None:
        return None
    why = refusal(state)
    groups: list[list[nn.Module]] = []
    if why is None:
        groups, why = find_groups(state.module)
    if why is not None and not groups:
        if option is True:
            warn_once(f"compiled(regions=True): not using regions: {why}")
        return None
    devices = {t.device.type for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}
    if not wanted(option, devices, sum(len(g) for g in groups), backend):
        return None
    found = _CACHE.get(state.module)
    if found is None:
        found = _CACHE[state.module] = Blocks(state.module, groups)
    return found


def inductor_options(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` arguments for a graph with regions: no C++ wrapper, and the
    graph pass :class:`~fasttorch._compile.region_aliases.RegionAliases` ahead of
    any of the caller's.

    Why no C++ wrapper: up to torch 2.14 it cannot call a region
    (``cpp_wrapper_cpu.codegen_invoke_subgraph`` raises ``NotImplementedError``). Torch
    2.15 implements it (pytorch#194703) by inlining the region's body in a C++ block at
    each call, and the C++ compiler fails on a region called twice: the second copy uses
    buffers and size arrays the first copy declared inside its own block ("error:
    'repeated_subgraph0_buf0' was not declared in this scope", torch's own
    ``nested_compile_region`` over two blocks, under ``torch.no_grad``; the compile
    benchmark's step fails the same way in its backward subgraph).

    Why the pass: a region's forward subgraph returns tensors its backward needs, among
    them its own inputs or views of them (a LayerNorm's or a linear layer's ``x``), and
    torch 2.13's generated wrapper does not know such an output aliases the input. It
    takes the input for dead after the call: with ``allow_buffer_reuse`` it gives the
    input's memory to a later buffer (a block that adds its residual inside,
    tests/test_regions.py's ``Block``), with ``inplace_buffers`` a kernel writes over it
    in place (``h = h + block(h)``, ``Branch`` and ``benchmarks.models.MLP``), and the
    backward read the changed input: wrong gradients, where ``aot_eager`` and the step
    without regions match the eager step. torch's fix for nested scopes (pytorch#120777)
    covers control flow, not ``invoke_subgraph``. The pass has the calling graph read
    the input itself instead, so both options keep their defaults.
    """
    if options.get("backend", "inductor") != "inductor":
        return options
    given = with_pass_first(dict(options.get("options") or {}), RegionAliases())
    return {**options, "options": {**given, "cpp_wrapper": False}}
