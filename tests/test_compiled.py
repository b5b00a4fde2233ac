"""compiled: one graph, no graph breaks, no recompiles while lr, loss scale and step change."""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from reference import LayerNormNet, batches, mse
from tolerance import unit_roundoff

import fasttorch
from fasttorch import _compat
from fasttorch._compile import inductor_options as options_mod

counters = torch._dynamo.utils.counters


def _composed(**compile_kwargs):
    s = fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=2.0**20, growth_interval=5)
    return fasttorch.compiled(fasttorch.clip_scaled(s, 1.0), **compile_kwargs)


def test_fifty_steps_one_graph_no_breaks_no_recompiles():
    sched = fasttorch.schedules.warmup(10, fasttorch.schedules.cosine(1e-2, 40))
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(sched))
    step = _composed(backend="aot_eager")
    lrs, scales = set(), set()
    data = batches(50, 16)
    data[20] = (data[20][0] * float("inf"), data[20][1])  # an overflow mid-run
    for b in data:
        state, m = step(state, b)
        lrs.add(float(m["lr"]))
        scales.add(float(m["loss_scale"]))
    assert len(lrs) > 40 and len(scales) >= 3, "lr and loss scale really changed"
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    assert not counters["graph_break"]
    assert int(state.step) == 50 and int(state.substates["amp"].skipped_total) >= 1


def test_changing_hyperparameters_does_not_recompile():
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(1e-2))
    step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
    for i, b in enumerate(batches(6, 16)):
        state = state.replace(
            opt_state=fasttorch.optim.set_hyperparams(state.opt_state, lr=1e-3 * (i + 1))
        )
        state, m = step(state, b)
        # The lr is a float32 hyperparameter: one rounding of the float64 value given.
        assert float(m["lr"]) == pytest.approx(1e-3 * (i + 1), rel=unit_roundoff(torch.float32))
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0


def test_compiled_equals_eager_with_aot_eager():
    torch.manual_seed(0)
    model = LayerNormNet()
    data = batches(5, 16)
    out = []
    for step in (
        _composed(backend="aot_eager"),
        fasttorch.clip_scaled(
            fasttorch.with_amp(fasttorch.step(mse), "fp16", init_scale=2.0**20, growth_interval=5),
            1.0,
        ),
    ):
        state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(1e-2))
        for b in data:
            state, _ = step(state, b)
        out.append(state.params)
    # aot_eager runs the eager step's ATen operations in the same order: bit for bit.
    for k in out[0]:
        torch.testing.assert_close(out[0][k], out[1][k], rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_tiny_model_matches_eager(monkeypatch):
    """The one test here that pays for inductor's code generation."""
    from torch._inductor import cpu_vec_isa

    real_probe, callers = cpu_vec_isa.valid_vec_isa_list, []

    def probe():
        callers.append(threading.current_thread().name)
        return real_probe()

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", probe)
    monkeypatch.setattr(options_mod, "_ISA_PROBE", [])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(4)]
    results = []
    for compile_it in (True, False):
        step = fasttorch.clip_scaled(fasttorch.step(mse), 1.0)
        if compile_it:
            step = fasttorch.compiled(step)
        state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(1e-2))
        for b in data:
            state, _ = step(state, b)
        results.append(state.params)
    # Inductor fuses and reorders: the fp32 reference loop's own error bounds the gap.
    from tolerance import fp32_reference_error, params_atol

    errors = fp32_reference_error(
        model, [[b] for b in data], make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2), clip=1.0
    )
    atol = params_atol(errors, results[1])
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=0, atol=atol)
    assert not counters["graph_break"]
    assert callers[0] == "fasttorch-cpu-isa-probe", callers  # started before inductor asked


def _failing_separate_builds(monkeypatch):
    """The C++ compiler fails on every two-file build (wrapper and kernels apart)."""
    from torch._inductor import codecache
    from torch._inductor.exc import CppCompileError

    real, builds = codecache._worker_compile_cpp, []

    def worker(lock_path, builders):
        builds.append(len(builders))
        if len(builders) > 1:  # wrapper, kernels, link
            raise CppCompileError(["g++", "wrapper.cpp"], "wrapper.cpp:1: error: made to fail")
        return real(lock_path, builders)

    monkeypatch.setattr(codecache, "_worker_compile_cpp", worker)
    return builds


def _accumulated(compile_kwargs):
    step = fasttorch.grad_accumulate(fasttorch.step(mse), 2)
    return fasttorch.compiled(step, **compile_kwargs) if compile_kwargs is not None else step


