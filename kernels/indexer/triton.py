"""Lightning indexer scores on the GPU (Triton), same semantics as
kernels.indexer.reference.index_scores; candidate blocks and top-k are kernels/indexer/triton_topk.py.

Two kernels (kernels/indexer/triton_jit.py):
- index_scores_stream (the default with bf16 products, V4.1's): queries stationary. A program
  holds BT tokens' [BT*HI, DI] queries (one request's) and walks a span of its slot's entries,
  BC at a time, keys on the MMA's M side: [BC, BT*HI] products, ReLU, head weights and the sum
  over heads inside a thread and its quad. Requests with >= LONG_REQUEST tokens go 8 tokens to a
  tile (keys read once per 8 tokens), the others 1 (decode); the class is decided on the device,
  because a captured prefill bucket has as many request rows as tokens, like a decode bucket.
  Spans of SPAN_KEYS entries, token tiles the grid's fast axis: the programs resident together
  share a span's keys in L2. On the H200 (benchmarks/results/index-probe-11-h200.md), 8192 new
  tokens after a 128K context at ratio 1: 153.5 ms -> 25.7 ms (348 TFLOP/s); decode, 64
  requests at 128K: 1.31 -> 1.07 ms (84% of HBM bandwidth on the keys).
- index_scores_fwd (the tile kernel; fp32 products, and MEGAGRAPH_INDEX_KERNEL=tile): a program
  per BT tokens x BLOCK_C entries, the queries reloaded for every 64 entries (64 KB per program
  at BT 4: about 5x the bytes of the keys it multiplies, which is what bounded it). Decode steps
  get BT = 1, longer requests BT = 4.

Precision: the reference multiplies in fp32. PRECISION = "tf32x3" (default) splits the fp32
operands into tf32 pairs on the tensor cores (relative error ~1e-6 of sum |w·relu(q·k)|, below
fp32 summation-order noise at these lengths); "ieee" is exact fp32 FMA (slower); "bf16" rounds
both operands to bf16, exact only for inputs representable in bf16 — which MXFP4 fake-quantized
index queries and keys (V4.1's quantize_kv) are: the indexer-products pass marks such nodes
`products="bf16"` and the kernels then multiply in bf16 (exactness:
tests/kernels/test_triton_indexer.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from megagraph.kernels.attention.triton import INTERPRET, _on_device, available, sm_count

PRECISION = "tf32x3"
MAX_TOKEN_TILE = 4


BLOCK_C = 64  # entries per program; with 8 warps no register spills in the sm_90 build


@dataclass(frozen=True)
class StreamConfig:
    """A launch of index_scores_stream: bt tokens x bc entries per product, keys_m = the keys on
    the MMA's M side, warps, stages of the key pipeline, span = entries one program walks."""
    bt: int
    bc: int
    keys_m: bool
    warps: int
    stages: int
    span: int


# bf16 products: "stream" (queries stationary, index_scores_stream) or "tile" (index_scores_fwd: a
# program per token tile x BLOCK_C entries, the queries reloaded per program); the probe A/Bs both
VARIANT = os.environ.get("MEGAGRAPH_INDEX_KERNEL", "stream")
if VARIANT not in ("stream", "tile"):
    raise ValueError(f"MEGAGRAPH_INDEX_KERNEL={VARIANT!r}: expected 'stream' or 'tile'")
SPAN_KEYS = 4096  # entries per program of the long class: 2 MB of f32 keys per slot stay in L2
PROGRAMS_PER_SM = 4  # the grid is widened by shorter spans until it has this many per SM
LONG_REQUEST = 8  # tokens in a request from which its tokens go 8 to a tile


