"""Loaded before any test module or doctest imports torch."""

import os

# OpenMP threads that spin-wait between kernels slow steps down many times over as soon
# as another process (a spawned rank, a subprocess test) shares the cores; the variable
# is read once, when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
