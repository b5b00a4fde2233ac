"""``compiled``: the whole step under ``torch.compile``.

The transform installs a :class:`Compiler` as the step's ``jit`` hook: every pure
function a step runs (the whole step, or a microbatch and a window's update under
``grad_accumulate``, or the forward and the update under ``sync_on_last``) goes through
it once and is reused. The rest of this module is what fasttorch adds around
``torch.compile``: a code object per kernel, inductor options chosen from the first
call's devices (:mod:`fasttorch._compile.inductor_options`), and the retry of a C++
build it chose.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import attrs
import torch
import torch.utils._pytree as pytree

from fasttorch import _checks, _compat
from fasttorch._checks import warn_once
from fasttorch._compile import regions as _regions
from fasttorch._compile.cache import check_cache_dir, kept, use_cache_dir
from fasttorch._compile.code import describe, own_code
from fasttorch._compile.cpu_gemm import CpuGemm
from fasttorch._compile.inductor_options import (
    _check_isa_cache,
    _on_cpu,
    _only_on_cpu,
    _separate_build_is_ours,
    _tail,
    _with_cacheable_autocast,
    _with_cpp_wrapper,
    _with_cpu_gemm,
    _with_fusion_cap,
    _without_cpu_only_passes,
    check_arguments,
    probe_cpu_isa_early,
)
from fasttorch._compile.recompiles import DEFAULT_LIMIT, Recompiles
from fasttorch._compile.recompiles import RecompileLimitError as RecompileLimitError
from fasttorch._compile.recompiles import RecompileWarning as RecompileWarning
from fasttorch._compile.traced_errors import user_error
from fasttorch.phases import Batch, Metrics
from fasttorch.state import TrainState, is_sharded, kept_leaves
from fasttorch.steps import Runner, Step, check_wrap

__all__ = ["Compiler", "compile_step_fn", "compiled"]

_REGIONS = "the model's blocks run as regions (regions=False keeps the traced step)"
Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@attrs.frozen
class Compiler:
    """The ``jit`` hook ``compiled`` installs: ``torch.compile`` with these arguments."""

    options: dict[str, Any]
    static_state: bool = False

    def __call__(self, fn: Callable[..., Any], *, cpp_wrapper: bool = False) -> Callable[..., Any]:
        return compile_step_fn(
            fn, cpp_wrapper_on_cpu=cpp_wrapper, static_state=self.static_state, **self.options
        )


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


@overload
def compiled(
    step: Step,
    *,
    mode: Mode | None = None,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    options: dict[str, Any] | None = None,
    cpu_gemm: CpuGemm = "auto",
    recompile_limit: int = DEFAULT_LIMIT,
    cache_dir: str | os.PathLike[str] | None = None,
    regions: bool | Literal["auto"] = "auto",
) -> Step: ...


@overload
def compiled(
    step: _Fn,
    *,
    mode: Mode | None = None,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    options: dict[str, Any] | None = None,
    cpu_gemm: CpuGemm = "auto",
    recompile_limit: int = DEFAULT_LIMIT,
    cache_dir: str | os.PathLike[str] | None = None,
    regions: bool | Literal["auto"] = "auto",
) -> _Fn: ...


def compiled(
    step: Any,
    *,
    mode: Mode | None = None,
    fullgraph: bool = True,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    options: dict[str, Any] | None = None,
    cpu_gemm: CpuGemm = "auto",
    recompile_limit: int = DEFAULT_LIMIT,
    cache_dir: str | os.PathLike[str] | None = None,
    regions: bool | Literal["auto"] = "auto",
) -> Any:
    """Compile the whole step: forward, backward, loss scaling, clipping and update.

    The step's pure functions go to ``torch.compile`` once, with ``fullgraph=True`` by
    default: a graph break is an error, not a silent slowdown. Learning rate, loss
    scale and step count are tensors in the state, so they change without recompiling.
    With ``grad_accumulate`` two graphs are compiled (one microbatch's forward and
    backward; the window's unscale, clip and update) and reused, never one graph
    unrolled over the microbatches, and the model's code is compiled once. Input
    checks, the RNG scope and donation stay outside the graph. On a CPU, a donated
    step whose optimizer runs torch's fused kernel (``adamw``, ``adam``, ``sgd``: their
    default ``opaque=True``) runs its update outside the graphs, as the eager step
    does: the only graph is the gradients' (the microbatch's), and the update costs no
    compile time (docs/optimizers.md, "Opaque update").

    ``compiled`` must be the outermost of the phase transforms. It also accepts any
    ``(state, batch) -> (state, metrics)`` callable (a custom step), compiled whole.

    With CUDA graphs (``mode="reduce-overhead"``) a step's graphs are captured: the
    donated state's tensors are marked static, each call is one step of inductor's
    graph trees, and the metrics are copied out of the graphs' memory, so they stay
    valid after the next call. The step must donate (``donate=False`` is refused
    here); set hyperparameters with ``set_hyperparams(..., in_place=True)``. A custom
    callable gets none of this: its mutated inputs are not static.
    ``fasttorch.testing.check_cudagraphs`` tells, on any device, what is captured.

    Equivalent to writing the loop body as one function and ``torch.compile``-ing it,
    which ``torch.compile(model)`` alone does not give: the optimizer and clipping only
    fuse when they are in the same graph as the backward.

    On a CPU without bf16 (fp16) matrix units, ATen's bf16 (fp16) matrix products and
    attention are several times slower than float32 ones of the same shape. There, by
    default, ``compiled`` computes the graph's bf16/fp16 ``mm``/``addmm``/``bmm``/
    ``baddbmm`` and CPU attention in float32 from the same inputs and rounds each result
    once to bf16/fp16: products of bf16 numbers are exact in float32 and both kernels
    accumulate in float32, so the values agree up to the order of the sums (as between
    any two GEMM libraries); attention is more precise, as ATen's bf16 kernel rounds the
    attention weights to bf16. An activation the backward reads again is widened again
    right before that use rather than kept in float32, so the step's peak memory stays
    that of bf16 plus the one widened operand in use. ``cpu_gemm`` chooses:

    * ``"auto"``: for each of bf16 and fp16 that the CPU lacks units for (AVX512-BF16 or
      AMX for bf16, AMX-FP16 or AVX512-FP16 for fp16; only x86 CPUs are judged);
    * ``"fp32"``: bf16 and fp16, on any CPU;
    * ``"native"``: none.

    GPU tensors are never touched: a step whose tensors are all on a GPU is compiled
    without the pass or the rounding option it sets (decided on the first call). It is
    an inductor graph pass, so it applies to the inductor backend.

    Args:
        step: a :class:`fasttorch.Step` or any ``(state, batch)`` callable.
        mode, fullgraph, dynamic, backend, options: as for :func:`torch.compile`;
            ``backend="aot_eager"`` checks graph capture without code generation.
        cpu_gemm: ``"auto"``, ``"fp32"`` or ``"native"``: how bf16/fp16 matrix
            products and attention on CPU tensors are computed (see above).
        recompile_limit: the most compiled versions of each of the step's functions
            (the first compile included; torch.compile's default, 8). Each recompile
            is reported once as a :class:`fasttorch.RecompileWarning` saying which
            guard failed, in words, and how to avoid it; one more than the budget
            raises :class:`fasttorch.RecompileLimitError` where torch.compile would run
            the function eagerly without a word (docs/transforms.md, "Recompiles").
        cache_dir: a directory (created if missing) where the first process keeps
            the traced and compiled step, named by a fingerprint of everything the
            trace read, and inductor's caches (it becomes the process's
            ``TORCHINDUCTOR_CACHE_DIR`` on the first call): a later process, a restarted
            job or every ``torchrun`` rank naming the same directory loads them instead
            of tracing and generating code again (docs/transforms.md, "Warm starts").
            It holds compiled code that later processes run: name only a directory
            you trust.
        regions: ``True``, ``False`` or ``"auto"``: run the model's repeated blocks
            (children of one ``nn.ModuleList``/``nn.Sequential``, same class, parameters
            and settings, no buffers) as calls of one ``nested_compile_region``,
            differentiated and compiled once for all layers (dynamo still traces each
            call), with inductor's Python wrapper and fasttorch's graph pass for
            outputs that alias a region's inputs.
            ``"auto"`` uses them on no device today. On the CPU, because inductor's
            C++ wrapper cannot call a region, so a graph with regions runs on its
            Python wrapper: side by side the steady step ran 0.83-0.90x the whole
            step's speed (docs/benchmarks_steady.md), for a cold compile 0.71x as long
            at 24 layers (docs/benchmarks_compile.md). On CUDA, because regions have
            not been measured on a GPU yet (the GPU command's regions test and compile
            part are the check). docs/transforms.md, "Regional compilation".

    Raises:
        ValueError: CUDA graphs asked for a step built with ``donate=False``; a
            ``regions`` value this step or torch cannot honour.

    Example:
        >>> import torch, fasttorch
        >>> def loss_fn(apply, batch):
        ...     return apply(batch).pow(2).mean()
        >>> state = fasttorch.TrainState.create(torch.nn.Linear(4, 4), fasttorch.optim.sgd(0.1))
        >>> fast = fasttorch.compiled(fasttorch.step(loss_fn), backend="aot_eager")
        >>> state, metrics = fast(state, torch.randn(8, 4))
        >>> int(state.step)
        1
    """
    if callable(getattr(step, "map_steps", None)):  # several models: compile each member's step
        given: dict[str, Any] = {"mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}
        given.update(backend=backend, options=options, cpu_gemm=cpu_gemm, cache_dir=cache_dir)
        given["regions"] = _regions.check_option(regions, transforms=(), several=True)
        return step.map_steps(lambda s: compiled(s, **given, recompile_limit=recompile_limit))
    check_arguments(mode, backend, fullgraph, dynamic)
    _checks.count(
        "compiled",
        "recompile_limit",
        recompile_limit,
        hint="It counts compiled versions of each function, the first compile included.",
    )
    opts: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}
    opts["recompile_limit"] = recompile_limit
    opts["cache_dir"] = check_cache_dir(cache_dir, backend)
    opts["regions"] = _regions.check_option(
        regions,
        transforms=step.transforms if isinstance(step, Step) else None,
        cpp_wrapper=(options or {}).get("cpp_wrapper"),
        backend=backend,
    )
    if mode is not None:
        opts["mode"] = mode
    options = _with_cpu_gemm(options, cpu_gemm, backend)
    if options is not None:
        opts["options"] = options
    refusal = getattr(step, "compile_refusal", None)  # declared by what cannot be compiled
    if isinstance(refusal, str):
        raise ValueError(f"compiled cannot wrap {refusal}")
    if isinstance(step, Step):
        check_wrap(step, "compiled")
        if not uses_cudagraphs(opts):
            return step.with_phases("compiled", jit=Compiler(opts, static_state=step.donate))
        if not step.donate:
            how = f"mode={mode!r}" if mode else "options={'triton.cudagraphs': True}"
            raise ValueError(
                f"compiled({step.name}, {how}): CUDA graphs need a donating step. "
                "A graph's outputs live in memory its next replay overwrites, so with "
                "donate=False the new state would be overwritten by the next call; with "
                "donation the results are written into the input state's own tensors, "
                "which stay. Build the step with donate=True (the default), or compile "
                "without CUDA graphs (mode=None or 'max-autotune-no-cudagraphs')"
            )
        return step.with_phases(
            "compiled", jit=Compiler(opts, static_state=True), runner=GraphCall(step.runner)
        )
    if not callable(step):
        raise TypeError(f"compiled expects a step or a callable, got {type(step).__name__}")
    if getattr(step, "__fasttorch_compiled__", False):
        raise ValueError("compiled: this callable is already compiled; apply compiled once")
    # A function with no update in its graph (eval_step's) gets the C++ wrapper on a CPU,
    # as a step's gradient graphs do: its kernels then build as one C++ file instead of
    # one each (12 GPT layers: the evaluation's first call 16.9 s, 0.61 of the step's).
    forward_only = getattr(step, "__fasttorch_forward_only__", False) is True
    fn = compile_step_fn(step, cpp_wrapper_on_cpu=forward_only, **opts)

    @functools.wraps(step)
    def run(state: Any, batch: Any) -> Any:
        if isinstance(state, TrainState) and is_sharded(state.module):
            warn_once(
                f"compiled({getattr(step, '__name__', 'fn')}): the state is sharded with "
                "FSDP2, whose hooks run outside any graph, so this function runs eagerly. "
                "Compile the model's blocks before fully_shard (block.compile()) to compile "
                "their forward"
            )
            return step(state, batch)
        return fn(state, batch)

    run.__fasttorch_compiled__ = True  # type: ignore[attr-defined]
    return run


def uses_cudagraphs(options: dict[str, Any]) -> bool:
    """Whether ``torch.compile`` arguments ask inductor for CUDA graphs.

    ``mode="reduce-overhead"`` and ``"max-autotune"`` do, or ``triton.cudagraphs`` in
    the options; only the inductor backend makes them.
    """
    if options.get("backend", "inductor") != "inductor":
        return False
    inner = options.get("options") or {}
    if "triton.cudagraphs" in inner:
        return bool(inner["triton.cudagraphs"])
    mode = options.get("mode")
    if mode is None or mode == "default":
        return False
    expanded = _compat.inductor_mode_options(mode, options.get("dynamic"))
    return bool(expanded.get("triton.cudagraphs", False))


@attrs.frozen
class GraphCall:
    """The runner ``compiled`` installs under CUDA graphs around the step's own runner.

    Inductor's CUDA graph trees free a graph's outputs when the next step begins, and
    without a mark every compiled call begins one: a window's microbatch graphs and its
    update graph would each start a step of their own. Here one call of the step is one
    step of the tree (``torch.compiler.cudagraph_mark_step_begin``), so the outputs of a
    window's microbatches stay valid while its update runs; the metrics are then copied
    out of the graphs' memory (a few scalars), so that they stay valid after the next
    call, as an eager step's do (a ``Logger`` keeps a loss across steps). The state
    needs no copy: a donating step's results are in the input state's own tensors.
    """

    inner: Runner

    def __call__(self, step: Step, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        new, metrics = self.inner(step, state, batch)
        return new, pytree.tree_map(_out_of_graph_pool, metrics)


def _out_of_graph_pool(x: Any) -> Any:
    # Only CUDA tensors can be a CUDA graph's output; a clone is an eager allocation.
    return x.clone() if isinstance(x, torch.Tensor) and x.device.type == "cuda" else x


# --------------------------------------------------------------------------- machinery


def compile_step_fn(
    fn: Callable[..., Any],
    *,
    cpp_wrapper_on_cpu: bool = False,
    static_state: bool = False,
    **options: Any,
) -> Callable[..., Any]:
    """``torch.compile(fn)``, called with dynamo allowed to trace ``torch.autograd.grad``.

    ``fn`` gets a code object of its own first: dynamo caches compiled graphs per code
    object, and every step's kernels share the same source, so without a copy each
    further compiled step in a process would count as a recompile of the first one (and
    with ``fullgraph=True`` the ninth would fail on dynamo's recompile limit).

    ``cpp_wrapper_on_cpu``: when every tensor of the first call is on the CPU and the
    backend is inductor, compile with inductor's C++ wrapper (``cpp_wrapper=True``)
    unless the caller's options set it. The graph then calls its kernels from C++
    instead of from a Python function, which shortens the step of a forward and backward
    with hundreds of small kernels (the wrapper and the kernels compile as two files, see
    ``_with_cpp_wrapper``). The update graph does not get it: its single kernel with a
    few hundred arguments compiles more slowly inside a C++ wrapper. Measurements:
    docs/design.md, "Compile time".

    ``static_state``: before each call, mark the tensors of the arguments a donating
    step keeps from call to call (``fasttorch.state.kept_leaves``: the state, the
    accumulation window) as static addresses, without a guard. CUDA graphs then accept
    the graph's writes into them instead of skipping it ("mutated inputs"), and read
    them in place instead of copying them in.
    """
    if isinstance(options.get("options"), dict):
        # torch.compile pops entries (guard_filter_fn) from this dict: one per kernel.
        options = {**options, "options": dict(options["options"])}
    options = dict(options)
    limit = options.pop("recompile_limit", DEFAULT_LIMIT)
    regions = options.pop("regions", False)
    blocks: _regions.Blocks | None = None
    cache = options.pop("cache_dir", None)
    compiled_fn: Callable[..., Any] | None = None
    opts: dict[str, Any] = options
    recompiles: Recompiles | None = None

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled_fn, opts, recompiles, blocks
        # The call that compiles runs on a frame stack of its own (CPython's chunked
        # stack: _compat.on_large_stack); a later recompile runs where it is called.
        call = _compat.on_large_stack if compiled_fn is None else _plain_call
        if compiled_fn is None:  # on the first call, when the tensors' devices are known
            _check_optimizers(args)
            blocks = _regions.choose(regions, args, options.get("backend", "inductor"))
            if cache is not None:
                use_cache_dir(cache)
            opts = _without_cpu_only_passes(options, (args, kwargs))
            if _on_cpu((args, kwargs)):
                _check_isa_cache()
                probe_cpu_isa_early(opts)
            opts = _with_cacheable_autocast(_with_fusion_cap(opts))
            if blocks is not None:
                opts = _regions.inductor_options(opts)
            elif cpp_wrapper_on_cpu and _only_on_cpu((args, kwargs)):
                opts = _with_cpp_wrapper(opts)
            compiled_fn, recompiles = _watched(fn, opts, limit, blocks, regions)
            mine = own_code(fn)
            if cache is not None:  # the traced step itself, kept where it can be
                off = {"CUDA graphs are on": uses_cudagraphs(opts), _REGIONS: blocks is not None}
                where = (cache, next((k for k, v in off.items() if v), None))
                compiled_fn = kept(fn, mine, describe(fn), opts, where, args, kwargs, compiled_fn)
            if uses_cudagraphs(opts) and not _on_cpu((args, kwargs)):
                with _compat.recompile_budget(limit):
                    try:
                        return call(_first_graph_call, compiled_fn, fn, args, kwargs, static_state)
                    except Exception as err:
                        clear = user_error(err)
                        if clear is not None:  # as below
                            raise clear from err
                        raise
        if static_state:
            _compat.mark_static_addresses(kept_leaves(args))
        with (
            _compat.tracing_autograd_ops(),
            _compat.recompile_budget(limit),
            _compat.parallel_cpp_builds(),
        ):
            try:
                out = call(compiled_fn, *args, **kwargs)
                if recompiles is not None:
                    recompiles.check(args)
                return out
            except Exception as err:
                if recompiles is not None and _compat.recompile_limit_hit(err):
                    raise recompiles.limit_error(err) from err
                error = _compat.cpp_compile_error(err)
                if error is None or not _separate_build_is_ours(options, opts):
                    clear = user_error(err)
                    if clear is not None:  # the user's own error, dynamo's report its cause
                        raise clear from err
                    raise
                # One graph (fullgraph), which failed to build: nothing ran, the inputs
                # are untouched, and the same call can be made again.
                warn_once(
                    "compiled: the C++ compiler failed on the wrapper and kernels built as "
                    "two files (cpp_wrapper_build_separate, which fasttorch sets); building "
                    "them as one file from now on, as inductor does by default. Pass "
                    "options={'cpp_wrapper_build_separate': False} to skip the attempt. "
                    f"The compiler said:\n{_tail(str(error), 4000)}"
                )
                inner = {**opts["options"], "cpp_wrapper_build_separate": False}
                opts = {**opts, "options": inner}
                compiled_fn, recompiles = _watched(fn, opts, limit, blocks, regions)
                return _compat.on_large_stack(compiled_fn, *args, **kwargs)

    return run


def _plain_call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _first_graph_call(
    compiled_fn: Callable[..., Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    static_state: bool,
) -> Any:
    """The first call under CUDA graphs, saying once in plain words if inductor skipped them."""
    if static_state:
        _compat.mark_static_addresses(kept_leaves(args))
    before = _compat.cudagraph_skips()
    with _compat.tracing_autograd_ops():
        out = compiled_fn(*args, **kwargs)
    if _compat.cudagraph_skips() > before:
        name = getattr(getattr(fn, "func", fn), "__name__", "fn").lstrip("_")
        warn_once(
            f"compiled: CUDA graphs do not capture the step's {name!r} graph, which runs as "
            "compiled kernels launched one by one. Typical causes: a state that is not "
            "donated, a torch optimizer with no capturable form, FSDP2's hooks, a tensor "
            "on the CPU. fasttorch.testing.check_cudagraphs(step, state, batches) lists "
            "every reason, on any device; inductor's log line gives the first one"
        )
    return out


def _watched(
    fn: Callable[..., Any],
    opts: dict[str, Any],
    limit: int,
    blocks: _regions.Blocks | None = None,
    regions: object = False,
) -> tuple[Callable[..., Any], Recompiles]:
    """``torch.compile`` of ``fn``'s own code, with the record of its recompiles."""
    mine = own_code(fn)
    code = getattr(mine, "__func__", mine).__code__
    name = describe(fn)
    if _compat.guard_failures(code) is None or not _compat.recompile_budget_enforced():
        warn_once(
            f"compiled: torch {torch.__version__} keeps no record of guard failures or "
            "has no hard recompile limit (torch._dynamo.utils.guard_failures, "
            "config.fail_on_recompile_limit_hit): recompiles of a compiled step are not "
            "reported; run with TORCH_LOGS=recompiles to see them"
        )
    out = torch.compile(mine, **opts)
    if blocks is not None:  # "auto" falls back to no regions where they fail to compile
        out = blocks.wrap(out, retry=regions == "auto" and opts.get("fullgraph") is True)
    return out, Recompiles(name, limit, code)


def _check_optimizers(args: Any) -> None:
    """Let each state's optimizer refuse a compiled step before tracing (its own words).

    Not a CPU state's optimizer that declares ``update_outside_graphs``
    (``from_torch(..., fused=True)``): a donated step runs its update outside the
    graphs; a step that traces it after all (``donate=False``) gets the same refusal
    from the optimizer's update while tracing.
    """
    for a in args:
        check = getattr(getattr(a, "optimizer", None), "check_compilable", None)
        if not isinstance(a, TrainState) or not callable(check):
            continue
        if a.device.type == "cpu" and getattr(a.optimizer, "update_outside_graphs", False):
            continue
        check()
