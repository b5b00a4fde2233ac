"""Inductor: its options and modes, the C++ build, the graph passes fasttorch installs
and the on-disk caches a warm start reads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib
import inspect
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "CombinedGraphPass",
    "CustomGraphPass",
    "compile_modes",
    "cpp_compile_error",
    "cpu_isa_probe",
    "graph_pass_hash",
    "inductor_cache_counts",
    "inductor_caches_disabled",
    "inductor_graph_seconds",
    "inductor_has_option",
    "inductor_mode_options",
    "use_inductor_cache_dir",
    "with_cacheable_autocast",
]


def inductor_has_option(name: str) -> bool:
    """Whether this torch's inductor knows the config option ``name``.

    Why: options come and go between releases (``cpp_wrapper_build_separate`` appeared
    in 2.8); passing an unknown one to ``torch.compile`` is an error. A dotted name is
    an option of a section (``aot_inductor.compile_wrapper_opt_level``).
    """
    from torch._inductor import config

    where: Any = config
    for part in name.split("."):
        if not hasattr(where, part):
            return False
        where = getattr(where, part)
    return True


def inductor_config(options: Mapping[str, Any] | None) -> contextlib.AbstractContextManager[Any]:
    """Inductor's config patched, for a block, with the ``options`` it knows.

    Why: a traced function loaded from ``cache_dir`` (:func:`load_precompiled`) builds
    its C++ under the process's inductor config, not under the options it was traced
    with, and the C++ wrapper's optimization level
    (``aot_inductor.compile_wrapper_opt_level``, which ``compiled`` sets) is part of the
    build's key: without them the kept build was missed and done again at ``-O1``
    (a 12-layer warm start took 11.8 s against 2.7 s). ``torch._inductor.config.patch``
    is private API; options it does not know (dynamo's ``guard_filter_fn``) are left
    out.
    """
    from torch._inductor import config

    known = {k: v for k, v in (options or {}).items() if inductor_has_option(k)}
    return config.patch(known)  # type: ignore[no-any-return]


def inductor_mode_options(mode: str, dynamic: bool | None) -> dict[str, Any]:
    """The inductor options a ``torch.compile`` mode stands for.

    Why: ``torch.compile`` takes ``mode`` or ``options``, not both; to add an option to a
    mode, fasttorch expands the mode as ``torch.compile`` itself does
    (``torch._inductor.list_mode_options``).
    """
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


@functools.cache
def _two_file_build() -> Callable[..., None] | None:
    """Inductor's function that runs a graph's C++ builds, where it has the shape the
    parallel build below replaces (else ``None``). Looked up at the first compile:
    importing inductor costs seconds."""
    try:
        from torch._inductor import codecache
    except ImportError:
        return None
    fn = getattr(codecache, "_worker_compile_cpp", None)
    if not callable(fn) or not hasattr(codecache, "LOCK_TIMEOUT"):
        return None
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return fn if params == ["lock_path", "cpp_builders"] else None


def _parallel_two_file_build(lock_path: str, cpp_builders: Any) -> None:
    """``codecache._worker_compile_cpp`` with a two-file build's two compiles at once."""
    from torch._inductor import codecache
    from torch.utils._filelock import FileLock

    original = _two_file_build()
    assert original is not None
    builders = list(cpp_builders)
    if len(builders) != 3:  # not wrapper, kernels and the link: as inductor does
        original(lock_path, cpp_builders)
        return
    with FileLock(lock_path, timeout=codecache.LOCK_TIMEOUT):
        todo = [b for b in builders[:2] if not os.path.exists(b.get_target_file_path())]
        if len(todo) == 2:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                kernels = pool.submit(todo[1].build)
                todo[0].build()
                kernels.result()
        else:
            for b in todo:
                b.build()
        if not os.path.exists(builders[2].get_target_file_path()):
            builders[2].build()


@contextlib.contextmanager
def parallel_cpp_builds() -> Iterator[None]:
    """Within the block, a graph built as two C++ files compiles both at once.

    Why: with the C++ wrapper built apart from the kernels (``cpp_wrapper_build_separate``,
    which ``compiled`` sets; pytorch/pytorch#148773), ``CppCodeCache.load_async``
    (``torch/_inductor/codecache.py``) hands ``_worker_compile_cpp`` the wrapper's
    compile, the kernels' and the link, which it runs one after the other: on the
    12-layer benchmark GPT's evaluation graph the wrapper 1.3 s, then the kernels
    1.3 s; at 24 layers the step's 7 s and 3.4 s. Here the two compiles run at once
    (each its own compiler process), then the link, under the same file lock. A private
    function, replaced only while ``compiled`` calls its graphs and only where it has
    the signature this was written against (torch 2.10 to 2.13); elsewhere nothing
    changes.
    """
    original = _two_file_build()
    from torch._inductor import codecache

    if original is None or codecache._worker_compile_cpp is not original:
        yield
        return
    codecache._worker_compile_cpp = _parallel_two_file_build
    try:
        yield
    finally:
        codecache._worker_compile_cpp = original


def cpp_compile_error(err: BaseException) -> BaseException | None:
    """The C++ compiler's error in ``err``'s chain of causes, if there is one.

    Why: ``compiled`` retries a two-file C++ build that it chose as one file when the
    compiler fails; inductor raises ``torch._inductor.exc.CppCompileError`` for that.
    """
    try:
        from torch._inductor.exc import CppCompileError
    except ImportError:  # renamed upstream: no retry, the error goes to the caller
        return None
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, CppCompileError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def cpu_isa_probe() -> Callable[[], Any] | None:
    """Inductor's probe of the C++ compiler's vector instruction sets, if it has one.

    Why: ``compiled`` starts it in a thread while dynamo traces, so a cold CPU compile
    does not wait 7-16 s for it (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``,
    cached by inductor for the process).
    """
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    # The probe's thread must import nothing: it builds with torch.utils.cpp_extension,
    # whose import loads setuptools, and setuptools' distutils shim adds and removes an
    # entry of sys.meta_path. Python walks that list live on every import
    # (importlib._bootstrap._find_spec), so a removal in the probe's thread while the
    # caller's thread imports can skip the path finder there: "No module named
    # 'torch.distributed.tensor.experimental'" from inside dynamo's tracing. What the
    # probe imports is imported here, in the calling thread, first (a compile imports
    # the same modules anyway).
    for name in ("torch._inductor.codecache", "torch.utils.cpp_extension"):
        importlib.import_module(name)
    probe = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    return probe if callable(probe) else None


class CustomGraphPass:
    """The base of fasttorch's inductor graph passes: an inductor ``CustomGraphPass``.

    Why not inductor's class itself: importing it loads inductor (seconds), and every
    ``import fasttorch`` would pay for it. Inductor only asks ``isinstance(p,
    CustomGraphPass)`` and calls ``uuid()`` (``torch/_inductor/codecache.py``, for its
    cache key), and its class is an ABC on every supported release
    (``torch/_inductor/custom_graph_pass.py``): each subclass here is registered as a
    virtual subclass of it when its first instance is made, which is before inductor
    sees one.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _register_graph_pass(cls)
        return super().__new__(cls)

    def uuid(self) -> Any:
        """The pass's cache key; ``None``: never cache the graphs it ran on."""
        return None


_REGISTERED: set[type] = set()


def _register_graph_pass(cls: type) -> None:
    if cls in _REGISTERED:
        return
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass as Inductors
    except ImportError:  # pragma: no cover - every supported release has it
        return
    Inductors.register(cls)
    _REGISTERED.add(cls)


def graph_pass_hash(paths: tuple[str, ...], extra: str) -> Any:
    """A cache key for a graph pass defined in ``paths`` with settings ``extra``."""
    try:
        from torch._inductor.custom_graph_pass import get_hash_for_files
    except ImportError:  # pragma: no cover - every supported release has it
        return repr((paths, extra)).encode()
    return get_hash_for_files(paths, extra)


class CombinedGraphPass(CustomGraphPass):
    """Several graph passes as one, run in order.

    Why: inductor releases up to 2.12 call ``post_grad_custom_pre_pass`` directly, so a
    list there fails with "'list' object is not callable"; one pass object works on
    every release (``torch/_inductor/fx_passes/post_grad.py``).
    """

    def __init__(self, passes: list[Any]) -> None:
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        """One key from the parts' keys; ``None`` (never cache) if any part has none."""
        parts = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if any(u is None for u in parts) else repr(parts)


def compile_modes() -> tuple[str, ...]:
    """The ``mode`` names ``torch.compile`` accepts on this torch release.

    Why: a typo in ``compiled(mode=...)`` is otherwise found by inductor at the step's
    first call, after the state was donated. ``torch._inductor.list_mode_options()``
    (``torch/_inductor/__init__.py``) is the table ``torch.compile`` reads the mode
    from; ``"default"`` is in it. Imported here, on first use, so that importing
    fasttorch does not load inductor.
    """
    from torch._inductor import list_mode_options

    return tuple(list_mode_options())


def use_inductor_cache_dir(path: str) -> None:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, kernels) at ``path``.

    Why: inductor has one cache directory per process, read from
    ``TORCHINDUCTOR_CACHE_DIR`` when it first needs it and memoized in
    ``functools`` caches it registers (``torch/_inductor/runtime/cache_dir_utils.py``
    ``temporary_cache_dir`` clears them the same way, ``torch._inductor.utils.clear_caches``).
    Setting the variable after a compile would otherwise reach only part of inductor.
    """
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # pragma: no cover - every supported release has it
        return
    clear_caches()


def inductor_caches_disabled() -> str | None:
    """Which of inductor's persistent caches is switched off in this process, if any.

    Why: ``compiled(..., cache_dir=)`` warms a later process only through inductor's FX
    graph cache and AOT autograd's cache (``torch._inductor.config.fx_graph_cache``,
    ``force_disable_caches``; ``torch._functorch.config.enable_autograd_cache``).
    """
    from torch._inductor import config as inductor

    if getattr(inductor, "force_disable_caches", False):
        return "torch._inductor.config.force_disable_caches"
    if not getattr(inductor, "fx_graph_cache", True):
        return "torch._inductor.config.fx_graph_cache"
    functorch = importlib.import_module("torch._functorch.config")
    if not getattr(functorch, "enable_autograd_cache", True):
        return "torch._functorch.config.enable_autograd_cache"
    return None


def inductor_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache hits and misses in this process (``counters["inductor"]``),
    and AOT autograd's cache hits and refusals (``counters["aot_autograd"]``).

    Why: the warm-start test and benchmark count a process's code generation: a miss
    is a graph inductor compiled, a hit one it loaded (``torch/_inductor/codecache.py``);
    an AOT autograd hit is a forward and backward not traced again, a bypass a graph
    its cache refused (``torch/_functorch/_aot_autograd/autograd_cache.py``).
    """
    c = torch._dynamo.utils.counters
    ind, aot = c["inductor"], c["aot_autograd"]
    return {
        "hit": int(ind["fxgraph_cache_hit"]),
        "miss": int(ind["fxgraph_cache_miss"]),
        "aot_hit": int(aot["autograd_cache_hit"]),
        "aot_bypass": int(aot["autograd_cache_bypass"]),
    }


