"""The indexer family's choices: the lightning-indexer score kernel (kernels/indexer/triton.py)
and the top-k / candidate-block selection (kernels/indexer/triton_topk.py).

Index scores: with bf16 products (V4.1's MXFP4-exact operands) the queries-stationary "stream"
kernel runs (8192 tokens after a 128K context at ratio 1: 25.7 ms vs 153.5 ms for the "tile"
kernel on the H200); fp32 products (`index_precision`) run the tile kernel, the one measured
with them.
Top-k and candidate blocks: one streaming select (each row read once into a small candidate
buffer per program); what it does not take (more than `stream_max_k` kept entries) runs the
capturable kernel. Numbers and method: docs/kernels/indexer.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megagraph.kernels.kernel_config import KernelConfig, register


@register
@dataclass(frozen=True)
class IndexerConfig(KernelConfig):
    """index_*: the score kernel (index_kernel_bf16 / _fp32: the kernel for bf16 / fp32
    products; index_precision: fp32
    products' tensor-core mode; index_max_token_tile: the tile kernel's largest token tile;
    index_block_c: its entries per program; index_span_keys: entries one stream program of the
    long class walks, for L2 locality; index_programs_per_sm: the grid is widened by shorter
    spans until it has this many; index_long_request: tokens of a request from which its tokens
    go 8 to a tile).
    topk_* / stream_* / cand_*: the selection (topk_segments: segments per row, 0:
    enough programs for the GPU when T is small, segments of >= stream_seg_min columns;
    stream_block: entries per step of a row; stream_cap: buffer entries per program (raised to
    what the k needs); stream_tb / stream_merge_tb / cand_merge_tb: buffer entries per step of
    the select, of topk's merge and of candidate_mask's merge (register pressure: the sm_90
    builds do not spill at these); cand_stream_elems / cand_write_elems: candidate_mask's
    entries per step of the stream and of the mask write; stream_max_k: the largest kept count
    the stream variant takes; stream_masked_loads: with a mask, load only the scores it keeps)."""

    FAMILY = "indexer"
    OPS = ("index_scores", "topk_select", "candidate_mask")

    index_kernel_bf16: Literal["stream", "tile"] = "stream"
    index_kernel_fp32: Literal["stream", "tile"] = "tile"
    index_precision: Literal["tf32x3", "ieee", "bf16"] = "tf32x3"
    index_max_token_tile: int = 4
    index_block_c: int = 64
    index_span_keys: int = 4096
    index_programs_per_sm: int = 4
    index_long_request: int = 8
    topk_segments: int = 0
    stream_block: int = 1024
    stream_cap: int = 4096
    stream_tb: int = 256
    stream_merge_tb: int = 512
    cand_merge_tb: int = 256
    stream_seg_min: int = 16384
    cand_stream_elems: int = 2048
    cand_write_elems: int = 4096
    stream_max_k: int = 16384
    stream_masked_loads: bool = True

    def choose(self, shape: dict[str, int]) -> dict[str, str]:
        """Each op's kernel: index_scores from shape["bf16_products"] (1: the node's operands are
        exact in bf16, default 1), topk_select from shape["k"] and shape["columns"],
        candidate_mask from shape["topk_blocks"], shape["block"] and shape["columns"] (absent
        facts: the variant's usual case)."""
        bf16 = shape.get("bf16_products", 1)
        C = shape.get("columns", 1)
        out = {"index_scores": self.index_kernel_bf16 if bf16 else self.index_kernel_fp32}
        kk = min(shape.get("k", 1), C) if "columns" in shape else shape.get("k", 1)
        out["topk_select"] = self._select(kk, C)
        nb = -(-C // max(1, shape.get("block", 1)))
        kb = min(shape.get("topk_blocks", 1), nb) if "columns" in shape else \
            shape.get("topk_blocks", 1)
        out["candidate_mask"] = self._select(kb, C)
        return out

    def _select(self, kk: int, C: int) -> str:
        """"stream" where it fits (kk <= stream_max_k: its buffers grow with kk, T * S * (kk +
        step) * 8 bytes; its column arithmetic, a few steps past C, in int32), else
        "capturable"."""
        fits = kk <= self.stream_max_k and \
            C < 2**31 - 4 * max(self.stream_block, self.cand_stream_elems)
        return "stream" if fits else "capturable"
