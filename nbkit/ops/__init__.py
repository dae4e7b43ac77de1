"""Pure numerics: kernels and autograd functions that never import transformers or PEFT.

Each module holds one op and is checked against a reference implementation in ``tests/ops/``. The speedups in
``nbkit.speedups`` wire these into models.
"""