# Dynamo writes an autocast region as calls of these two functions, with the device type,
# dtype and flags as constant arguments in the graph.
_AUTOCAST_CALLS = (
    "torch.amp.autocast_mode._enter_autocast",
    "torch.amp.autocast_mode._exit_autocast",
)


def with_cacheable_autocast(options: dict[str, Any]) -> dict[str, Any]:
    """Inductor options under which AOT autograd caches a graph with an autocast region.

    Why: AOT autograd's cache refuses a dynamo graph with a call it does not know to be
    safe ("Unsupported call_function target _enter_autocast",
    ``torch/_functorch/_aot_autograd/autograd_cache.py``, ``check_node_safe``), so every
    process traced a ``with_amp`` step's forward and backward again before loading its
    compiled code from the FX graph cache: most of a warm start's backend time. Both
    calls are pure functions of their arguments, which are constants in the graph and
    so in the cache key; inductor's ``unsafe_marked_cacheable_functions`` (name ->
    a string the key includes, here the torch version) declares them cacheable. The
    caller's own entries are kept. Where the option is missing, ``options`` unchanged.
    """
    if not inductor_has_option("unsafe_marked_cacheable_functions"):
        return options
    given = options.get("unsafe_marked_cacheable_functions") or {}
    mine = dict.fromkeys(_AUTOCAST_CALLS, torch.__version__)
    return {**options, "unsafe_marked_cacheable_functions": {**mine, **given}}


