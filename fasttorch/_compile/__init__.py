"""The machinery behind :func:`fasttorch.compiled`: inductor options, the CPU matrix-product
pass, regional compilation, the compile cache and its fingerprint, recompile accounting,
the generated code object and traced errors.

Private: only ``fasttorch.transforms.compiled`` (the public signature and docstring)
and the testing kit import it.
"""
