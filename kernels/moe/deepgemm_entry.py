"""The plan's kernel `deepgemm.fp8_fp4_mega_moe`: mega_moe with DeepGEMM's MegaMoE switched on.

The registry marks DeepGEMM's MegaMoE "unvalidated" (built, never run on its device), so a plan
names it only when compiled with `--allow-unvalidated`; that plan then runs this entry point,
which is kernels/moe/triton.py's mega_moe with `MoeConfig.deepgemm_mega = "on"` (DeepGEMM where
it takes the call, the Triton kernels elsewhere: deepgemm_mega.decline_reason says why).
"""

from __future__ import annotations

import dataclasses

from megagraph.kernels.moe import triton
from megagraph.kernels.moe.config import MoeConfig


def mega_moe(*args, kernel_config: MoeConfig | None = None, gemm_config=None, **kw):
    cfg = dataclasses.replace(kernel_config or MoeConfig(), deepgemm_mega="on")
    return triton.mega_moe(*args, kernel_config=cfg, gemm_config=gemm_config, **kw)