@contextlib.contextmanager
def inductor_graph_seconds() -> Iterator[list[tuple[float, int]]]:
    """Inside the block, each graph inductor compiles: (wall seconds, FX nodes), in order.

    Why: the compile-time benchmark splits a step's cold compile by graph (the
    microbatch's forward and backward, the window's update), which
    ``torch._dynamo.utils.compile_times()`` sums over the process. Inductor compiles
    one FX graph to code in ``torch._inductor.compile_fx._InProcessFxCompile``'s
    ``codegen_and_compile`` (lowering, scheduling, code generation, the C++ build);
    it is timed there for the block. The list stays empty where inductor is organized
    otherwise, or where a graph came from its cache.
    """
    graphs: list[tuple[float, int]] = []
    try:
        from torch._inductor import compile_fx
    except ImportError:
        yield graphs
        return
    owner = getattr(compile_fx, "_InProcessFxCompile", None)
    inner = getattr(owner, "codegen_and_compile", None)
    if owner is None or not callable(inner):
        yield graphs
        return

    def timed(self: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(self, gm, *args, **kwargs)
        finally:
            graphs.append((time.perf_counter() - t0, len(gm.graph.nodes)))

    owner.codegen_and_compile = timed
    try:
        yield graphs
    finally:
        owner.codegen_and_compile = inner
