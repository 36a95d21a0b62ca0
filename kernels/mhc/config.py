"""The mHC family's choices (kernels/mhc/triton.py): when mega_mhc runs as one launch.

mega_mhc runs either fused (one launch: the split projection programs take arrival tickets and
the last one of each token block finishes it) or unfused (projection, split-K reduce, finish:
2-3 launches). Both give the same bits at every T. Fused wins at decode sizes (64 tokens on the
H200: 45.8 us vs 61.7 us) and loses at prefill sizes, where its finish runs on one program per
64-token block (8192 tokens: 524 us vs 327 us); the crossover is near 64-96 tokens
(docs/kernels/mhc.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megagraph.kernels.kernel_config import KernelConfig, register


@register
@dataclass(frozen=True)
class MhcConfig(KernelConfig):
    """fused: "auto" (one launch up to fused_tokens tokens, unfused above), "always", "never";
    fused_tokens: the largest token count of the one-launch plan (its 8-token blocks under the
    16-row mma.sync tile); split_tokens: from this many tokens the unfused launches use 64-row
    wgmma tiles (the weight read and split into bf16 hi / lo once per 64 tokens)."""

    FAMILY = "mhc"
    OPS = ("mega_mhc", "hc_expand")

    fused: Literal["auto", "always", "never"] = "auto"
    fused_tokens: int = 64
    split_tokens: int = 256

    def choose(self, shape: dict[str, int]) -> dict[str, str]:
        """{"mega_mhc": "fused" | "unfused"} at shape["tokens"] tokens (the launch it asks for;
        the fused split path also needs its arrival counters: mega_mhc's docstring)."""
        T = shape.get("tokens", 1)
        if self.fused == "auto":
            one = T <= self.fused_tokens
        else:
            one = self.fused == "always"
        return {"mega_mhc": "fused" if one else "unfused"}
