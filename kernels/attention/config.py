"""The sparse-attention family's choices (kernels/attention/triton.py): which launch shape a step
of T tokens gets, and how the decode key list is split.

Three launch shapes, each (heads per program, keys per tile, warps, pipeline stages), picked by
the step's token count. The defaults come from the H200 timings (docs/kernels/attention.md): 16
heads x 32 keys x 4 warps up to WIDE_TOKENS (R=64: 135 us vs 149 us at 8 warps) and for prefill
(8K tokens over 16K-128K: 10.0-11.3 ms vs 11.9-12.8 ms); 64 heads (wgmma) x 32 keys x 8 warps
from 128 tokens (R=256: 386 us vs 471 us). Prefill runs unsplit with the software-pipelined top-k
loop (`prefill_pipe`: 11.41 -> 9.07 ms at the slice's 8K step, ratio 1, the same output bits).
"""
from __future__ import annotations

from dataclasses import dataclass

from megagraph.kernels.kernel_config import KernelConfig, register


@register
@dataclass(frozen=True)
class AttentionConfig(KernelConfig):
    """decode / wide / prefill: (block_h, block_n, num_warps, num_stages) of each launch shape;
    wide_tokens / prefill_tokens: the token counts from which the wide / prefill shape runs;
    decode_splits: programs the key list is split over below prefill_tokens (0: enough for two
    waves of the GPU, at most max_splits); prefill_pipe: the pipelined top-k loop at prefill;
    combine_heads: heads per program of the split merge (64 spills its 64 x 512 accumulator)."""

    FAMILY = "attention"
    OPS = ("sparse_attn", "sparse_attn_q")

    decode: tuple[int, int, int, int] = (16, 32, 4, 2)
    wide: tuple[int, int, int, int] = (64, 32, 8, 2)
    prefill: tuple[int, int, int, int] = (16, 32, 4, 2)
    wide_tokens: int = 128
    prefill_tokens: int = 1024
    decode_splits: int = 0
    max_splits: int = 8
    prefill_pipe: bool = True
    combine_heads: int = 16

    def choose(self, shape: dict[str, int]) -> dict[str, str]:
        """{"attention": "decode" | "wide" | "prefill"} for shape["tokens"] tokens."""
        T = shape.get("tokens", 1)
        if T >= self.prefill_tokens:
            return {"attention": "prefill"}
        return {"attention": "wide" if T >= self.wide_tokens else "decode"}
