"""CSA2 sparse attention with sink on the GPU (Triton): `sparse_attn` and the fused
`sparse_attn_q` (attention -> inverse RoPE -> head merge -> FP8 quantization in one epilogue).

Same calling convention and semantics as kernels/reference (and kernels/capturable), no host
synchronization, static output shapes: every call is CUDA-graph capturable. Inputs the kernels do
not cover (feature dims that are not a power of two, mixed key dtypes, CPU tensors outside the
Triton interpreter) go to the capturable kernels.

Design (kernels/attention/triton_jit.py has the key list): one program per (token, block of
BLOCK_H heads, split). MQA: the BLOCK_H query heads share every key row, so a key tile
[BLOCK_N, D] feeds one [BLOCK_H, D] x [D, BLOCK_N] score product and one [BLOCK_H, BLOCK_N] x
[BLOCK_N, D] value product (K = V); online softmax in the log2 domain with fp32 accumulators.
Few tokens (decode) split the key list over NS programs (flash-decoding) and a second kernel merges
the partial (acc, max, sum); many tokens (prefill) run NS = 1 with the epilogue in the same kernel.
Epilogue: o = acc / (sum + exp(sink - max)), rows without a key -> 0; for sparse_attn_q the
conjugate RoPE at the token's position on the last rope_dim channels, then per block of
128 (fp8_1x128) or 32 (mxfp8) channels scale = 2^ceil(log2(max(amax, 1e-4) / 448)),
q = rne_e4m3(clamp(o / scale, +-448)).

Numerics vs the reference (fp32 math on the bf16 inputs): scores and values use bf16 tensor-core
products with fp32 accumulation; the softmax weights are rounded to bf16 before the value product
(2^-9 relative per weight), so outputs differ from the reference by ~1e-3 relative (bound used in
the tests: 1e-2 of the row norm). The epilogue rounds where the unfused graph rounds (the attention
output and the de-rotated output to q's dtype, then the quantizer), so the FP8 codes differ from the
reference's only where that ~1e-3 difference moves a bf16 value across an E4M3 rounding midpoint
(one E4M3 step, 2^-3 relative, for a few % of the elements; a block's scale can differ by 2x where
its amax sits at a power of two). fp32 inputs use exact fp32 products ("ieee").
Top-k rows are sorted here (torch.sort, SORT_TOPK) so that duplicate indices, which the reference
counts once, are adjacent; topk_select's rows are already unique.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megagraph.kernels.attention.config import AttentionConfig
from megagraph.kernels.common.triton import INTERPRET, available, on_device as _on_device
from megagraph.kernels.common.triton import sm_count

ACT_BLOCKS = {"mxfp8": 32, "fp8_1x128": 128}
SORT_TOPK = True  # sort top-k rows first (exact duplicate handling for unsorted rows)


@dataclass(frozen=True)
class AttnLaunch:
    """One launch shape: heads per program, keys per tile, warps, pipeline stages, splits (0 =
    auto: enough programs for two waves of the GPU, at most AttentionConfig.max_splits), pipe
    (the top-k loop without its skip of empty tiles, so it is software-pipelined:
    triton_jit.sparse_attn_fwd's PIPE). The sm_90 build of the default 16 x 32 x 8 warps is the
    one that does not spill (tests/kernels/attention/test_triton_attention_sm90.py); the faster
    shapes of AttentionConfig spill a little and win anyway."""

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    splits: int = 0
    pipe: bool = False


def pick_launch(T: int, cfg: AttentionConfig | None = None) -> AttnLaunch:
    """The launch shape cfg.choose gives a step of T tokens."""
    cfg = cfg or AttentionConfig()
    stage = cfg.choose({"tokens": T})["attention"]
    if stage == "prefill":
        return AttnLaunch(*cfg.prefill, splits=1, pipe=cfg.prefill_pipe)
    return AttnLaunch(*(cfg.wide if stage == "wide" else cfg.decode), splits=cfg.decode_splits)


_FREQS: dict = {}


def rope_freqs(dev: torch.device, **rope) -> Tensor:
    """The capturable rope's frequencies on `dev` (the same fp32 ops), cached outside CUDA-graph
    capture."""
    from megagraph.kernels.dense.capturable import rope_frequencies

    key = (dev, tuple(sorted(rope.items())))
    f = _FREQS.get(key)
    if f is None:
        f = rope_frequencies(dev, **rope)
        capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            _FREQS[key] = f
    return f


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supports(q: Tensor, kv: Tensor, ring: Tensor, ckv: Tensor | None) -> bool:
    """Whether the Triton kernel takes these inputs (else the capturable kernel runs)."""
    if not available() or not _on_device(q):
        return False
    dts = {q.dtype, kv.dtype, ring.dtype} | ({ckv.dtype} if ckv is not None else set())
    return (len(dts) == 1 and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and _pow2(q.shape[-1]))


def _splits(launch: AttnLaunch, programs: int, tiles: int, dev, max_splits: int) -> int:
    if launch.splits:
        return launch.splits
    want = -(-2 * sm_count(dev) // max(1, programs))
    return max(1, min(max_splits, want, max(1, tiles // 2)))


def launch(q: Tensor, kv: Tensor, ring: Tensor, ckv: Tensor | None, topk: Tensor | None,
           sink: Tensor, positions: Tensor, token_req: Tensor, seq_slots: Tensor,
           seq_cached: Tensor, *, window: int, scale: float, ratio: int, attend_all: bool,
           quant: tuple[str, dict] | None, kernel_config: AttentionConfig | None = None,
           launch_shape: AttnLaunch | None = None, out: tuple[Tensor, ...] | None = None):
    """Run the kernels. quant None: returns o [T, H, D] (q.dtype, not de-rotated); quant =
    (act_fmt, rope attrs): returns (o_q fp8 [T, H*D], scales [T, H*D/block]; e8m0 scales are
    written as their bytes). kernel_config: the family's choices (None: the defaults);
    launch_shape: one launch shape instead of the one kernel_config picks (the probes' sweeps);
    `out`: preallocated outputs of those shapes (tests poison them)."""
    import triton

    from megagraph.kernels.attention.triton_jit import sparse_attn_combine, sparse_attn_fwd

    if not _TL_DTYPES:
        _TL_DTYPES.update(_tl_dtypes())

    T, H, D = q.shape
    W = ring.shape[1]
    if W != window:
        raise ValueError(f"ring has {W} rows, window is {window}")
    dev = q.device
    has_comp = ckv is not None and (topk is not None or attend_all)
    if has_comp and ratio <= 0:
        raise ValueError("compressed keys need ratio >= 1")
    all_comp = has_comp and topk is None
    if quant is None:
        o = torch.empty(T, H, D, dtype=q.dtype, device=dev)
        os_ = o
        mode, qb, e8, rope = 0, 16, False, {}
    else:
        act_fmt, rope = quant
        qb = ACT_BLOCKS[act_fmt]
        if D % qb:
            raise ValueError(f"head dim {D} is not a multiple of the {act_fmt} block {qb}")
        e8 = act_fmt == "mxfp8"
        mode = 1
        o = torch.empty(T, H * D, dtype=torch.float8_e4m3fn, device=dev)
        os_ = torch.empty(T, H * D // qb, dtype=torch.uint8 if e8 else torch.float32, device=dev)
    if out is not None:
        o, os_ = (out[0], out[0]) if quant is None else (out[0], out[1].view(os_.dtype))
    if T == 0:
        return o if quant is None else _scales(o, os_, e8)

    kc = kernel_config or AttentionConfig()
    cfg = launch_shape or pick_launch(T, kc)
    bh = max(16, min(cfg.block_h, triton.next_power_of_2(H)))
    nhb = triton.cdiv(H, bh)
    bn = cfg.block_n
    nt_step = triton.cdiv(min(W, T), bn)
    K = topk.shape[1] if (has_comp and topk is not None) else 0
    tiles = triton.cdiv(W, bn) + nt_step + (triton.cdiv(K, bn) if K else 8)
    ns = _splits(cfg, T * nhb, tiles, dev, kc.max_splits)

    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv.contiguous()
    ring = ring if ring.stride(-1) == 1 else ring.contiguous()
    if has_comp:
        ckv = ckv if ckv.stride(-1) == 1 else ckv.contiguous()
        if topk is not None:
            topk = (topk.sort(dim=-1).values if SORT_TOPK else topk).contiguous()
    ckv_t = ckv if has_comp else ring
    topk_t = topk if (has_comp and topk is not None) else positions
    rope_dim = rope.get("rope_dim", 0) if mode == 1 else 0
    freqs = rope_freqs(dev, **rope) if rope_dim else sink
    sinkf = sink.float().contiguous()
    if ns > 1:
        po = torch.empty(T, ns, H, D, dtype=torch.float32, device=dev)
        pml = torch.empty(T, ns, H, 2, dtype=torch.float32, device=dev)
    else:
        po = pml = sinkf
    C = ckv.shape[1] if has_comp else 0
    sparse_attn_fwd[(T, nhb, ns)](
        q, kv, ring, ckv_t, topk_t, sinkf, positions, token_req, seq_slots, seq_cached, freqs,
        o, os_, po, pml,
        T, H, C, max(ratio, 1), float(scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), kv.stride(0), ring.stride(0), ring.stride(1),
        ckv_t.stride(0), ckv_t.stride(1), topk_t.stride(0),
        W=W, D=D, K=K, NT_STEP=nt_step, BLOCK_H=bh, BLOCK_N=bn, NS=ns,
        HAS_COMP=has_comp, ALL_COMP=all_comp, MODE=mode, ROPE_DIM=rope_dim, QBLOCK=qb, E8M0=e8,
        MANUAL_FP8=INTERPRET, DOT_F32=q.dtype == torch.float32 or INTERPRET, PIPE=cfg.pipe,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if ns > 1:
        sparse_attn_combine[(T, triton.cdiv(H, kc.combine_heads))](
            po, pml, positions, sinkf, freqs, o, os_, H,
            D=D, BLOCK_H=kc.combine_heads, NS=ns, MODE=mode, ROPE_DIM=rope_dim, QBLOCK=qb, E8M0=e8,
            MANUAL_FP8=INTERPRET, OUT_DT=_TL_DTYPES[q.dtype], num_warps=4)
    return o if quant is None else _scales(o, os_, e8)


_TL_DTYPES: dict = {}


def _tl_dtypes() -> dict:
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _scales(o: Tensor, os_: Tensor, e8: bool) -> tuple[Tensor, Tensor]:
    return o, (os_.view(torch.float8_e8m0fnu) if e8 else os_)


def sparse_attn(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached, *,
                window, scale, ratio=0, attend_all_compressed=False,
                kernel_config: AttentionConfig | None = None):
    """kernels.attention.reference.sparse_attn on the GPU."""
    if not supports(q, kv, ring, ckv):
        from megagraph.kernels.attention.capturable import sparse_attn as fallback

        return fallback(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached,
                        window=window, scale=scale, ratio=ratio,
                        attend_all_compressed=attend_all_compressed)
    return launch(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached,
                  window=window, scale=scale, ratio=ratio, attend_all=bool(attend_all_compressed),
                  quant=None, kernel_config=kernel_config)


def sparse_attn_q(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached, *,
                  window, scale, ratio, attend_all_compressed, rope_dim, theta, yarn_factor,
                  yarn_original, yarn_beta_fast, yarn_beta_slow, act_fmt,
                  kernel_config: AttentionConfig | None = None):
    """kernels.fused.reference.sparse_attn_q on the GPU: one attention kernel whose epilogue
    de-rotates, merges heads and quantizes (plus a merge kernel when the key list is split)."""
    rope = dict(rope_dim=rope_dim, theta=theta, yarn_factor=yarn_factor,
                yarn_original=yarn_original, yarn_beta_fast=yarn_beta_fast,
                yarn_beta_slow=yarn_beta_slow)
    if not supports(q, kv, ring, ckv) or q.shape[-1] % ACT_BLOCKS[act_fmt] or rope_dim % 2 \
            or rope_dim > q.shape[-1]:
        from megagraph.kernels.fused.capturable import sparse_attn_q as fallback

        return fallback(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached,
                        window=window, scale=scale, ratio=ratio,
                        attend_all_compressed=attend_all_compressed, act_fmt=act_fmt, **rope)
    return launch(q, kv, ring, ckv, topk, sink, positions, token_req, seq_slots, seq_cached,
                  window=window, scale=scale, ratio=ratio, attend_all=bool(attend_all_compressed),
                  quant=(act_fmt, rope), kernel_config=kernel_config)


sparse_attn.capturable = True
sparse_attn_q.capturable = True

__all__ = ["sparse_attn", "sparse_attn_q", "launch", "AttnLaunch", "pick_launch", "supports"]
