"""Loaded before any test module or doctest imports torch."""

import os

# OpenMP threads that spin-wait between kernels slow steps down many times over as soon
# as another process (a spawned rank, a subprocess test) shares the cores; the variable
# is read once, when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Inductor's compile cache does not tell code generated for one vector instruction set
# from code for another: a run with ATEN_CPU_CAPABILITY=avx2 and a default run sharing
# one cache load each other's kernels, which crashed or gave NaN (seen with torch
# 2.10-2.13 and a plain torch.compile). A run that sets the capability gets a cache of
# its own, unless the caller chose a cache directory.
_isa = os.environ.get("ATEN_CPU_CAPABILITY")
if _isa and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}", f"isa-{_isa}"
    )

# pytest-xdist's --dist loadfile (the README's test command) hands out whole files, by
# default those with the most tests first. The files below run for minutes with few tests
# (spawned ranks, subprocesses, inductor builds): started last, one keeps a worker busy
# while the other idles. They go first, longest first (worker seconds in a two-worker
# run on 2 cores, 2026-11-28: 400-510, 320-390, 155-185, then 90-140 each); every other
# file follows in xdist's own order (most tests first). Names that no longer exist are
# caught by tests/test_suite_order.py.
LONGEST_FIRST = (
    "test_benchmarks.py",
    "test_compile_cache.py",
    "test_fsdp.py",
    "test_activation_checkpointing.py",
    "test_equivalence.py",
    "test_several.py",
    "test_regions.py",
    "test_example_fsdp.py",
    "test_distributed.py",
    "test_optim_torch.py",
    "test_compiled.py",
    "test_checkpoint.py",
)


def pytest_configure(config):
    # xdist >= 3.7 reorders files by their number of tests unless told not to; older
    # releases keep the collection's order, which the hook below sets either way.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests: dict[str, int] = {}
    for item in items:
        tests[item.nodeid.split("::")[0]] = tests.get(item.nodeid.split("::")[0], 0) + 1

    def key(item):
        path = item.nodeid.split("::")[0]
        return (rank.get(os.path.basename(path), len(rank)), -tests[path], path)

    items.sort(key=key)  # stable: a file's tests keep their order
