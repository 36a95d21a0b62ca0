"""Mega-mHC in Triton: the FFN site's mHC front half (mixer projection with RMS statistics,
Sinkhorn, collapse, RMSNorm, activation quantization) writing x, x_q, x_scale straight into the
buffers mega_moe reads; same calling convention and semantics as
kernels.fused.reference.mega_mhc, sync-free and CUDA-graph capturable.

Launches (plan() picks the tiles, MhcConfig.choose the path; docs/kernels/mhc.md has the H200
numbers):
  T <= fused_tokens (64, decode): one launch, mhc_jit.mhc_fused;
  larger T: mhc_proj + mhc_reduce (split K) + mhc_finish, 2-3 launches.
MhcConfig.fused = auto (as above) | always | never; both paths give the same bits at every T
(they share plan() and the code). On the H200: 64 tokens 45.8 us (61.7 unfused), 8192 tokens
327 us.

Projection: [BM, n*d] x [n*d, 24] per token block on tensor cores plus the sum of squares:
blocks of 8 tokens under the 16-row mma.sync tile at decode sizes, 16 tokens up to
split_tokens, 64-row wgmma tiles above (the weight read and split into bf16 hi / lo once per 64
tokens: the 8192-token projection 504 -> ~140 us). The n*d reduction is split over `split`
programs per block (~2-2.5 programs per SM) that each write their partial products to their own
[T, 32] slab; the slabs are summed in the fixed order s = 0..split-1, so every run gives the
same bits (adding them atomically would make decode logits differ from run to run).
  fused: each split program writes its slab, then takes a ticket from its block's arrival
    counter (one atomic add, acq_rel, gpu scope); the program holding the last ticket sums the
    slabs in split order (whichever program that is: the same bits), puts the counter back to
    0, and runs the finish for the block. Unsplit, each program runs projection then finish.
  unfused: mhc_proj, mhc_reduce (split only), mhc_finish (one program per FBM tokens).
  Why not one launch at prefill sizes: it builds (no spills) and gives the same bits, but its
  finish runs on the last arriver of each 64-token block, 128 programs at 8192 tokens, 4 steps
  of 16 tokens each, where mhc_finish has 512 programs: 524 vs 327 us; 16-token blocks (512
  finishers) make the projection 3.6x slower (mma.sync m16, the weight re-read and re-split per
  16 tokens).
Finish (per token): the coefficients (2 x 4 sigmoids, 4 x 4 softmax, 20 column and 19 row
normalizations in registers), then two passes over d: the collapse (x = rdt(w0 h0 + w1 h1 +
...), streams added in order, each element in its own thread, pipelined) with per-thread sums
of squares, then the norm and the quantizer (per 128 columns, f32 power-of-two scales; per 32
with e8m0 scales for mxfp8; nq blocks a step). Both paths run the same code
(mhc_jit.finish_rows) on the same [FBM, ...] tiles, so they give the same bits.

Arrival counters (fused split path): COUNTER_SLOTS int32 per device, allocated zeroed by the
first call on that device outside CUDA-graph capture (during a capture with none allocated yet,
the call takes the unfused path: no allocation or memset is captured) and never freed. They are
zero between launches because the last arriver of each block resets that block's counter after
all `split` tickets of the block were taken (0 -> split -> 0 within one launch; only that
block's programs touch it), so the next launch or graph replay starts clean without a memset.
Launches on a device must be stream-ordered: two mega_mhc in flight at once on two streams of
one device would share counters. A launch that does not finish (a device fault: the CUDA
context is then unusable anyway) can leave a counter at c != 0; every later launch on that
device would then let a program finish its block before all slabs are written, and leave the
counter at c again: reset_counters() zeroes them (stream-ordered).

Numerics: the projection multiplies bf16 streams with the fp32 weight split into bf16 hi + lo
(products exact, weight error ~2^-17), so m differs from the fp32 reference by summation order
only (~1e-6 relative), in an order fixed for a given T and GPU (plan(): tile, split). The
coefficients then match to ~1e-6; x to bf16 rounding (an element may round the other way where
the fp32 values straddle a bf16 tie), x_q to one E4M3 step where x differs, x_scale exactly
except where a block's amax sits on a power of two. fp32 streams use "ieee" fp32 products.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megagraph.kernels.common.triton import INTERPRET, RDT, available
from megagraph.kernels.common.triton import on_fp8_device as on_device

from megagraph.kernels.mhc.config import MhcConfig

ACT_BLOCKS = {"mxfp8": 32, "fp8_1x128": 128}
COUNTER_SLOTS = 1024  # arrival counters per device (one per token block of a split launch)
_COUNTERS: dict = {}
NPAD = 32


@dataclass(frozen=True)
class Plan:
    """Launch shape: bm rows per projection MMA tile, of which bt tokens (a token block: bt <= bm,
    the rest masked), bk columns per K step, split programs per token block (k_per columns
    each), fbm tokens per finish step (bt % fbm == 0), num_warps, num_stages of the projection,
    fstages of the finish's collapse loop, nq quantization blocks per norm / quantize step."""
    bm: int
    bk: int
    split: int
    k_per: int
    fbm: int
    warps: int = 4
    stages: int = 3
    bt: int = 0  # 0: bm
    fstages: int = 1
    nq: int = 1

    @property
    def block(self) -> int:
        return self.bt or self.bm