@pytest.mark.slow
def test_a_failed_two_file_build_warns_once_and_builds_one_file(monkeypatch):
    """Where the C++ compiler fails on the two-file build that compiled chose, the same
    step builds as one file (inductor's default), says so once with the compiler's
    words, and trains as the hand-written loop does."""
    from fasttorch import steps

    steps.warn_once.cache_clear()
    builds = _failing_separate_builds(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    data = [(torch.randn(6, 3), torch.randn(6, 2)) for _ in range(3)]
    results = []
    for compile_kwargs in ({}, None):
        step = _accumulated(compile_kwargs)
        state = fasttorch.TrainState.create(copy.deepcopy(model), fasttorch.optim.adamw(1e-2))
        with (
            torch.compiler.config.patch(force_disable_caches=True),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            for b in data:
                state, _ = step(state, b)
        results.append((state, [str(w.message) for w in caught]))
    (compiled_state, said), (eager_state, _) = results
    fallback = [m for m in said if "two files" in m]
    assert len(fallback) == 1 and "made to fail" in fallback[0], said
    assert 3 in builds and 1 in builds, builds  # tried two files, then built one
    assert int(compiled_state.step) == 3
    # Inductor fuses and reorders: the fp32 reference loop's own error bounds the gap.
    from tolerance import fp32_reference_error, params_atol

    windows = [list(zip(x.tensor_split(2), y.tensor_split(2))) for x, y in data]
    errors = fp32_reference_error(model, windows, make_opt=lambda p: torch.optim.AdamW(p, lr=1e-2))
    atol = params_atol(errors, eager_state.params)
    for k in eager_state.params:
        torch.testing.assert_close(
            compiled_state.params[k], eager_state.params[k], rtol=0, atol=atol
        )


@pytest.mark.slow
def test_a_two_file_build_the_caller_asked_for_is_not_second_guessed(monkeypatch):
    _failing_separate_builds(monkeypatch)
    step = _accumulated({"options": {"cpp_wrapper_build_separate": True}})
    state = fasttorch.TrainState.create(torch.nn.Linear(3, 2), fasttorch.optim.adamw(1e-2))
    with (
        torch.compiler.config.patch(force_disable_caches=True),
        pytest.raises(Exception, match="made to fail"),
    ):
        step(state, (torch.randn(4, 3), torch.randn(4, 2)))


def test_only_a_c_compile_error_of_a_two_file_build_compiled_chose_is_retried():
    from torch._inductor.exc import CppCompileError

    from fasttorch._compat import cpp_compile_error as _cpp_compile_error
    from fasttorch._compile.inductor_options import _separate_build_is_ours

    cause = CppCompileError(["g++"], "boom")
    try:
        try:
            raise cause
        except CppCompileError as e:
            raise RuntimeError("backend compiler failed") from e
    except RuntimeError as wrapped:
        assert _cpp_compile_error(wrapped) is cause
    assert _cpp_compile_error(RuntimeError("not a compiler")) is None
    chose = {
        "fullgraph": True,
        "options": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True},
    }
    assert _separate_build_is_ours({"fullgraph": True}, chose)
    caller = {"fullgraph": True, "options": {"cpp_wrapper_build_separate": True}}
    assert not _separate_build_is_ours(caller, chose)  # the caller asked for it
    assert not _separate_build_is_ours({}, {**chose, "fullgraph": False})  # part may have run
    one_file = {"fullgraph": True, "options": {"cpp_wrapper_build_separate": False}}
    assert not _separate_build_is_ours({"fullgraph": True}, one_file)


def test_the_cpu_isa_probe_starts_once_and_only_where_inductor_will_want_it(monkeypatch):
    from torch._inductor import cpu_vec_isa

    callers: list[str] = []
    monkeypatch.setattr(
        cpu_vec_isa,
        "valid_vec_isa_list",
        lambda: callers.append(threading.current_thread().name) or [],
    )

    def started(options):
        monkeypatch.setattr(options_mod, "_ISA_PROBE", [])
        callers.clear()
        options_mod.probe_cpu_isa_early(options)
        for t in options_mod._ISA_PROBE:
            t.join(timeout=10)
        return callers == ["fasttorch-cpu-isa-probe"]

    assert started({"backend": "inductor"})
    assert started({"backend": "inductor", "options": {"max_autotune": True}})
    assert not started({"backend": "aot_eager"})
    # A different C++ toolchain or ISA: inductor's own in-line probe must see the options.
    assert not started({"backend": "inductor", "options": {"cpp.simdlen": 256}})
    assert not started({"backend": "inductor", "options": {"cpp": {"cxx": ("g++",)}}})
    # Once per process.
    monkeypatch.setattr(options_mod, "_ISA_PROBE", [])
    options_mod.probe_cpu_isa_early({"backend": "inductor"})
    options_mod.probe_cpu_isa_early({"backend": "inductor"})
    assert len(options_mod._ISA_PROBE) == 1
    options_mod._ISA_PROBE[0].join(timeout=10)
    assert callers.count("fasttorch-cpu-isa-probe") == 1


# A process that starts the real probe and lists the modules its thread imported.
PROBE_CHILD = """
import sys, threading
from fasttorch._compile import inductor_options as options
imported = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if threading.current_thread().name == "fasttorch-cpu-isa-probe":
            imported.append(name)
sys.meta_path.insert(0, Watch())
options.probe_cpu_isa_early({"backend": "inductor"})
options._ISA_PROBE[0].join(timeout=300)
assert not options._ISA_PROBE[0].is_alive()
print(imported)
"""


def test_the_cpu_isa_probe_thread_imports_nothing(tmp_path):
    """Its imports would race the caller's: setuptools' distutils shim edits
    sys.meta_path while Python walks it for another thread's import, which then fails
    ("No module named 'torch.distributed.tensor.experimental'" inside dynamo)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE_CHILD], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_cpu_isa_probe_is_not_started_for_a_gpu_step_or_another_backend(monkeypatch):
    compiled_mod = importlib.import_module("fasttorch.transforms.compiled")

    seen: list[dict] = []
    monkeypatch.setattr(compiled_mod, "probe_cpu_isa_early", lambda opts: seen.append(opts))
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")(state, next(iter(batches(1, 8))))
    assert len(seen) == 1, "a CPU step asks on its first call; the backend is judged inside"
    assert not compiled_mod._on_cpu(({"w": torch.empty(2, device="meta")}, None))
    assert compiled_mod._on_cpu(({"w": torch.empty(2)}, None))


def test_compiles_any_state_batch_callable():
    calls = []

    def custom(state, batch):
        calls.append(1)
        return state, {"n": batch.sum()}

    fast = fasttorch.compiled(custom, backend="aot_eager")
    assert fast.__name__ == "custom"
    _, m = fast(torch.zeros(2), torch.ones(3))
    assert float(m["n"]) == 3.0
    with pytest.raises(ValueError, match="already compiled"):
        fasttorch.compiled(fast)
    with pytest.raises(TypeError, match="expects a step or a callable"):
        fasttorch.compiled(3)


def test_graph_break_in_a_loss_function_is_an_error_by_default():
    def breaks(apply, batch):
        x, y = batch
        print("host side effect")
        torch._dynamo.graph_break()
        return mse(apply, (x, y))

    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.sgd(0.1))
    with pytest.raises(Exception, match="(?i)graph.break"):
        fasttorch.compiled(fasttorch.step(breaks), backend="aot_eager")(state, batches(1, 8)[0])


def test_many_different_compiled_steps_in_one_process_do_not_recompile():
    """Dynamo caches per code object and every step's kernels share their source; each
    compiled step gets its own copy, or the ninth would hit the recompile limit (a hard
    failure with fullgraph=True)."""
    limit = torch._dynamo.config.recompile_limit
    for depth in range(1, limit + 3):
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(depth)])
        state = fasttorch.TrainState.create(model, fasttorch.optim.sgd(0.1))
        step = fasttorch.compiled(fasttorch.step(mse), backend="aot_eager")
        for _ in range(2):
            state, _ = step(state, (torch.randn(8, 4), torch.randn(8, 4)))
    assert sum(counters["recompiles"].values()) == 0
    assert counters["stats"]["unique_graphs"] == limit + 2


def test_options_reach_every_kernel():
    """torch.compile pops guard_filter_fn from its options: each kernel gets a copy."""
    calls = []

    def keep_all(entries):
        calls.append(len(entries))
        return [True] * len(entries)

    opts = {"guard_filter_fn": keep_all}
    step = fasttorch.compiled(
        fasttorch.grad_accumulate(fasttorch.step(mse), 2), backend="aot_eager", options=opts
    )
    opt = fasttorch.optim.sgd(0.1, opaque=False)  # the update traced, in a graph of its own
    state = fasttorch.TrainState.create(LayerNormNet(), opt)
    for b in batches(2, 8):
        state, _ = step(state, b)
    assert len(calls) == 2, "both graphs (microbatch, update) saw the filter"
    assert opts == {"guard_filter_fn": keep_all}, "the caller's dict is left as it was"


def test_inductor_gets_the_fusion_search_cap_unless_told_otherwise():
    from fasttorch._compile.inductor_options import FUSION_ATTEMPTS, _with_fusion_cap

    key = "max_fusion_buffer_group_pairwise_attempts"
    assert _with_fusion_cap({"backend": "inductor"})["options"] == {key: FUSION_ATTEMPTS}
    assert _with_fusion_cap({"backend": "aot_eager"}) == {"backend": "aot_eager"}
    mine = _with_fusion_cap({"backend": "inductor", "options": {key: 64}})
    assert mine["options"] == {key: 64}
    # torch.compile refuses mode and options together: the mode becomes its options.
    ro = _with_fusion_cap({"backend": "inductor", "mode": "reduce-overhead"})
    assert "mode" not in ro and ro["options"] == {"triton.cudagraphs": True, key: FUSION_ATTEMPTS}
    torch.compile(lambda x: x, **ro)  # accepted


def test_on_cpu_the_microbatch_graph_gets_the_cpp_wrapper_and_the_update_graph_does_not(
    monkeypatch,
):
    """What reaches torch.compile for each kernel (recorded; the kernels then run eagerly)."""

    seen = []

    def record(fn, **kwargs):
        seen.append((fn.__name__, kwargs.get("options")))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    monkeypatch.setattr(options_mod, "_ISA_PROBE", [object()])  # no probe thread from here

    def kernels_options(opaque=False, n=2, **compile_kwargs):
        seen.clear()
        torch.manual_seed(0)
        opt = fasttorch.optim.adamw(1e-2, opaque=opaque)  # opaque=False: the update traced
        state = fasttorch.TrainState.create(LayerNormNet(), opt)
        step = fasttorch.step(mse)
        if n > 1:
            step = fasttorch.grad_accumulate(step, n)
        step = fasttorch.compiled(step, cpu_gemm="native", **compile_kwargs)
        step(state, batches(1, 8)[0])
        return dict(seen)

    # The default (torch's fused kernel) runs the update outside the graphs: the
    # gradients' graph is the only one, with the C++ wrapper, accumulating or not.
    assert set(kernels_options(opaque=True)) == {"_micro"}
    assert kernels_options(opaque=True, n=1)["_grad"]["cpp_wrapper"] is True
    assert "cpp_wrapper" not in kernels_options(n=1)["_full"]
    got = kernels_options()
    assert set(got) == {"_micro", "_close"}, got
    assert got["_micro"]["cpp_wrapper"] is True
    assert got["_micro"]["cpp_wrapper_build_separate"] is True
    # the wrapper (one large function) at -Og: GCC's -O1 grows faster than its size
    assert got["_micro"][options_mod.WRAPPER_OPT] == options_mod.WRAPPER_OPT_LEVEL == "Og"
    assert options_mod.WRAPPER_OPT not in got["_close"]
    mine = kernels_options(options={options_mod.WRAPPER_OPT: "O1"})["_micro"]
    assert mine[options_mod.WRAPPER_OPT] == "O1"
    one_file = kernels_options(options={"cpp_wrapper_build_separate": False})["_micro"]
    assert options_mod.WRAPPER_OPT not in one_file  # one file: the kernels' -O3 for all
    assert "cpp_wrapper" not in got["_close"]
    assert "cpp_wrapper_build_separate" not in got["_close"]
    # the caller's choice stands, either way
    assert kernels_options(options={"cpp_wrapper": False})["_micro"]["cpp_wrapper"] is False
    assert kernels_options(options={"cpp_wrapper": True})["_close"]["cpp_wrapper"] is True
    # other backends take no inductor options
    assert kernels_options(backend="aot_eager")["_micro"] is None


def test_the_cpp_wrapper_is_for_graphs_whose_tensors_are_all_on_the_cpu():
    from fasttorch._compile.inductor_options import _only_on_cpu, _with_cpp_wrapper

    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    assert _only_on_cpu(({"a": cpu}, [cpu], 3))
    assert not _only_on_cpu(({"a": cpu}, meta))
    assert not _only_on_cpu((meta,))
    assert not _only_on_cpu((1, "x"))
    opts = {"backend": "inductor", "options": {"max_autotune": True}}
    assert _with_cpp_wrapper(opts)["options"] == {
        "max_autotune": True,
        "cpp_wrapper": True,
        "cpp_wrapper_build_separate": True,
        "aot_inductor.compile_wrapper_opt_level": "Og",
    }
    assert opts["options"] == {"max_autotune": True}, "the caller's dict is left as it was"
    # the caller's choice of a one-file build stands
    mine = {"backend": "inductor", "options": {"cpp_wrapper_build_separate": False}}
    assert _with_cpp_wrapper(mine)["options"]["cpp_wrapper_build_separate"] is False
    torch.compile(lambda x: x, **_with_cpp_wrapper(opts))  # options torch accepts
    assert _with_cpp_wrapper({"backend": "aot_eager"}) == {"backend": "aot_eager"}


def test_a_set_cpu_capability_without_a_cache_of_its_own_is_warned_about(monkeypatch):
    """Inductor's cache keys ignore ATEN_CPU_CAPABILITY (a run of another setting's
    kernels crashed or gave NaN): compiled says so once, unless the cache is separate."""
    from fasttorch import steps

    steps.warn_once.cache_clear()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/somewhere")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options_mod._check_isa_cache()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with pytest.warns(UserWarning, match="TORCHINDUCTOR_CACHE_DIR"):
        options_mod._check_isa_cache()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    steps.warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options_mod._check_isa_cache()


def test_inductor_has_option_reads_a_sections_option():
    assert _compat.inductor_has_option("cpp_wrapper")
    assert _compat.inductor_has_option("aot_inductor.compile_wrapper_opt_level")
    assert not _compat.inductor_has_option("aot_inductor.no_such_option")
    assert not _compat.inductor_has_option("no_such_section.cpp_wrapper")


def test_compiled_eval_step_gets_the_cpp_wrapper_on_a_cpu(monkeypatch):
    """eval_step's function holds no update: its graph builds as a step's gradient
    graphs, with the C++ wrapper at -Og (one C++ build, not one per kernel)."""
    seen = []

    def record(fn, **kwargs):
        seen.append(kwargs.get("options"))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    monkeypatch.setattr(options_mod, "_ISA_PROBE", [object()])  # no probe thread from here
    torch.manual_seed(0)
    state = fasttorch.TrainState.create(LayerNormNet(), fasttorch.optim.adamw(1e-2))
    fast = fasttorch.compiled(fasttorch.eval_step(fasttorch.step(mse)), cpu_gemm="native")
    fast(state, batches(1, 8)[0])
    assert seen[-1]["cpp_wrapper"] is True
    assert seen[-1][options_mod.WRAPPER_OPT] == "Og"
    seen.clear()
    plain = fasttorch.compiled(lambda state, batch: (state, {}), cpu_gemm="native")
    plain(state, batches(1, 8)[0])
    assert "cpp_wrapper" not in seen[-1]  # a custom step compiled whole may hold an update


def test_a_loaded_traced_step_runs_its_first_call_under_its_inductor_options():
    """A traced step loaded from cache_dir builds its C++ at its first call, under the
    options it was traced with (the wrapper's -Og is part of the build's key)."""
    from torch._inductor import config

    from fasttorch._compile.cache import _Guarded

    class Loaded:
        def guard_check(self, *args, **kwargs):
            return True

        def __call__(self, *args, **kwargs):
            return config.aot_inductor.compile_wrapper_opt_level

    options = {options_mod.WRAPPER_OPT: "Og", "guard_filter_fn": None}
    guarded = _Guarded(Loaded(), lambda *a: None, "step", (), options)
    before = config.aot_inductor.compile_wrapper_opt_level
    assert guarded() == "Og"
    assert guarded() == before  # later calls as they are
    assert config.aot_inductor.compile_wrapper_opt_level == before


def test_a_two_file_cpp_build_compiles_both_files_at_once(tmp_path):
    """compiled's graphs build the C++ wrapper and the kernels in parallel, then link;
    inductor's own function is back after the block."""
    import threading
    import time

    from torch._inductor import codecache

    original = codecache._worker_compile_cpp
    running, most, lock = [0], [0], threading.Lock()

    class Builder:
        def __init__(self, name):
            self.path = str(tmp_path / name)

        def get_target_file_path(self):
            return self.path

        def build(self):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.2)
            with lock:
                running[0] -= 1
            open(self.path, "w").close()

    with _compat.parallel_cpp_builds():
        assert codecache._worker_compile_cpp is not original
        builders = [Builder("main.o"), Builder("kernels.o"), Builder("lib.so")]
        codecache._worker_compile_cpp(str(tmp_path / "lock"), builders)
    assert codecache._worker_compile_cpp is original
    assert most[0] == 2  # the two compiles at once; the link after them
    assert all(os.path.exists(b.path) for b in builders)
