"""The op library: signature, type rule, capture class and doc of every op, one module per topic.

Reference kernels with the same names live in kernels/reference/; fused ops that only passes
create live in `fused.py`.
"""

from . import attention, core, dspark, engram, fused, indexer, mhc, moe, parallel, v4  # noqa: F401
