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
