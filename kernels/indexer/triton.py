"""Lightning indexer scores on the GPU (Triton), same semantics as
kernels.indexer.reference.index_scores; candidate blocks and top-k are in triton_topk.py.

Two kernels (kernels/indexer/triton_jit.py):
- index_scores_stream (the default with bf16 products, V4.1's): queries stationary. A program
  holds BT tokens' [BT*HI, DI] queries (one request's) and walks a span of its slot's entries,
  BC at a time, keys on the MMA's M side: [BC, BT*HI] products, ReLU, head weights and the sum
  over heads inside a thread and its quad. Requests with >= 8 tokens (index_long_request) go 8 to a
  tile (keys read once per 8 tokens), the others 1 (decode); the class is decided on the device,
  because a captured prefill bucket has as many request rows as tokens, like a decode bucket.
  Spans of index_span_keys entries, token tiles the grid's fast axis: the programs resident together
  share a span's keys in L2. On the H200 (benchmarks/results/index-probe-11-h200.md), 8192 new
  tokens after a 128K context at ratio 1: 153.5 ms -> 25.7 ms (348 TFLOP/s); decode, 64
  requests at 128K: 1.31 -> 1.07 ms (84% of HBM bandwidth on the keys).
- index_scores_fwd (the tile kernel; fp32 products, or index_kernel "tile"): a program per
  BT tokens x index_block_c entries, the queries reloaded for every 64 entries (64 KB per program
  at BT 4: about 5x the bytes of the keys it multiplies, which is what bounded it). Decode steps
  get BT = 1, longer requests BT = 4.

Precision: the reference multiplies in fp32. index_precision "tf32x3" (default) splits the fp32
operands into tf32 pairs on the tensor cores (relative error ~1e-6 of sum |w·relu(q·k)|, below
fp32 summation-order noise at these lengths); "ieee" is exact fp32 FMA (slower); "bf16" rounds
both operands to bf16, exact only for inputs representable in bf16 — which MXFP4 fake-quantized
index queries and keys (V4.1's quantize_kv) are: the indexer-products pass marks such nodes
`products="bf16"` and the kernels then multiply in bf16 (exactness:
tests/kernels/indexer/test_triton_indexer.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device
from megagraph.kernels.common.triton import sm_count
from megagraph.kernels.indexer.config import IndexerConfig


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


def _spans(C: int, bc: int, tiles: int, sms: int, span_keys: int | None,
           per_sm: int) -> int:
    """Entries per program: at most span_keys (L2 locality), fewer until the grid has per_sm
    programs per SM."""
    nblk = -(-C // bc)
    spans = min(nblk, max(-(-C // span_keys) if span_keys else 1,
                          -(-per_sm * sms // max(1, tiles))))
    return -(-nblk // max(1, spans)) * bc


def stream_configs(T: int, R: int, C: int, prec: str, sms: int,
                   cfg: IndexerConfig | None = None) -> tuple[StreamConfig, StreamConfig]:
    """The two launches of a step of T tokens in R requests against C entries: (long, short).

    The token tile cannot follow the step's shape: a captured prefill bucket of B tokens has B
    request rows (the real requests and padding), exactly like a decode bucket, so T / R says
    nothing. Each request's tokens therefore go to one of two classes on the device: requests with
    at least index_long_request tokens to tiles of 8 (keys read once per 8 tokens: the prefill
    products are bound by the keys' L2 bytes at 4), the others to tiles of 1 (decode: memory-bound, no
    padded rows in the products). Each launch's programs of the other class exit at once; no
    tile list is built (a tile = BT consecutive tokens of the step: the decode step pays three
    small torch kernels for the classes, not segment_tiles' thirty). Long spans stay short for L2
    locality; the short class's span is as long as the grid allows (its requests share no keys).
    Shapes: the sm_90 builds without spills (test_triton_attention_sm90.py)."""
    cfg = cfg or IndexerConfig()
    if prec == "bf16":  # the fastest of benchmarks/results/index-probe-11-h200.md's launches
        long_bt, long_keys_m, long_stages, short_warps, short_stages = 8, True, 3, 4, 4
    else:  # fp32 queries in registers: 4 tokens with the queries on M, 8 warps for one token
        long_bt, long_keys_m, long_stages, short_warps, short_stages = 4, False, 2, 8, 2
    nt_long = -(-T // long_bt)
    long = StreamConfig(long_bt, 64, long_keys_m, 8, long_stages,
                        _spans(C, 64, nt_long, sms, cfg.index_span_keys,
                               cfg.index_programs_per_sm))
    short = StreamConfig(1, 64, True, short_warps, short_stages,
                         _spans(C, 64, T, sms, None, cfg.index_programs_per_sm))
    return long, short


def supports(qi: Tensor, ikey: Tensor) -> bool:
    _, hi, di = qi.shape
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return (available() and _on_device(qi) and pow2(hi) and pow2(di) and hi >= 16 and di >= 16
            and ikey.dtype in (torch.float32, torch.bfloat16, torch.float16))


def index_scores(qi: Tensor, w: Tensor, ikey: Tensor, positions: Tensor, token_req: Tensor,
                 seq_slots: Tensor, *, ratio: int, weight_scale: float, products: str = "fp32",
                 kernel_config: IndexerConfig | None = None, token_tile: int | None = None,
                 config: StreamConfig | None = None, short_config: StreamConfig | None = None,
                 out: Tensor | None = None) -> Tensor:
    """kernels.indexer.reference.index_scores; `products="bf16"` (the node's attr: operands exact
    in bf16) multiplies in bf16, else in kernel_config.index_precision; kernel_config picks the
    kernel (IndexerConfig.choose); `token_tile` / `config` / `short_config` (the stream kernel's
    long / short class launches) replace the launch shapes it gives (the probe's sweeps), `out`
    is a preallocated f32[T, C] result (tests poison it)."""
    if not supports(qi, ikey):
        from megagraph.kernels.indexer.capturable import index_scores as fallback

        return fallback(qi, w, ikey, positions, token_req, seq_slots, ratio=ratio,
                        weight_scale=weight_scale)
    T, C = qi.shape[0], ikey.shape[1]
    out = torch.empty(T, C, dtype=torch.float32, device=qi.device) if out is None else out
    if T == 0 or C == 0:
        return out.fill_(float("-inf"))
    cfg = kernel_config or IndexerConfig()
    bf16 = products == "bf16" or cfg.index_precision == "bf16"
    prec = "ieee" if INTERPRET else ("bf16" if bf16 else cfg.index_precision)
    args = (qi if qi.stride(-1) == 1 else qi.contiguous(), w.contiguous(),
            ikey if ikey.stride(-1) == 1 else ikey.contiguous(), out, positions, token_req,
            seq_slots, ratio, float(weight_scale), prec, cfg)
    # the stream kernel is measured with bf16 products (V4.1's, benchmarks/probes/index_probe.py); the
    # fp32-product modes keep the tile kernel (IndexerConfig.choose)
    if cfg.choose({"bf16_products": int(prec == "bf16")})["index_scores"] == "stream":
        _launch_stream(*args, config, short_config, token_tile)
    else:
        _launch_tile(*args, token_tile)
    return out


def _launch_stream(qi, w, ikey, out, positions, token_req, seq_slots, ratio, weight_scale, prec,
                   cfg, config, short_config, token_tile) -> None:
    """index_scores_stream's two launches (stream_configs: the long and the short class)."""
    import triton

    from megagraph.kernels.common.capturable import seg_counts

    from megagraph.kernels.indexer.triton_jit import index_scores_stream

    T, hi, di = qi.shape
    C, R = ikey.shape[1], seq_slots.shape[0]
    long, short = stream_configs(T, R, C, prec, sm_count(qi.device), cfg)
    short = short_config or short
    if short.bt != 1:
        raise ValueError(f"the short class takes 1-token tiles, not {short.bt}")
    if config is not None or token_tile:
        long = config or long
        long = StreamConfig(token_tile, long.bc, long.keys_m, long.warps, long.stages,
                            long.span) if token_tile else long
        if long.bt > cfg.index_long_request:
            raise ValueError(f"token tile {long.bt} > index_long_request "
                             f"{cfg.index_long_request}: a tile could meet more than two requests")
    cls = (seg_counts(token_req, R) >= cfg.index_long_request).to(torch.int8)
    for cfg, which in ((long, 1), (short, 0)):
        index_scores_stream[(triton.cdiv(T, cfg.bt), triton.cdiv(C, cfg.span))](
            qi, w, ikey, out, positions, token_req, seq_slots, cls,
            T, C, ratio, weight_scale, cfg.span, qi.stride(0), qi.stride(1), w.stride(0),
            ikey.stride(0), ikey.stride(1), out.stride(0),
            HI=hi, DI=di, BT=cfg.bt, BC=cfg.bc, PREC=prec, KEYS_M=cfg.keys_m,
            STAGES=cfg.stages, CLS=which, num_warps=cfg.warps, num_stages=cfg.stages)


def _launch_tile(qi, w, ikey, out, positions, token_req, seq_slots, ratio, weight_scale, prec,
                 cfg, token_tile) -> None:
    """index_scores_fwd over segment_tiles' token tiles x index_block_c entries (64: with 8 warps
    no register spills in the sm_90 build)."""
    import triton

    from megagraph.kernels.common.capturable import segment_tiles

    from megagraph.kernels.indexer.triton_jit import index_scores_fwd

    T, hi, di = qi.shape
    C, R = ikey.shape[1], seq_slots.shape[0]
    bt = token_tile or min(cfg.index_max_token_tile,
                           1 << (max(1, T // max(1, R)).bit_length() - 1))
    tiles = segment_tiles(token_req, R, bt)
    index_scores_fwd[(tiles.count, triton.cdiv(C, cfg.index_block_c))](
        qi, w, ikey, out, positions, tiles.items.contiguous(), tiles.item_valid.to(torch.int8),
        seq_slots[tiles.seg].contiguous(),
        C, ratio, weight_scale, qi.stride(0), qi.stride(1), w.stride(0),
        ikey.stride(0), ikey.stride(1), out.stride(0),
        HI=hi, DI=di, BT=bt, BC=cfg.index_block_c, PREC=prec, num_warps=8, num_stages=2)


index_scores.capturable = True

__all__ = ["index_scores", "supports", "stream_configs", "StreamConfig"]