def _spans(C: int, bc: int, tiles: int, sms: int, span_keys: int | None) -> int:
    """Entries per program: at most span_keys (L2 locality), fewer until the grid has
    PROGRAMS_PER_SM programs per SM."""
    nblk = -(-C // bc)
    spans = min(nblk, max(-(-C // span_keys) if span_keys else 1,
                          -(-PROGRAMS_PER_SM * sms // max(1, tiles))))
    return -(-nblk // max(1, spans)) * bc


def stream_configs(T: int, R: int, C: int, prec: str, sms: int) -> tuple[StreamConfig, StreamConfig]:
    """The two launches of a step of T tokens in R requests against C entries: (long, short).

    The token tile cannot follow the step's shape: a captured prefill bucket of B tokens has B
    request rows (the real requests and padding), exactly like a decode bucket, so T / R says
    nothing. Each request's tokens therefore go to one of two classes on the device: requests with
    at least LONG_REQUEST tokens to tiles of 8 (keys read once per 8 tokens: the prefill products
    are bound by the keys' L2 bytes at 4), the others to tiles of 1 (decode: memory-bound, no
    padded rows in the products). Each launch's programs of the other class exit at once; no
    tile list is built (a tile = BT consecutive tokens of the step: the decode step pays three
    small torch kernels for the classes, not segment_tiles' thirty). Long spans stay short for L2
    locality; the short class's span is as long as the grid allows (its requests share no keys).
    Shapes: the sm_90 builds without spills (tests/kernels/test_triton_attention_sm90.py)."""
    if prec == "bf16":  # the fastest of benchmarks/results/index-probe-11-h200.md's launches
        long_bt, long_keys_m, long_stages, short_warps, short_stages = 8, True, 3, 4, 4
    else:  # fp32 queries in registers: 4 tokens with the queries on M, 8 warps for one token
        long_bt, long_keys_m, long_stages, short_warps, short_stages = 4, False, 2, 8, 2
    nt_long = -(-T // long_bt)
    long = StreamConfig(long_bt, 64, long_keys_m, 8, long_stages,
                        _spans(C, 64, nt_long, sms, SPAN_KEYS))
    short = StreamConfig(1, 64, True, short_warps, short_stages, _spans(C, 64, T, sms, None))
    return long, short


def supports(qi: Tensor, ikey: Tensor) -> bool:
    _, hi, di = qi.shape
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return (available() and _on_device(qi) and pow2(hi) and pow2(di) and hi >= 16 and di >= 16
            and ikey.dtype in (torch.float32, torch.bfloat16, torch.float16))


def index_scores(qi: Tensor, w: Tensor, ikey: Tensor, positions: Tensor, token_req: Tensor,
                 seq_slots: Tensor, *, ratio: int, weight_scale: float, products: str = "fp32",
                 precision: str | None = None, token_tile: int | None = None,
                 variant: str | None = None, config: StreamConfig | None = None,
                 short_config: StreamConfig | None = None, out: Tensor | None = None) -> Tensor:
    """kernels.indexer.reference.index_scores; `products="bf16"` (the node's attr: operands exact
    in bf16) multiplies in bf16, else PRECISION; `precision` / `token_tile` / `variant` /
    `config` / `short_config` (the stream kernel's long / short class launches) override the
    defaults, `out` is a preallocated f32[T, C] result (tests poison it)."""
    if not supports(qi, ikey):
        from megagraph.kernels.indexer.capturable import index_scores as fallback

        return fallback(qi, w, ikey, positions, token_req, seq_slots, ratio=ratio,
                        weight_scale=weight_scale)
    T, C = qi.shape[0], ikey.shape[1]
    out = torch.empty(T, C, dtype=torch.float32, device=qi.device) if out is None else out
    if T == 0 or C == 0:
        return out.fill_(float("-inf"))
    prec = "ieee" if INTERPRET else (precision or ("bf16" if products == "bf16" else PRECISION))
    args = (qi if qi.stride(-1) == 1 else qi.contiguous(), w.contiguous(),
            ikey if ikey.stride(-1) == 1 else ikey.contiguous(), out, positions, token_req,
            seq_slots, ratio, float(weight_scale), prec)
    # the stream kernel is measured with bf16 products (V4.1's, benchmarks/index_probe.py); the
    # fp32-product modes keep the tile kernel by default
    if (variant or (VARIANT if prec == "bf16" else "tile")) == "stream":
        _launch_stream(*args, config, short_config, token_tile)
    else:
        _launch_tile(*args, token_tile)
    return out


def _launch_stream(qi, w, ikey, out, positions, token_req, seq_slots, ratio, weight_scale, prec,
                   config, short_config, token_tile) -> None:
    """index_scores_stream's two launches (stream_configs: the long and the short class)."""
    import triton

    from megagraph.kernels.common.capturable import seg_counts

    from megagraph.kernels.indexer.triton_jit import index_scores_stream

    T, hi, di = qi.shape
    C, R = ikey.shape[1], seq_slots.shape[0]
    long, short = stream_configs(T, R, C, prec, sm_count(qi.device))
    short = short_config or short
    if short.bt != 1:
        raise ValueError(f"the short class takes 1-token tiles, not {short.bt}")
    if config is not None or token_tile:
        long = config or long
        long = StreamConfig(token_tile, long.bc, long.keys_m, long.warps, long.stages,
                            long.span) if token_tile else long
        if long.bt > LONG_REQUEST:
            raise ValueError(f"token tile {long.bt} > LONG_REQUEST {LONG_REQUEST}: a tile "
                             "could meet more than two requests")
    cls = (seg_counts(token_req, R) >= LONG_REQUEST).to(torch.int8)
    for cfg, which in ((long, 1), (short, 0)):
        index_scores_stream[(triton.cdiv(T, cfg.bt), triton.cdiv(C, cfg.span))](
            qi, w, ikey, out, positions, token_req, seq_slots, cls,
            T, C, ratio, weight_scale, cfg.span, qi.stride(0), qi.stride(1), w.stride(0),
            ikey.stride(0), ikey.stride(1), out.stride(0),
            HI=hi, DI=di, BT=cfg.bt, BC=cfg.bc, PREC=prec, KEYS_M=cfg.keys_m,
            STAGES=cfg.stages, CLS=which, num_warps=cfg.warps, num_stages=cfg.stages)


def _launch_tile(qi, w, ikey, out, positions, token_req, seq_slots, ratio, weight_scale, prec,
                 token_tile) -> None:
    """index_scores_fwd over segment_tiles' token tiles x BLOCK_C entries."""
    import triton

    from megagraph.kernels.common.capturable import segment_tiles

    from megagraph.kernels.indexer.triton_jit import index_scores_fwd

    T, hi, di = qi.shape
    C, R = ikey.shape[1], seq_slots.shape[0]
    bt = token_tile or min(MAX_TOKEN_TILE, 1 << (max(1, T // max(1, R)).bit_length() - 1))
    tiles = segment_tiles(token_req, R, bt)
    index_scores_fwd[(tiles.count, triton.cdiv(C, BLOCK_C))](
        qi, w, ikey, out, positions, tiles.items.contiguous(), tiles.item_valid.to(torch.int8),
        seq_slots[tiles.seg].contiguous(),
        C, ratio, weight_scale, qi.stride(0), qi.stride(1), w.stride(0),
        ikey.stride(0), ikey.stride(1), out.stride(0),
        HI=hi, DI=di, BT=bt, BC=BLOCK_C, PREC=prec, num_warps=8, num_stages=2)


index_scores.capturable = True

__all__ = ["index_scores", "supports", "stream_configs", "StreamConfig", "PRECISION", "VARIANT"]
