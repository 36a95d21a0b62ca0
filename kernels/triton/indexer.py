"""Lightning indexer scores on the GPU (Triton), same semantics as
kernels.reference.indexer.index_scores; candidate blocks and top-k stay the capturable torch
versions (device-side torch.topk / sort, no host sync).

Tiles: each program takes BT tokens of one request (kernels.capturable._common.segment_tiles,
built on the device) and BC compressed entries of its slot; the (token, head) rows form one
[BT*Hi, Di] x [Di, BC] product, then ReLU, head weights and the sum over heads in registers.
Decode steps (one token per request) get BT = 1; longer requests BT = 4, so index keys are read
once per 4 tokens.

Precision: the reference multiplies in fp32. PRECISION = "tf32x3" (default) splits the fp32
operands into tf32 pairs on the tensor cores (relative error ~1e-6 of sum |w·relu(q·k)|, below
fp32 summation-order noise at these lengths); "ieee" is exact fp32 FMA (slower); "bf16" rounds
both operands to bf16, exact only for inputs representable in bf16 — which MXFP4 fake-quantized
index queries and keys (V4.1's quantize_kv) are: the indexer-products pass marks such nodes
`products="bf16"` and this kernel then multiplies in bf16 (1.5-2.9x faster on the H200,
benchmarks/results/kernels-h200.md; exactness: tests/kernels/test_triton_indexer.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention import INTERPRET, _on_device, available

PRECISION = "tf32x3"
MAX_TOKEN_TILE = 4


BLOCK_C = 64  # entries per program; with 8 warps no register spills in the sm_90 build


def supports(qi: Tensor, ikey: Tensor) -> bool:
    _, hi, di = qi.shape
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return (available() and _on_device(qi) and pow2(hi) and pow2(di) and hi >= 16 and di >= 16
            and ikey.dtype in (torch.float32, torch.bfloat16, torch.float16))


def index_scores(qi: Tensor, w: Tensor, ikey: Tensor, positions: Tensor, token_req: Tensor,
                 seq_slots: Tensor, *, ratio: int, weight_scale: float, products: str = "fp32",
                 precision: str | None = None, token_tile: int | None = None,
                 out: Tensor | None = None) -> Tensor:
    """kernels.reference.indexer.index_scores; `products="bf16"` (the node's attr: operands exact
    in bf16) multiplies in bf16, else PRECISION; `precision` / `token_tile` override the defaults,
    `out` is a preallocated f32[T, C] result (tests poison it)."""
    if not supports(qi, ikey):
        from megagraph.kernels.capturable.indexer import index_scores as fallback

        return fallback(qi, w, ikey, positions, token_req, seq_slots, ratio=ratio,
                        weight_scale=weight_scale)
    import triton

    from megagraph.kernels.capturable._common import segment_tiles

    from .indexer_jit import index_scores_fwd

    T, hi, di = qi.shape
    C = ikey.shape[1]
    R = seq_slots.shape[0]
    out = torch.empty(T, C, dtype=torch.float32, device=qi.device) if out is None else out
    if T == 0 or C == 0:
        return out.fill_(float("-inf"))
    bt = token_tile or min(MAX_TOKEN_TILE, 1 << (max(1, T // max(1, R)).bit_length() - 1))
    tiles = segment_tiles(token_req, R, bt)
    items = tiles.items.contiguous()
    ivalid = tiles.item_valid.to(torch.int8)
    tslot = seq_slots[tiles.seg].contiguous()
    qi = qi if qi.stride(-1) == 1 else qi.contiguous()
    ikey = ikey if ikey.stride(-1) == 1 else ikey.contiguous()
    w = w.contiguous()
    bc = BLOCK_C
    prec = "ieee" if INTERPRET else (precision or ("bf16" if products == "bf16" else PRECISION))
    index_scores_fwd[(tiles.count, triton.cdiv(C, bc))](
        qi, w, ikey, out, positions, items, ivalid, tslot,
        C, ratio, float(weight_scale), qi.stride(0), qi.stride(1), w.stride(0),
        ikey.stride(0), ikey.stride(1), out.stride(0),
        HI=hi, DI=di, BT=bt, BC=bc, PREC=prec, num_warps=8, num_stages=2)
    return out


index_scores.capturable = True

__all__ = ["index_scores", "supports", "PRECISION"]