def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def plan(T: int, kd: int, dev: torch.device, sms: int | None = None,
         cfg: MhcConfig | None = None) -> Plan:
    """The launch shape at T tokens and n*d = kd on `dev` (sms: its multiprocessor count, for
    ahead-of-time builds). Picked from the H200 sweeps in docs/kernels/mhc.md:
      T <= fused_tokens: one launch (MhcConfig auto): blocks of 8 tokens under the 16-row mma.sync
        tile, split so that there are ~2 programs per SM, 8 warps (the last arriver's finish is
        latency-bound: more warps, a pipelined collapse, 4 quantization blocks a step);
      T < split_tokens: the unfused launches with 16-token blocks split over K and a finish
        program per token (more finishing programs than the fused kernel's one per block);
      else: the unfused launches with 64-row wgmma tiles (the 2 MB weight read and split into
        bf16 hi / lo once per 64 tokens, not 16), split to ~2.5 programs per SM, the finish on
        16-token programs (4x the programs the fused kernel leaves for it: 64-token blocks)."""
    cfg = cfg or MhcConfig()
    sms = sms or _sms(dev)
    bk = 128 if INTERPRET else 64
    cap = max(1, kd // (bk * 4))
    if T <= cfg.fused_tokens:
        bm, bt, fbm, warps, nq = 16, 8, 8, 8, 4
        split = -(-2 * sms // -(-T // bt))
    elif T < cfg.split_tokens:
        bm, bt, fbm, warps, nq = 16, 0, 1, 4, 1
        split = -(-2 * sms // -(-T // bm))
    else:
        bm, bt, fbm, warps, nq = 64, 0, 16, 4, 1
        split = -(-5 * sms // (2 * -(-T // bm)))
    k_per = -(-kd // (max(1, min(split, cap)) * bk)) * bk
    return Plan(bm=bm, bk=bk, split=-(-kd // k_per), k_per=k_per, fbm=fbm, warps=warps,
                stages=3, bt=bt, fstages=3, nq=nq)


def counters(dev: torch.device) -> Tensor | None:
    """The device's arrival counters (int32 [COUNTER_SLOTS], zero between launches: module
    docstring); None during a CUDA-graph capture before the first call outside one."""
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    c = _COUNTERS.get(dev)
    if c is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        c = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=dev)
        _COUNTERS[dev] = c
    return c


def reset_counters(dev: torch.device | None = None) -> None:
    """Zero the arrival counters (of `dev`, or every device): only needed after a launch that did
    not finish."""
    for k, c in _COUNTERS.items():
        if dev is None or k == dev:
            c.zero_()


def supports(streams: Tensor, fn: Tensor, act_fmt: str) -> bool:
    if not (available() and on_device(streams)) or act_fmt not in ACT_BLOCKS:
        return False
    if streams.dim() != 3 or streams.dtype not in RDT or fn.dim() != 2:
        return False
    _, n, d = streams.shape
    return (n & (n - 1) == 0 and fn.shape == ((2 + n) * n, n * d)
            and d % ACT_BLOCKS[act_fmt] == 0 and (2 + n) * n <= NPAD)


def mega_mhc(streams, fn, base, scale, mix=None, norm_weight=None, *, eps, hc_eps,
             sinkhorn_iters, norm_eps, act_fmt, kernel_config: MhcConfig | None = None,
             tiles: Plan | None = None):
    """kernels.fused.reference.mega_mhc -> (x, x_q, x_scale, pre, post, comb). kernel_config:
    one launch or the unfused 2-3 (MhcConfig.choose; the same bits either way); tiles: a launch
    shape instead of plan()'s (the tests' forced splits and tiles)."""
    if not supports(streams, fn, act_fmt):
        from megagraph.kernels.fused.capturable import mega_mhc as fallback

        return fallback(streams, fn, base, scale, mix, norm_weight, eps=eps, hc_eps=hc_eps,
                        sinkhorn_iters=sinkhorn_iters, norm_eps=norm_eps, act_fmt=act_fmt)
    from megagraph.kernels.mhc import triton_jit as mhc_jit

    T, n, d = streams.shape
    dev = streams.device
    qb = ACT_BLOCKS[act_fmt]
    e8 = act_fmt == "mxfp8"
    x = torch.empty(T, d, dtype=streams.dtype, device=dev)
    xq = torch.empty(T, d, dtype=torch.float8_e4m3fn, device=dev)
    xs = torch.empty(T, d // qb, dtype=torch.uint8 if e8 else torch.float32, device=dev)
    pre = torch.empty(T, n, dtype=torch.float32, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T == 0:
        return x, xq, (xs.view(torch.float8_e8m0fnu) if e8 else xs), pre, post, comb
    h = streams if streams.is_contiguous() else streams.contiguous()
    fnc = fn if fn.stride(-1) == 1 else fn.contiguous()
    kd = n * d
    cfg = kernel_config or MhcConfig()
    p = tiles or plan(T, kd, dev, cfg=cfg)
    mt = -(-T // p.block)
    split = p.split
    fused = cfg.choose({"tokens": T})["mega_mhc"] == "fused"
    cnt = counters(dev) if (fused and split > 1 and mt <= COUNTER_SLOTS) else None
    fused = fused and (split == 1 or cnt is not None)
    m = torch.empty(T, NPAD, dtype=torch.float32, device=dev)
    sq = torch.empty(T, dtype=torch.float32, device=dev)
    part = torch.empty(split, T, NPAD, dtype=torch.float32, device=dev) if split > 1 else m
    sqp = torch.empty(split, T, dtype=torch.float32, device=dev) if split > 1 else sq
    mixc = mix.float().contiguous() if mix is not None else pre
    nw = norm_weight.contiguous() if norm_weight is not None else pre
    basec, scalec = base.float().contiguous(), scale.float().contiguous()
    split_bf16 = h.dtype == torch.bfloat16 and not INTERPRET
    fin = dict(HC=n, NPAD=NPAD, ITERS=int(sinkhorn_iters), HAS_MIX=mix is not None,
               HAS_NW=norm_weight is not None, E8M0=e8, QB=qb, RDT=RDT[streams.dtype],
               MANUAL=INTERPRET, FSTAGES=p.fstages, NQ=p.nq)
    if fused:
        mhc_jit.mhc_fused[(mt, split)](
            h, fnc, part, sqp, m, sq, cnt if cnt is not None else sq, basec, scalec, mixc, nw,
            x, xq, xs, pre, post, comb, T, d, kd, p.k_per, split, float(eps), float(hc_eps),
            float(norm_eps), kd, fnc.stride(0), x.stride(0), xq.stride(0), xs.stride(0),
            NM=(2 + n) * n, SPLIT_BF16=split_bf16, SPLIT=split > 1, BM=p.bm, BK=p.bk, BT=p.block,
            FBM=p.fbm, num_warps=p.warps, num_stages=p.stages, **fin)
    else:
        mhc_jit.mhc_proj[(mt, split)](
            h, fnc, part, sqp, T, kd, p.k_per, kd, fnc.stride(0), NM=(2 + n) * n, NPAD=NPAD,
            SPLIT_BF16=split_bf16, BM=p.bm, BK=p.bk, BT=p.block, num_warps=p.warps,
            num_stages=p.stages)
        if split > 1:
            mhc_jit.mhc_reduce[(-(-T // 16),)](part, sqp, m, sq, T, split, NPAD=NPAD, BM=16,
                                              num_warps=4)
        mhc_jit.mhc_finish[(-(-T // p.fbm),)](
            m, sq, basec, scalec, h, mixc, nw, x, xq, xs, pre, post, comb, T, d, float(eps),
            float(hc_eps), float(norm_eps), kd, x.stride(0), xq.stride(0), xs.stride(0),
            BM=p.fbm, num_warps=p.warps, **fin)
    return x, xq, (xs.view(torch.float8_e8m0fnu) if e8 else xs), pre, post, comb


mega_mhc.capturable = True


def reduce_partials(part: Tensor, sqp: Tensor) -> tuple[Tensor, Tensor]:
    """([S, T, NPAD], [S, T]) f32 partial sums -> their sums over S, added in the order s = 0..S-1
    (mhc_jit.mhc_reduce; fixed, unlike the atomic adds it replaced)."""
    from megagraph.kernels.mhc import triton_jit as mhc_jit

    S, T, npad = part.shape
    m = torch.empty(T, npad, dtype=torch.float32, device=part.device)
    sq = torch.empty(T, dtype=torch.float32, device=part.device)
    bm = 16
    mhc_jit.mhc_reduce[(-(-T // bm),)](part, sqp, m, sq, T, S, NPAD=npad, BM=bm, num_warps=4)
    return m, sq


__all__ = ["mega_mhc", "supports", "plan", "counters", "reset_counters"]


def hc_expand(H: Tensor, y: Tensor, post: Tensor, comb: Tensor, *,
              kernel_config: MhcConfig | None = None) -> Tensor:
    """kernels.mhc.reference.hc_expand at the attention sites (the FFN sites' expand runs inside
    mega_moe's combine): H'[t, j] = post[t, j] y[t] + sum_i comb[t, i, j] H[t, i], fp32 math, one
    launch of mega_moe's combine kernel with one slot (moe.combine: K = 1, no shared slot, so y
    passes through unrounded). The capturable version is a broadcast product, an einsum and a
    cast (3-4 kernels, and its einsum over bf16 streams upcasts all of H first). The sum over i
    runs in the kernel's order: an output element can differ from the reference by one rounding
    of the output dtype (bf16: 2^-8 relative) where the fp32 values straddle a tie.
    kernel_config: the family's (hc_expand has a single path; it takes it like every fast
    kernel of the family)."""
    T, n, d = H.shape
    if not (available() and on_device(H)) or H.dtype not in RDT or y.dtype not in RDT \
            or n & (n - 1) or y.shape != (T, d) or y.stride(-1) != 1:
        from megagraph.kernels.dense.capturable import hc_expand as fallback

        return fallback(H, y, post, comb)
    from megagraph.kernels.moe.triton import combine

    out = torch.empty(T, n, d, dtype=H.dtype, device=H.device)
    h = H if H.stride(-1) == 1 else H.contiguous()
    return combine(y.unsqueeze(1), out, topk=1, shared=False, rdt=y.dtype, streams=h,
                   post=post.float().contiguous(), comb=comb.float().contiguous())


hc_expand.capturable = True  # one launch, no host sync (runtime.kernels reads this)
