"""MegaMoE on Hopper in Triton and Gluon: router, expert permutation, grouped expert GEMMs on
MXFP4 weights with the SwiGLU clamp fused into the first GEMM and the combine weights into the
second, the shared expert through the FP8-block GEMM, and the combine + mHC residual expand; plus
the dense FP8-block GEMMs (`linear_q`, `grouped_linear_q`, `swiglu_mlp_q`).

Why one module holds both (and ~1300 lines): the shared expert is a dense FP8-block GEMM pair
inside mega_moe, and the Triton GEMM launcher (`gemm`, `pick_tile`, `Bank`) serves the routed and
the dense GEMMs alike. Every choice (which kernel each stage runs, tiles, rings, thresholds) comes from the
`kernel_config` the runtime binds: MoeConfig (kernels/moe/config.py) for mega_moe /
moe_experts_q, GemmConfig (kernels/gemm/config.py) for the dense GEMMs; None means the family's
defaults. Nothing here reads the process environment but Triton's interpreter switch.

Same calling convention and semantics as kernels/fused/reference.py (and kernels/capturable):
no host synchronization, static shapes (the workspaces are sized from the input shapes, i.e.
the plan's worst case), so every op here is CUDA-graph capturable. Inputs the kernels do not
cover (CPU tensors outside the Triton interpreter, act_fmt other than fp8_1x128, dense expert
weights, K not a multiple of 128, ...) run the capturable kernels instead.

mega_moe launches (T tokens, k = topk, E experts, P = T*k pairs):
  1 gate_scores   x @ gate_w^T in fp32 (bf16 tensor cores, exact products); few tokens:
                  split over K into slabs that route_topk adds in order       [S, T, E] f32
  2 route_topk    sqrtsoftplus / bias / top-k / renormalize / x route_scale, expert counts
                  by atomics (hash routing: experts from tid2eid[token_ids])   ids, w [T, k]
  3 moe_plan      exclusive scan of the counts -> per-expert cursors (1 program)
  4 moe_scatter   pair -> its expert-sorted row (atomic cursors)               sorted [P]
  5 L1            rows of one expert per tile, A = x_q rows gathered by token, W1 and W3 of
                  the tile's expert, SwiGLU-clamp epilogue                       H [P, F]
  6 L2            A = H rows, B = W2, epilogue: x routing weight, row scattered to its
                  (token, slot)                                                  Y [T, k+1, d]
  7,8 shared      the shared expert, dense (FP8-block weights): L1 (SwiGLU) -> Hs, L2 -> Y[:, k]
                  (cuBLAS where kernels/gemm/cublas_fp8 applies; both on cuBLAS FP8 with an
                  E4M3 H where the routed H is E4M3: shared_expert_fp8h, its own [T, d] output)
  9 moe_combine   y = sum of the k slots (+ shared), streams' = post*y + comb^T streams
(+ one memset of the counts). The kernels of 5 and 6 are MoeConfig.choose's per size (decode:
the Gluon decode kernels; prefill: the warp-specialized Gluon kernels; between: Triton's
moe_gemm); the Triton grouped GEMMs launch a static worst-case grid (min(P, P // BM + E) row
tiles x N tiles), each program finds its expert by a scan of the counts, and programs past the
last tile return at once.
FP8 H (MoeConfig.fp8_h at every size, fp8_h_prefill at prefill sizes by default): L1's
epilogue quantizes H per row and 128 columns to E4M3 with a power-of-two f32 scale (quantize_act
fp8_1x128's numerics, DeepSeek's activation quantization before w2); L2 runs the FP8 MMA on H's
scales, as L1 does on x's.

Numerics (vs the reference: fp32 math on dequantized operands):
* L1 (FP8 MMA): per 128-column chunk, the four E8M0 scales of a weight row are split into
  S = max - 6 (applied to the fp32 partial product with the activation's f32 scale) and
  rel = s - S folded exactly into the E4M3 weight values (E2M1 x 2^rel is exact in E4M3 for
  rel in [-5, 6]: every row whose scales within 128 columns span <= 11 binades; blocks further
  below are flushed to 0, an error below 2^-11 of the chunk's largest weight). Products are
  exact; Hopper's FP8 MMA accumulates each 128-chunk with ~2^-14 relative precision before the
  fp32 promotion. g, u, SwiGLU in fp32; H stored in fp16 (2^-11 relative).
* L2 (FP16 MMA): W2 dequantized the same way to E4M3 and upcast to fp16 (exact), H in fp16;
  fp32 accumulation and promotion per 128 columns.
* L2 with FP8 H: H rounded to E4M3 per 128 columns (at most 2^-4 relative per element): a few %
  relative (Frobenius) vs the fp32-H reference; vs the reference that quantizes H the same way
  (kernels.moe.reference.moe_experts(h_fmt="fp8_1x128")) only the accumulation order and the
  rare E4M3 rounding flip of an H element within that noise of a rounding boundary remain.
* Shared expert / dense FP8-block weights (32x32 or 128x128 blocks): fp16 MMA, the weight
  exponents within a 128-chunk folded in fp16 (exact for spreads <= 15 binades); FP8 MMA when
  one scale covers the chunk (128x128 blocks).
* Y (per-(token, slot) weighted expert outputs) in bf16 (fp32 for fp32 activations), summed in
  fp32 in slot order and rounded like the reference (routed -> act dtype, + shared -> act dtype,
  expand in fp32 -> streams dtype).
* Router: bf16 x bf16 products are exact in fp32 (an fp32 gate weight is split into bf16 hi +
  lo); only the summation order differs, so top-k picks equal the reference's except at ties
  within ~1e-6.
Result: bf16 outputs within ~3e-3 relative (Frobenius) of the reference; tests bound 1e-2.

The E2M1 -> E4M3 upcast has two implementations: PTX (prmt lookups on 4 packed bytes, ~2.5
integer ops per weight) and plain Triton integer arithmetic (~11 ops per weight; the only one the
interpreter runs). The PTX path is used where a one-time check on the device (asm_ok: both paths
on every byte value and exponent offset, bit for bit) passes; fp4_asm "on" / "off" forces it.
exact=True runs every GEMM on fully dequantized bf16 (fp32 in the interpreter) operands: slower,
bit-faithful products, for debugging.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from megagraph.kernels.common.triton import INTERPRET, RDT, available  # noqa: F401 (re-exported)
from megagraph.kernels.common.triton import on_fp8_device as on_device
from megagraph.kernels.gemm.config import GemmConfig, Tile
from megagraph.kernels.moe.config import MoeConfig

log = logging.getLogger(__name__)

MMA_FP8, MMA_FP16, MMA_BF16, MMA_F32 = 0, 1, 2, 3
WFMT = {"mxfp4": 0, "fp8_block": 1}
_MOE = MoeConfig()
_GEMM = GemmConfig()


def pick_tile(role: str, rows_per_group: float, kc: MoeConfig | GemmConfig | None = None,
              interpret: bool = INTERPRET) -> Tile:
    """Tile per role and expected rows per group (expert or dense M): kc.tiles' entry for the role
    where it pins one, else the tuned table below. The routed-expert tiles come from the H200
    sweep (benchmarks/probes/moe_tune.py -> benchmarks/results/moe-tune-h200.md: routed experts at 64
    tokens 3.91 -> 2.98 ms with 16-row L1 tiles; at 8192 tokens 18.6 -> 16.5 / 17.5 ms with a
    64-row, 4-warp L1 / L2 tile); the dense FP8-block tiles and the middle range (12 < rows <=
    48) are SASS-based picks (issue slots per KB of weights in the K loop, spills). interpret:
    the interpreter's small tiles (the process's mode; tests ask for the device's table)."""
    kc = kc or _MOE
    pinned = kc.tile_overrides()
    if role in pinned:
        return pinned[role]
    # FP8-H tiles: the L1 quantizes H per 128 columns in its epilogue, so a program owns 128
    # columns; one [64, 128] x 2 K loop needs 8 warps (1 program per SM: 21.7 ms on the H200
    # against 9.7 ms for the default L1) or spills at 4 warps. qsplit = 2 runs the 64 x 64 x
    # 4-warp loop twice per program instead. L2 on FP8 A: the H200 sweep's best 64 x 128 x 4
    # warps x 4 stages (~4.8 ms; 8 warps 9.8 ms). Decode on the static grid: the swapped MMA
    # where the H200 sweep timed it faster (moe_tune --swap, routed experts at 64 tokens,
    # benchmarks/results/moe-tune-swap-h200.md): L1 16 x 64 3.20 -> 2.74 ms, FP8-H L1 / L2
    # 16 x 128 1.11x / 1.13x; the fp16-H L2 swapped was no faster and stays on mma.sync.
    if role == "l1_fp8h":
        if interpret:
            return Tile(16, 128, 128, 4, 1, par=True)
        if rows_per_group <= 12:
            return Tile(16, 128, 128, 4, 3, par=True, swap=True)
        return Tile(64, 128, 128, 4, 3, par=True, qsplit=2)
    if role == "l2_fp8h":
        if interpret:
            role = "l2"
        elif rows_per_group <= 12:
            return Tile(16, 128, 128, 4, 3, par=True, swap=True)
        else:
            return Tile(64, 128, 128, 4, 4, par=True)
    if interpret:
        return Tile(16, 32, 128, 4, 1, par=role in ("l1", "l2"))
    if role == "l1":
        if rows_per_group <= 12:
            return Tile(16, 64, 128, 4, 3, par=True, swap=True)
        if rows_per_group <= 48:
            return Tile(64, 64, 128, 4, 4, par=True)
        return Tile(64, 64, 128, 4, 3, par=True)
    if role == "l2":
        if rows_per_group <= 12:
            return Tile(16, 128, 128, 4, 3, par=True)
        if rows_per_group <= 48:
            return Tile(64, 128, 128, 4, 4, par=True)
        return Tile(64, 128, 128, 4, 3, par=True)
    # dense (linear_q, the shared expert): at decode sizes the weights stream once through
    # few row tiles, so the column tile sets the parallelism: 32 weight columns per program
    # (16 x 2 for the SwiGLU pair). The 64 / 128-column tiles gave the attention projections
    # at 64 tokens 10 (wq_a, N = 1280) to 80 programs on 132 SMs: 2-7% of the HBM bandwidth,
    # the shared expert 6% (benchmarks/results/kernels-moe-h200.md).
    swiglu = role == "dense_swiglu"
    if rows_per_group <= 12:
        return Tile(16, 16 if swiglu else 32, 128, 4, 4)
    if rows_per_group <= 64:
        return Tile(64, 16 if swiglu else 32, 128, 4, 4)
    return Tile(128, 64 if swiglu else 128, 128, 8, 3)


_FELL_BACK: set[tuple] = set()


def _note_fallback(stage: str, wanted: str, ran: str, why: str) -> None:
    """Say once per (stage, wanted, ran) that the config's first candidate for a stage did not
    take the call and which kernel ran instead: the plan names the first, so a step down the
    candidate list is never silent."""
    key = (stage, wanted, ran)
    if key not in _FELL_BACK:
        _FELL_BACK.add(key)
        log.warning("moe: %s %s does not take this call (%s); %s runs", stage, wanted, why, ran)


@functools.cache
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index` (1 under the interpreter)."""
    if INTERPRET:
        return 1
    return torch.cuda.get_device_properties(index).multi_processor_count


def _jit():
    from megagraph.kernels.moe import triton_jit as moe_jit

    return moe_jit


_ASM_CHECKED: dict = {}


def asm_ok(dev: torch.device, mode: str = "auto") -> bool:
    """Whether the PTX upcast may run on `dev`: mode (a config's fp4_asm) "on" / "off" when
    set (never in the interpreter, which runs the arithmetic upcast only), else a one-time check
    that it matches the arithmetic upcast bit for bit on every byte value and exponent offset
    in [-6, 6], with a different offset in neighbouring elements (each byte lane has its own:
    moe_jit.FP4_E4M3_ASM) (run outside CUDA-graph capture; during a capture an unchecked device
    says no)."""
    if INTERPRET or mode == "off":
        return False
    if mode == "on":
        return True
    key = dev.index or 0
    if key not in _ASM_CHECKED:
        if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return False
        try:
            jit = _jit()
            bn, bk = 16, 512  # 16 rows x 256 bytes: every byte value with all 13 offsets
            p = torch.arange(256, dtype=torch.int32, device=dev).to(torch.uint8).repeat(bn, 1)
            r = torch.arange(bn, device=dev, dtype=torch.int32)[:, None]
            rel = ((r + torch.arange(bk // 2, device=dev, dtype=torch.int32)) % 13).contiguous()
            a = torch.empty(bn, bk, dtype=torch.uint8, device=dev)
            b = torch.empty_like(a)
            jit.fp4_upcast_check[(1,)](p, rel, a, b, BN=bn, BK=bk, num_warps=4)
            _ASM_CHECKED[key] = bool(torch.equal(a, b))
        except Exception:  # noqa: BLE001  (a compile failure means no)
            _ASM_CHECKED[key] = False
    return _ASM_CHECKED[key]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


@dataclass
class Bank:
    """One weight matrix (or a stack of G) as the GEMM reads it: B [G, N, K or K/2] (rows
    contiguous), E8M0 scales as uint8 [G, ns, ks], block of one scale (bn, bk), format code."""

    w: Tensor
    s: Tensor
    wfmt: int
    bn: int
    bk: int
    n: int
    k: int

    @property
    def groups(self) -> int:
        return self.w.shape[0]


def bank(w: Tensor, s: Tensor | None, fmt: str) -> Bank | None:
    """A Bank of 2-D [N, K] or stacked [G, N, K] weights, or None when the GEMM does not take
    this format / layout."""
    if fmt not in WFMT or s is None or w.dim() not in (2, 3) or s.dim() != w.dim():
        return None
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    s3 = s if s.dim() == 3 else s.unsqueeze(0)
    if w3.stride(-1) != 1 or s3.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        return None
    n = w3.shape[1]
    if fmt == "mxfp4":
        if w3.dtype not in (torch.int8, torch.uint8):
            return None
        k = w3.shape[2] * 2
        if tuple(s3.shape[1:]) != (n, k // 32):
            return None
        bn, bk = 1, 32
    else:
        if w3.dtype != torch.float8_e4m3fn:
            return None
        from megagraph.kernels import formats

        k = w3.shape[2]
        try:
            bn, bk = formats.infer_block_size((n, k), tuple(s3.shape[1:]))
        except ValueError:
            return None
        if bk & (bk - 1) or bn & (bn - 1) or bk < 32:
            return None
    if k % 128:
        return None
    s3 = s3.view(torch.uint8)
    return Bank(w3, s3 if s3.stride(-1) == 1 else s3.contiguous(), WFMT[fmt], bn, bk, n, k)


# ---------------------------------------------------------------------------------------------
# the GEMM launcher
# ---------------------------------------------------------------------------------------------


def _mma_for(a_dtype: torch.dtype, b: Bank, bk: int, exact: bool = False) -> int:
    if exact or a_dtype == torch.float32:
        return MMA_F32 if (INTERPRET or a_dtype == torch.float32) else MMA_BF16
    if a_dtype == torch.float8_e4m3fn:
        if b.wfmt == 0 or b.bk >= bk:
            return MMA_FP8
        return MMA_FP16
    return MMA_FP16  # fp16 A (H)


def tile_list(counts: Tensor, bm: int, max_tiles: int) -> Tensor:
    """The non-empty row tiles of a grouped GEMM, built on the device from the per-group counts
    (moe_tile_list: int32 [1 + 3 * max_tiles], the total first; no host sync)."""
    jit = _jit()
    G = counts.numel()
    if max_tiles == 0:
        return torch.zeros(1, dtype=torch.int32, device=counts.device)
    work = torch.empty(1 + 3 * max_tiles, dtype=torch.int32, device=counts.device)
    bt = 32
    jit.moe_tile_list[(-(-max_tiles // bt),)](counts, work, G, max_tiles, BM=bm,
                                              G_PAD=_next_pow2(G), BT=bt, num_warps=4)
    return work


def gemm(a: Tensor, a_scale: Tensor | None, b1: Bank, out: Tensor, *, b2: Bank | None = None,
         role: str, rows_per_group: float, counts: Tensor | None = None,
         a_idx: Tensor | None = None, c_idx: Tensor | None = None, row_w: Tensor | None = None,
         topk: int = 1, ks: int = 1, m: int | None = None, max_tiles: int | None = None,
         limit: float | None = None, batched: bool = False,
         a_group_stride: int = 0, as_group_stride: int = 0, c_group_stride: int = 0,
         out_scale: Tensor | None = None,
         kc: MoeConfig | GemmConfig | None = None) -> Tensor:
    """One moe_gemm launch. a [R, K] (fp8 with a_scale [R, K/128] f32, fp16, or fp32);
    out [rows, N] rows (stride(0) = row stride; a view is fine). Grouped when `counts` is given
    (rows sorted by group, `max_tiles` row tiles), else dense over m rows (x G groups with
    per-group offsets when `batched`).
    out_scale (the FP8-H L1): out is e4m3 and gets the codes, out_scale [rows, N/128] f32 the
    power-of-two scale of each row's 128 columns (moe_jit.quantize_out). kc: the config whose
    tiles, exact and fp4_asm apply (None: MoeConfig's defaults)."""
    jit = _jit()
    kc = kc or _MOE
    cfg = pick_tile(role, rows_per_group, kc)
    if out_scale is not None:
        _check_quant_out(cfg, b1, out, out_scale, batched)
    bk = cfg.bk
    K = b1.k
    if K % bk or (a_scale is not None and 128 % bk):
        raise ValueError(f"K {K} and the chunk {bk} do not fit")
    mma = _mma_for(a.dtype, b1, bk, kc.exact)
    nsub = bk // min(bk, b1.bk)
    N = b1.n
    bn = cfg.bn if out_scale is not None else max(16, min(cfg.bn, _next_pow2(N)))
    bm = cfg.bm
    num_n = -(-N // bn)
    G = b1.groups
    grouped = counts is not None
    if grouped:
        grid = (max_tiles * num_n, 1)
    else:
        grid = (-(-m // bm) * num_n, G if batched else 1)
    if grid[0] == 0:
        return out
    dummy = out
    b2 = b2 or b1
    jit.moe_gemm[grid](
        a, a_scale if a_scale is not None else dummy, a_idx if a_idx is not None else dummy,
        b1.w, b1.s, b2.w, b2.s, out, c_idx if c_idx is not None else dummy,
        row_w if row_w is not None else dummy, counts if counts is not None else dummy,
        m or 0, N, K, G, float(limit or 0.0),
        a.stride(0), a_scale.stride(0) if a_scale is not None else 0, a_group_stride,
        as_group_stride, b1.w.stride(0), b1.w.stride(1), b1.s.stride(0), b1.s.stride(1),
        out.stride(0), c_group_stride,
        out_scale if out_scale is not None else dummy,
        out_scale.stride(0) if out_scale is not None else 0,
        TOPK=topk, KS=ks, GROUPED=grouped, GATHER_A=a_idx is not None,
        SCATTER_C=c_idx is not None, WEIGHTED=row_w is not None, SWIGLU=b2 is not b1,
        HAS_LIMIT=limit is not None and limit > 0, A_SCALED=a_scale is not None,
        WFMT=b1.wfmt, MMA=mma, BLK_N_S=b1.bn, BLK_K_S=b1.bk, NSUB=nsub,
        USE_ASM=b1.wfmt == 0 and mma in (MMA_FP8, MMA_FP16) and asm_ok(out.device,
                                                                           kc.fp4_asm),
        MANUAL=INTERPRET, PAR=cfg.par and b1.wfmt == 0 and mma in (MMA_FP8, MMA_FP16),
        BM=bm, BN=bn, BK=bk, G_PAD=_next_pow2(G) if grouped else 1,
        QUANT_OUT=out_scale is not None, QSPLIT=cfg.qsplit if out_scale is not None else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"SWAP": 1} if _swap_ok(cfg, b1, mma, out_scale) else {}))
    return out


def _swap_ok(cfg: Tile, b1: Bank, mma: int, out_scale: Tensor | None) -> bool:
    """Tile.swap applies: MXFP4 weights (E8M0 per 32 columns of one row) with the fp8 / fp16
    MMA, a 128-column K chunk; a quantized output (the FP8-H L1) only unsplit (qsplit 1:
    moe_tile's QSPLIT = 2 path has its own K loops). The FP8-H L2 (E4M3 H with per-128 scales,
    A_SCALED) is the fp8 MMA: QGMMA m64n16 on the E4M3 W2 tile. SWAP is passed only when on, so
    an unswapped launch compiles the kernel without the option."""
    return (cfg.swap and b1.wfmt == 0 and b1.bn == 1 and b1.bk == 32
            and mma in (MMA_FP8, MMA_FP16) and cfg.bk == 128
            and (out_scale is None or cfg.qsplit == 1))


def _check_quant_out(cfg: Tile, b1: Bank, out: Tensor, out_scale: Tensor,
                     batched: bool) -> None:
    """The FP8-H epilogue's preconditions: whole 128-column blocks per tile, e4m3 codes, f32
    scales of one row per output row."""
    if cfg.bn % 128 or b1.n % 128 or batched:
        raise ValueError(f"quantized output needs bn ({cfg.bn}) and N ({b1.n}) multiples of 128 "
                         "and no batched groups")
    if cfg.qsplit not in (1, 2) or (cfg.qsplit == 2 and cfg.bn != 128):
        raise ValueError(f"qsplit {cfg.qsplit}: 1, or 2 with bn 128 (two 64-column halves)")
    if (out.dtype != torch.float8_e4m3fn or out_scale.dtype != torch.float32
            or out_scale.shape[-1] != b1.n // 128 or out_scale.stride(-1) != 1
            or out.stride(-1) != 1):
        raise ValueError("quantized output: out e4m3 [rows, N], out_scale f32 [rows, N / 128]")


# ---------------------------------------------------------------------------------------------
# router and permutation
# ---------------------------------------------------------------------------------------------

SCORES = {"sqrtsoftplus": 0, "softmax": 1, "sigmoid": 2}


def route_ids(x: Tensor, gate_w: Tensor, bias: Tensor | None, *, topk: int, route_scale: float,
              norm_topk: bool, score_func: str, tid2eid: Tensor | None = None,
              token_ids: Tensor | None = None, counts: Tensor | None = None,
              ids64: bool = False, cfg: MoeConfig | None = None) -> tuple[Tensor, Tensor]:
    """(ids [T, k] i32 (i64 if ids64), weights [T, k] f32); counts (i32 [E], zeroed) gets the
    expert histogram when given. Above 256 tokens the gate GEMM runs cfg.gate_tile; each
    score's K loop runs in the same order in any tile (the same ids and weights bit for bit)."""
    gate_bm, gate_be, gate_warps, gate_stages = (cfg or _MOE).gate_tile
    jit = _jit()
    T, D = x.shape
    E = gate_w.shape[0]
    dev = x.device
    ids = torch.empty(T, topk, dtype=torch.int64 if ids64 else torch.int32, device=dev)
    wts = torch.empty(T, topk, dtype=torch.float32, device=dev)
    if T == 0:
        return ids, wts
    small = T <= 256 or INTERPRET
    bm = 16 if small else gate_bm
    be = 64 if small else gate_be
    bk = 64
    split = _gate_split(-(-T // bm) * -(-E // be), D, bk)
    scores = torch.empty(split, T, E, dtype=torch.float32, device=dev)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gw = gate_w if gate_w.stride(-1) == 1 else gate_w.contiguous()
    if INTERPRET or x.dtype == torch.float32 or x.dtype != torch.bfloat16:
        mode = 2
    else:
        mode = 0 if gw.dtype == torch.bfloat16 else 1
        if gw.dtype not in (torch.bfloat16, torch.float32):
            mode = 2
    jit.gate_scores[(-(-T // bm), -(-E // be), split)](
        x, gw, scores, T, E, D, D // split, x.stride(0), gw.stride(0), scores.stride(1),
        scores.stride(0), MODE=mode, BM=bm, BE=be, BK=bk,
        num_warps=4 if small else gate_warps, num_stages=3 if small else gate_stages)
    hashed = tid2eid is not None
    bmk = 8
    jit.route_topk[(-(-T // bmk),)](
        scores, bias if bias is not None else scores, ids, wts,
        counts if counts is not None else ids, tid2eid if hashed else ids,
        token_ids if hashed else ids, T, E, float(route_scale), scores.stride(1),
        scores.stride(0), SPLIT=split, TOPK=topk, K_PAD=_next_pow2(max(topk, 2)), SCORE=SCORES[score_func],
        HAS_BIAS=bias is not None, NORM=bool(norm_topk), HASH=hashed, COUNT=counts is not None,
        IDS64=ids64, BM=bmk, E_PAD=_next_pow2(E), num_warps=4)
    return ids, wts


def _gate_split(programs: int, D: int, bk: int) -> int:
    """K slices of the router's gate GEMM: enough for ~128 programs when few tokens give few
    (64 tokens x 384 experts: 24 tiles of 16 x 64 each streaming all 5120 columns, 30 us on the
    H200 for 4 MB of weights), each slice a multiple of bk; 1 when the tiles fill the GPU."""
    split = 1
    while programs * split * 2 <= 128 and D % (split * 2 * bk) == 0 and split < 8:
        split *= 2
    return split


def permute(ids: Tensor, counts: Tensor, E: int) -> Tensor:
    """Expert-sorted pair list (i32 [P]) from flat ids [P] and their histogram counts [E]."""
    jit = _jit()
    P = ids.numel()
    srt = torch.empty(P, dtype=torch.int32, device=ids.device)
    cur = torch.empty(E, dtype=torch.int32, device=ids.device)
    jit.moe_plan[(1,)](counts, cur, E, E_PAD=_next_pow2(E), num_warps=4)
    bp = 256
    jit.moe_scatter[(-(-P // bp),)](ids, cur, srt, P, E, BP=bp, num_warps=4)
    return srt


def sorted_rows(a: Tensor, a_idx: Tensor, topk: int, triton_copy: bool = True) -> Tensor:
    """[P, K] copy of a's rows in expert-sorted order: row r = a[a_idx[r] // topk] (the A the
    warp-specialized L1 streams by TMA), by moe_gather_rows in 32-bit words where the rows allow
    (K bytes and the row stride multiples of 4, a 4-byte aligned base; 16-byte accesses when
    they are multiples of 16), else index_select (also with triton_copy False:
    MoeConfig.a_prep_triton)."""
    P, K = a_idx.numel(), a.shape[1]
    nbytes = K * a.element_size()
    out = torch.empty(P, K, dtype=a.dtype, device=a.device)
    if not (triton_copy and on_device(a) and nbytes % 4 == 0 and a.stride(1) == 1
            and (a.stride(0) * a.element_size()) % 4 == 0 and a.data_ptr() % 4 == 0):
        return torch.index_select(a, 0, torch.div(a_idx, topk, rounding_mode="floor"),
                                  out=out)
    if P == 0:
        return out
    src = a.view(torch.uint8).view(torch.int32)  # any dtype's rows as 32-bit words
    W = nbytes // 4
    bw = 256 if W % 256 == 0 else min(256, _next_pow2(W))
    br = max(1, 2048 // bw)
    _jit().moe_gather_rows[(-(-P // br),)](
        src, a_idx, out.view(torch.uint8).view(torch.int32), P, W, src.stride(0), W, TOPK=topk,
        BR=br, BW=bw, num_warps=4)
    return out


def tile_scales(a_scale: Tensor, a_idx: Tensor, topk: int, tiles: Tensor, max_tiles: int,
                kc: int, bm: int, triton_copy: bool = True) -> Tensor:
    """[kc, max_tiles bm] f32: column j bm + r = the A scales (chunks 0..kc-1) of row r of tile j
    of tile_list's device list (sorted row row0_j + r, token a_idx[...] // topk), 0 past the
    tile's rows and past the list: each tile's scales start 16-byte aligned (the
    warp-specialized L1's STMA boxes). One launch, no host sync (CUDA-graph capturable);
    triton_copy False (MoeConfig.a_prep_triton): torch ops."""
    if not (triton_copy and on_device(a_scale)):
        return _tile_scales_torch(a_scale, a_idx, topk, tiles, max_tiles, kc, bm)
    out = torch.empty(kc, max_tiles * bm, dtype=torch.float32, device=a_scale.device)
    if max_tiles == 0:
        return out
    _jit().moe_tile_scales[(max_tiles,)](
        a_scale, a_idx, tiles, out, max_tiles, a_idx.numel(), kc, a_scale.stride(0), TOPK=topk,
        BM=bm, KC_PAD=_next_pow2(kc), num_warps=4)
    return out


def _tile_scales_torch(a_scale: Tensor, a_idx: Tensor, topk: int, tiles: Tensor, MT: int,
                       kc: int, bm: int) -> Tensor:
    """tile_scales in torch ops (where Triton does not run, and a_prep_triton off): 17
    launches, 159 us at 8192 tokens on the H200 (ncu; the kernel: 10 us)."""
    dev = a_scale.device
    P = a_idx.numel()
    row0 = tiles[1 + MT:1 + 2 * MT].long()
    rend = tiles[1 + 2 * MT:1 + 3 * MT].long()
    idx = row0[:, None] + torch.arange(bm, device=dev)[None, :]
    ok = (idx < rend.clamp(max=P)[:, None]) & (idx >= 0) & \
        (torch.arange(MT, device=dev)[:, None] < tiles[0].long())
    src = torch.div(a_idx.index_select(0, idx.clamp(0, max(P - 1, 0)).flatten()), topk,
                    rounding_mode="floor")
    sa = a_scale[:, :kc].float().index_select(0, src) * ok.flatten()[:, None]
    return sa.t().contiguous()


def routed_experts(x_q: Tensor, x_scale: Tensor, ids: Tensor, wts: Tensor, counts: Tensor,
                   w1: Bank, w3: Bank, w2: Bank, y: Tensor, *, topk: int,
                   swiglu_limit: float | None, fp8_h: bool | None = None,
                   cfg: MoeConfig | None = None) -> Tensor:
    """Y[t, j] = wts[t, j] * E_{ids[t, j]}(x[t]) for every pair, into y [T, KS, d] (KS >= topk).
    fp8_h: H as E4M3 + per-(row, 128 columns) scales written by L1's epilogue, L2 on the FP8 MMA
    (roles "l1_fp8h" / "l2_fp8h"), or H in fp16 (False); None: as cfg says (cfg.fp8_h at every
    size; cfg.fp8_h_prefill at prefill sizes where both warp-specialized FP8-H kernels take the
    call: tried first with an E4M3 H, fp16 H if either does not). The kernels of each stage:
    the first of cfg's candidate lists (MoeConfig.l1_candidates / l2_candidates) that takes the
    call."""
    cfg = cfg or _MOE
    T = x_q.shape[0]
    P = T * topk
    E = w1.groups
    srt = permute(ids.reshape(-1), counts, E)
    rpg = P / max(1, min(E, P))
    auto = fp8_h is None and not cfg.fp8_h and _prefill_fp8_h_may(x_q, rpg, cfg)
    fp8_h = auto or (cfg.fp8_h if fp8_h is None else bool(fp8_h))
    h, h_scale, k1, k2 = _h_and_kernels(x_q, x_scale, w1, w3, w2, y, P, rpg, fp8_h, cfg)
    if auto and (k1[0] == "triton" or k2[0] == "triton"):  # the ws FP8-H kernels do not take it
        fp8_h = False
        h, h_scale, k1, k2 = _h_and_kernels(x_q, x_scale, w1, w3, w2, y, P, rpg, False, cfg)
    r1, r2 = ("l1_fp8h", "l2_fp8h") if fp8_h else ("l1", "l2")
    cfg1 = pick_tile(r1, rpg, cfg)
    mt1 = min(P, P // cfg1.bm + E)
    shared_tiles = None  # one device tile list for both Gluon decode kernels (same row tile)
    if k1[1] is not None and k2[1] is not None and k1[2] == k2[2]:
        shared_tiles = tile_list(counts, k1[2], min(P, P // k1[2] + E))
    if k1[0] == "cublas_grouped":
        from megagraph.kernels.moe import grouped_cublas as moe_grouped_cublas

        moe_grouped_cublas.l1_swiglu(x_q, x_scale, srt, w1, w3, counts, h, topk=topk,
                                     limit=swiglu_limit)
    elif k1[1] is not None:
        _, launch, rows = k1
        launch(x_q, x_scale, srt, w1, w3, counts, h, topk=topk,
               max_tiles=min(P, P // rows + E), limit=swiglu_limit, tiles=shared_tiles)
    else:
        gemm(x_q, x_scale, w1, h, b2=w3, role=r1, rows_per_group=rpg, counts=counts,
             a_idx=srt, topk=topk, max_tiles=mt1, limit=swiglu_limit, out_scale=h_scale,
             kc=cfg)
    cfg2 = pick_tile(r2, rpg, cfg)
    ks = y.shape[1]
    mt2 = min(P, P // cfg2.bm + E)
    if k2[1] is not None:
        _, launch, rows = k2
        launch(h, w2, counts, srt, wts.reshape(-1), y.view(T * ks, -1), topk=topk, ks=ks,
               max_tiles=min(P, P // rows + E), tiles=shared_tiles)
    else:
        gemm(h, h_scale, w2, y.view(T * ks, -1), role=r2, rows_per_group=rpg, counts=counts,
             c_idx=srt, row_w=wts.reshape(-1), topk=topk, ks=ks, max_tiles=mt2, kc=cfg)
    return y


def _prefill_fp8_h_may(x_q: Tensor, rows_per_group: float, cfg: MoeConfig) -> bool:
    """Whether routed_experts tries FP8 H by default (cfg.fp8_h_prefill): prefill sizes (>
    cfg.wide_l1_min_rows rows per expert) where the warp-specialized kernels can run (sm_90 with
    Gluon). The cheap gate before an E4M3 H is allocated; the kernels' fits decide."""
    if not cfg.fp8_h_prefill or rows_per_group <= cfg.wide_l1_min_rows:
        return False
    from megagraph.kernels.moe import gluon_ws as mw

    return mw.available(x_q.device)


def _shared_fp8_h_may(x_q: Tensor, rows_per_group: float, cfg: MoeConfig) -> bool:
    """Whether mega_moe tries the shared expert with FP8 H (shared_expert_fp8h):
    cfg.shared_fp8_h and the routed experts' H is E4M3 at this size (cfg.fp8_h, or
    fp8_h_prefill's gate) - one numerics decision for all the layer's experts."""
    return cfg.shared_fp8_h and (cfg.fp8_h or _prefill_fp8_h_may(x_q, rows_per_group, cfg))


def _h_and_kernels(x_q: Tensor, x_scale: Tensor | None, w1: Bank, w3: Bank, w2: Bank,
                   y: Tensor, P: int, rows_per_group: float, fp8_h: bool, cfg: MoeConfig):
    """routed_experts' H (E4M3 + f32 scales per 128 columns with fp8_h, else fp16 / fp32 and
    no scales) and the kernels of its L1 / L2: (name, launch or None for moe_gemm and the
    cuBLAS grouped L1, row tile) each, the first candidate of cfg's lists that fits."""
    F = w1.n
    h_scale = None
    if fp8_h:
        h = torch.empty(P, F, dtype=torch.float8_e4m3fn, device=x_q.device)
        h_scale = torch.empty(P, F // 128, dtype=torch.float32, device=x_q.device)
    else:
        h_dtype = torch.float32 if (cfg.exact or x_q.dtype == torch.float32) else torch.float16
        h = torch.empty(P, F, dtype=h_dtype, device=x_q.device)
    k1 = _first_fit("L1", cfg.l1_candidates(rows_per_group, fp8_h),
                    lambda name: _l1_kernel(name, x_q, x_scale, w1, w3, h, h_scale,
                                            rows_per_group, cfg))
    k2 = _first_fit("L2", cfg.l2_candidates(rows_per_group, fp8_h),
                    lambda name: _l2_kernel(name, h, h_scale, w2, y, cfg))
    return h, h_scale, k1, k2


def _first_fit(stage: str, names: list[str], fit) -> tuple:
    """(name, launch, row tile) of the first candidate that takes the call; fit(name) gives
    (launch, rows) or a string saying why not. "triton" (the last candidate) always fits."""
    why = None
    for name in names:
        got = (None, 0) if name == "triton" else fit(name)
        if not isinstance(got, str):
            if name != names[0]:
                _note_fallback(stage, names[0], name, why or "")
            return (name, *got)
        why = why or got
    raise AssertionError(f"{stage}: no candidate in {names}")


def _l1_common(x_q: Tensor, x_scale: Tensor | None, w1: Bank, w3: Bank, h: Tensor,
               fp16_h: bool) -> str | None:
    """Why no Gluon L1 takes the call (E4M3 activations with scales, fp16 H (or E4M3 H for
    the FP8-H kernel), MXFP4 banks with one E8M0 per 32 columns), or None."""
    if x_q.dtype != torch.float8_e4m3fn or x_scale is None:
        return "activations not E4M3 with scales"
    if fp16_h and h.dtype != torch.float16:
        return f"H {h.dtype}, not fp16"
    if not _mxfp4_e8m0_32(w1, w3):
        return "weights not MXFP4 with E8M0 per 32 columns"
    return None


def _l1_kernel(name: str, x_q: Tensor, x_scale: Tensor | None, w1: Bank, w3: Bank, h: Tensor,
               h_scale: Tensor | None, rows_per_group: float, cfg: MoeConfig):
    """Candidate `name` of the L1 as (launch, row tile) where it takes the call, else why not.
    gluon_ws(_fp8h): moe_gluon_ws, the warp-specialized L1 with persistent CTAs (its 128-column
    tile where cfg.ws_l1_bn and F allow, A by TMA, row frames); gluon_decode_wide: the decode
    kernel with cfg.wide_bt-token tiles and its weights by TMA; gluon_decode: the decode kernel
    (swapped wgmma with the upcast weights as a register operand); cublas_grouped: the experts
    upcast to E4M3 per call and cuBLAS's grouped FP8 GEMM (launched by routed_experts)."""
    why = _l1_common(x_q, x_scale, w1, w3, h, fp16_h=name != "gluon_ws_fp8h")
    if why and name != "cublas_grouped":
        return why
    if name == "gluon_ws_fp8h":
        from megagraph.kernels.moe import gluon_ws as mod

        if w1.n % mod.BN_WIDE:
            return f"F {w1.n} not a multiple of {mod.BN_WIDE}"
        if not mod.available(x_q.device):
            return "no Gluon sm_90 on this device"
        why = (mod.args_problem(x_q, x_scale, w1, w3, None, h, mod.BN_WIDE)
               or mod._fp8_h_problem(h, h_scale, h.shape[0], w1.n))
        if why:
            return why
        return _ws_l1_launch(w1, w3, True, cfg, a_tma=True, out_scale=h_scale), mod.BM
    if name == "gluon_ws":
        from megagraph.kernels.moe import gluon_ws as mod

        if not mod.available(x_q.device):
            return "no Gluon sm_90 on this device"
        why = mod.args_problem(x_q, x_scale, w1, w3, None, h)
        if why:
            return why
        wide = cfg.ws_l1_bn == mod.BN_WIDE and w1.n % mod.BN_WIDE == 0
        return (_ws_l1_launch(w1, w3, wide, cfg, a_tma=cfg.ws_wide_a_tma if wide else False),
                mod.BM)
    if name in ("gluon_decode", "gluon_decode_wide"):
        from megagraph.kernels.moe import gluon_decode as mod

        if w1.n % mod.BW or w1.k % mod.BK or w1.k // mod.BK > 256:
            return f"F {w1.n} / d {w1.k} do not fit the {mod.BW} x {mod.BK} block"
        if name == "gluon_decode_wide" and not (mod._tma_fits(w1) and mod._tma_fits(w3)):
            return "weights TMA cannot describe"
        if not mod.available(x_q.device):
            return "no Gluon sm_90 on this device"
        if name == "gluon_decode_wide":
            return (functools.partial(mod.l1_gluon_decode, bt=cfg.wide_bt, load="tma"),
                    cfg.wide_bt)
        load = None if cfg.gluon_decode_load == mod.LOAD else cfg.gluon_decode_load
        return functools.partial(mod.l1_gluon_decode, load=load), mod.BT
    if name == "cublas_grouped":
        from megagraph.kernels.moe import grouped_cublas as moe_grouped_cublas

        if not moe_grouped_cublas.applies(x_q, w1, w3, h, rows_per_group,
                                          cfg.cublas_l1_min_rows):
            return "cuBLAS grouped FP8 GEMM does not apply"
        return None, 0
    raise ValueError(f"unknown L1 kernel {name!r}")


def _ws_l1_launch(w1: Bank, w3: Bank, wide: bool, cfg: MoeConfig, **kw):
    """moe_gluon_ws.l1_gluon_ws as routed_experts launches it, fp16 H or FP8 H: persistent CTAs,
    the tile's rings (cfg.ws_wide_rings on the 128-column tile, cfg.ws_rings on the 64-column
    one), row frames on the 128-column tile where cfg.ws_l1_frames and the weights allow; kw:
    the rest (a_tma, out_scale)."""
    from megagraph.kernels.moe import gluon_ws as mod

    rings = cfg.ws_wide_rings if wide else cfg.ws_rings
    frames = mod.row_frames(w1, w3) if wide and cfg.ws_l1_frames else None
    extra = {} if cfg.ws_small_tma else {"stma": False}
    return functools.partial(mod.l1_gluon_ws, persist=True, stages=rings[0], bstages=rings[1],
                             bn=mod.BN_WIDE if wide else mod.BN, frames=frames,
                             a_prep=cfg.a_prep_triton, **extra, **kw)


def triton_l2(h: Tensor, w2: Bank, counts: Tensor, srt: Tensor, wts: Tensor,
              y: Tensor) -> Tensor:
    """The Triton L2 as routed_experts launches it with fp16 H (moe.gemm role "l2": y [T, ks, d]
    row (p // topk) * ks + p % topk = wts[p] x H[r] W2^T for sorted row r, p = srt[r]): the
    baseline the Gluon decode L2 is tested and timed against."""
    T, k = wts.shape
    P, E = T * k, counts.numel()
    rpg = P / max(1, min(E, P))
    mt2 = min(P, P // pick_tile("l2", rpg).bm + E)
    return gemm(h, None, w2, y.view(T * y.shape[1], -1), role="l2", rows_per_group=rpg,
                counts=counts, c_idx=srt, row_w=wts.reshape(-1), topk=k, ks=y.shape[1],
                max_tiles=mt2)


def _l2_kernel(name: str, h: Tensor, h_scale: Tensor | None, w2: Bank, y: Tensor,
               cfg: MoeConfig):
    """Candidate `name` of the L2 as (launch, row tile) where it takes the call, else why not.
    gluon_decode_l2: swapped fp16 wgmma, the MXFP4 W2 upcast in registers (d % 64, F % 128);
    gluon_l2 / gluon_l2_ws: the prefill L2, 128 x 128 tiles (d % 128, F % 384), and its
    warp-specialized twin on TMA streams (256-column tiles where d % 256 == 0, or
    cfg.ws_l2_bn; rings cfg.ws_l2_rings); gluon_l2_fp8: the warp-specialized L1's kernel on
    FP8 H x W2 (moe_gluon_l2_fp8)."""
    if not _mxfp4_e8m0_32(w2):
        return "W2 not MXFP4 with E8M0 per 32 columns"
    if name == "gluon_l2_fp8":
        from megagraph.kernels.moe import gluon_l2_fp8 as mod

        if h_scale is None:
            return "H not E4M3"
        if not mod.available(h.device):
            return "no Gluon sm_90 on this device"
        why = mod.args_problem(h, h_scale, w2, y.view(-1, y.shape[-1]))
        if why:
            return why

        def launch(h, w2, counts, srt, wts, y, **kw):
            return mod.l2_gluon_ws_fp8(h, h_scale, w2, counts, srt, wts, y, **kw)

        return launch, mod.BM
    if h.dtype != torch.float16:
        return f"H {h.dtype}, not fp16"
    if name in ("gluon_l2", "gluon_l2_ws"):
        from megagraph.kernels.moe import gluon_l2 as mod

        if w2.n % mod.BN or w2.k % (mod.NS * mod.BK) or y.dtype not in mod.OUT_DTYPES:
            return f"d {w2.n} / F {w2.k} / y {y.dtype} do not fit the prefill L2"
        if name == "gluon_l2":
            return (mod.l2_gluon, mod.BM) if mod.available(h.device) else \
                "no Gluon sm_90 on this device"
        from megagraph.kernels.moe import gluon_l2_ws as mws

        if not mws.available(h.device):
            return "no Gluon sm_90 on this device"
        why = None
        for bn in ([cfg.ws_l2_bn] if cfg.ws_l2_bn else [2 * mws.BN, mws.BN]):
            why = mws.args_problem(h, w2, y, bn)
            if why is None:
                rings = cfg.ws_l2_rings
                kw = dict(stages=rings[0], bstages=rings[1]) if rings else {}
                return functools.partial(mws.l2_gluon_ws, **kw, bn=bn), mws.BM
        return why
    if name == "gluon_decode_l2":
        from megagraph.kernels.moe import gluon_decode_l2 as mod

        if w2.n % mod.BW or w2.k % mod.BK or y.dtype not in mod.OUT_DTYPES:
            return f"d {w2.n} / F {w2.k} / y {y.dtype} do not fit the decode L2"
        if not mod.available(h.device):
            return "no Gluon sm_90 on this device"
        load = None if cfg.gluon_decode_l2_load == mod.LOAD else cfg.gluon_decode_l2_load
        return functools.partial(mod.l2_gluon_decode, load=load), mod.BT
    raise ValueError(f"unknown L2 kernel {name!r}")


def _mxfp4_e8m0_32(*banks: Bank) -> bool:
    """MXFP4 banks with one E8M0 exponent per 32 columns of a row (what the Gluon kernels read)."""
    return all(b.wfmt == 0 and b.bk == 32 and b.bn == 1 for b in banks)


def shared_expert(x_q: Tensor, x_scale: Tensor, w1: Bank, w3: Bank, w2: Bank, out: Tensor, *,
                  swiglu_limit: float | None, cfg: MoeConfig | GemmConfig | None = None,
                  gemm_cfg: GemmConfig | None = None) -> Tensor:
    """out [T, d] (a strided view is fine) = W2 (silu(min(W1 x, lim)) * clamp(W3 x)) (dense).
    cfg: the Triton tiles / exact / fp4_asm (and MoeConfig.shared_mm_out); gemm_cfg: the
    cuBLAS choices (None: GemmConfig's defaults, or cfg where it is a GemmConfig)."""
    cfg = cfg or _MOE
    gemm_cfg = gemm_cfg or (cfg if isinstance(cfg, GemmConfig) else _GEMM)
    T = x_q.shape[0]
    h_dtype = torch.float32 if (cfg.exact or x_q.dtype == torch.float32) else torch.float16
    y13 = _cublas_l1(x_q, x_scale, w1, w3, cfg=gemm_cfg, exact=cfg.exact)
    w2b = _bf16_w2(w2, gemm_cfg) if y13 is not None else None
    if w2b is not None:
        h_dtype = torch.bfloat16  # the bf16 GEMM's operand (the fp16 H of the Triton L2 below)
    h = torch.empty(T, w1.n, dtype=h_dtype, device=x_q.device)
    if y13 is not None:  # [W1; W3] as one cuBLAS GEMM (fp32 out), then the SwiGLU + clamp
        bf = 1024
        _jit().swiglu_rows[(T, -(-w1.n // bf))](
            y13, h, w1.n, float(swiglu_limit or 0.0), y13.stride(0), h.stride(0),
            HAS_LIMIT=swiglu_limit is not None and swiglu_limit > 0, BF=bf, num_warps=4)
    else:
        gemm(x_q, x_scale, w1, h, b2=w3, role="dense_swiglu", rows_per_group=T, m=T,
             limit=swiglu_limit, kc=cfg)
    if w2b is not None:  # cuBLAS bf16 on the cached exact bf16 W2
        if (getattr(cfg, "shared_mm_out", True) and out.dtype == torch.bfloat16
                and out.stride(-1) == 1):
            # straight into the strided slot view (cuBLAS's ldc): no temporary and no copy (95
            # us of 8192 x 5120 bf16 on the H200, ncu)
            torch.mm(h, w2b.t(), out=out)
        else:
            out.copy_(torch.mm(h, w2b.t()))
    else:
        gemm(h, None, w2, out, role="dense", rows_per_group=T, m=T, kc=cfg)
    return out


def _bf16_w2(w2: Bank, gemm_cfg: GemmConfig) -> Tensor | None:
    """The shared expert's W2 as a cached bf16 matrix (kernels/cublas_fp8.dense_bf16: exact) for
    a cuBLAS bf16 GEMM on bf16 H, where the first GEMM ran on cuBLAS; None keeps the Triton L2 on
    fp16 H. Why bf16 and not FP8 H: the reference keeps H in high precision (E4M3 H costs ~3% on
    the output, MoeConfig.fp8_h); why not the Triton GEMM: 24 us at 64 rows and 0.79 ms at 8192 on
    the H200 for 24 MB of weights, 5-13% of the bandwidth / bf16 roofline."""
    if w2.wfmt != 1 or w2.groups != 1:
        return None
    from megagraph.kernels.gemm import cublas_fp8

    return cublas_fp8.dense_bf16(w2.w[0], w2.s[0], gemm_cfg)


def shared_expert_fp8h(x_q: Tensor, x_scale: Tensor, w1: Bank, w3: Bank, w2: Bank, *,
                       swiglu_limit: float | None, out_dtype: torch.dtype,
                       gemm_cfg: GemmConfig | None = None) -> Tensor | None:
    """The shared expert with FP8 H, all on cuBLAS's block-scaled FP8 GEMM: [W1; W3] x into bf16
    [T, 2F] (_cublas_l1), swiglu_rows_q quantizing H per row and 128 columns to E4M3 (the
    routed experts' FP8-H numerics: quantize_act fp8_1x128, DeepSeek's activation quantization
    before every FP8 linear), then H W2^T into a new [T, d] tensor of out_dtype (scaled_mm has
    no out=: combine reads it from there, shared_out). None where it does not apply: FP8-block
    banks of one weight each, F % 128 == 0, a bf16 / fp32 out, W2 and the L1 taken by cuBLAS.
    Why: the bf16 W2 GEMM (0.25 ms at 8192 tokens on the H200) runs at the bf16 roofline, the
    FP8 one has twice the ceiling; the L1's bf16 output halves its 134 MB fp32 write."""
    from megagraph.kernels.gemm import cublas_fp8

    F = w1.n
    g = gemm_cfg or _GEMM
    form = g.prefill_form(x_q.shape[0])  # 128 x 128 weight blocks at prefill sizes
    if (not g.cublas_fp8 or w2.wfmt != 1 or w2.groups != 1 or F % 128 or w2.k != F
            or out_dtype not in (torch.bfloat16, torch.float32)
            or _cublas_l1_problem(x_q, w1, w3, g)
            or cublas_fp8.prepare((w2.w[0], w2.s[0]), form=form, first=g.cublas_form) is None):
        return None
    y13 = _cublas_l1(x_q, x_scale, w1, w3, torch.bfloat16, form=form, cfg=g)
    if y13 is None:
        return None
    h, hs = swiglu_fp8(y13, F, swiglu_limit)
    return cublas_fp8.linear(h, hs, [(w2.w[0], w2.s[0])], out_dtype, form=form, cfg=g)


def swiglu_fp8(y13: Tensor, F: int, swiglu_limit: float | None) -> tuple[Tensor, Tensor]:
    """(H E4M3 [T, F], scales f32 [T, F / 128]) = quantize_act fp8_1x128 of swiglu_act(y13[:, :F],
    y13[:, F:2F]) (swiglu_rows_q; F % 128 == 0); the scales outer-dim-major (stride (1, T)), the
    layout cuBLAS reads."""
    if F % 128:
        raise ValueError(f"swiglu_fp8: F {F} is no multiple of 128")
    T = y13.shape[0]
    h = torch.empty(T, F, dtype=torch.float8_e4m3fn, device=y13.device)
    hs = torch.empty(F // 128, T, dtype=torch.float32, device=y13.device).t()
    if T == 0:
        return h, hs
    bf = 512 if F % 512 == 0 else 128
    br = 2048 // bf
    _jit().swiglu_rows_q[(-(-T // br), F // bf)](
        y13, h, hs, T, F, float(swiglu_limit or 0.0), y13.stride(0), h.stride(0), hs.stride(0),
        hs.stride(1), HAS_LIMIT=swiglu_limit is not None and swiglu_limit > 0, BR=br, BF=bf,
        num_warps=4)
    return h, hs


def _cublas_l1_problem(x_q: Tensor, w1: Bank, w3: Bank, cfg: GemmConfig,
                       exact: bool = False) -> bool:
    """_cublas_l1 does not take the call (its cheap checks, before any weight is prepared)."""
    return (w1.wfmt != 1 or w3.wfmt != 1 or w1.groups != 1 or w3.groups != 1 or INTERPRET
            or exact or x_q.dtype != torch.float8_e4m3fn or x_q.shape[0] < cfg.cublas_min_rows)


def _cublas_l1(x_q: Tensor, x_scale: Tensor, w1: Bank, w3: Bank,
               out_dtype: torch.dtype = torch.float32, form: str | None = None, *,
               cfg: GemmConfig, exact: bool = False) -> Tensor | None:
    """The shared expert's first GEMM on cuBLAS (kernels/gemm/cublas_fp8.py): [T, 2F] = x @
    [W1; W3]^T in out_dtype (fp32; bf16 for shared_expert_fp8h, whose H is E4M3 afterwards) for
    FP8-block banks (one weight each), E4M3 x, >= cfg.cublas_min_rows rows; else None (the
    Triton dense_swiglu tile with the SwiGLU in its epilogue runs). form: cublas_fp8.linear's."""
    if _cublas_l1_problem(x_q, w1, w3, cfg, exact):
        return None
    from megagraph.kernels.gemm import cublas_fp8

    return cublas_fp8.linear(x_q, x_scale, [(w1.w[0], w1.s[0]), (w3.w[0], w3.s[0])],
                             out_dtype, form=form, cfg=cfg)


def combine(y: Tensor, out: Tensor, *, topk: int, shared: bool, rdt: torch.dtype,
            streams: Tensor | None = None, post: Tensor | None = None,
            comb: Tensor | None = None, shared_out: Tensor | None = None) -> Tensor:
    """out = the routed slots y[:, :topk] summed (+ the shared expert's output: y's slot topk,
    or shared_out [T, d] where it has its own tensor - shared_expert_fp8h's) (+ the mHC residual
    expand of streams with post / comb); moe_combine."""
    jit = _jit()
    T, _, D = y.shape
    if T == 0:
        return out
    bd = 256 if not INTERPRET else 128
    expand = streams is not None
    hc = streams.shape[1] if expand else 1
    sh = shared_out if shared_out is not None else (y[:, topk] if shared else y)
    if sh.stride(-1) != 1 or sh.shape[0] != T:
        raise ValueError("combine: the shared output needs [T, d] rows with unit column stride")
    jit.moe_combine[(T, -(-D // bd))](
        y, sh, streams if expand else y, post if expand else y, comb if expand else y, out, D,
        y.stride(0), sh.stride(0), streams.stride(0) if expand else 0,
        streams.stride(1) if expand else 0, out.stride(0), out.stride(1) if expand else 0,
        K=topk, SHARED=shared, EXPAND=expand, HC=hc, RDT=RDT[rdt], MANUAL=INTERPRET, BD=bd,
        num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------------------------


def _fallback(name: str):
    from megagraph.kernels.fused import capturable as fused

    return getattr(fused, name)


def _q_ok(x_q: Tensor, x_scale: Tensor, act_fmt: str) -> bool:
    return (available() and on_device(x_q) and act_fmt == "fp8_1x128"
            and x_q.dtype == torch.float8_e4m3fn and x_scale.dtype == torch.float32
            and x_q.shape[-1] % 128 == 0 and x_q.stride(-1) == 1 and x_scale.stride(-1) == 1)


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _ydtype(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt == torch.float32 else torch.bfloat16


def moe_experts_q(x_q, x_scale, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt,
                  swiglu_limit, act_fmt, out_dtype, kernel_config: MoeConfig | None = None):
    """kernels.fused.reference.moe_experts_q: routed experts on the quantized activation."""
    from megagraph.graph.interp import TORCH_DTYPES

    banks = [bank(w, s, fmt) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    odt = TORCH_DTYPES[out_dtype]
    if (not _q_ok(x_q, x_scale, act_fmt) or None in banks or x_q.dim() != 2
            or odt not in RDT or banks[0].k != x_q.shape[1]):
        return _fallback("moe_experts_q")(x_q, x_scale, ids, weights, w1, w1_scale, w3, w3_scale,
                                          w2, w2_scale, fmt=fmt, swiglu_limit=swiglu_limit,
                                          act_fmt=act_fmt, out_dtype=out_dtype)
    jit = _jit()
    T, d = x_q.shape
    k = ids.shape[1]
    E = banks[0].groups
    out = torch.empty(T, d, dtype=odt, device=x_q.device)
    if T == 0:
        return out
    ids32 = ids.to(torch.int32).clamp_(0, E - 1).contiguous()
    counts = torch.zeros(E, dtype=torch.int32, device=x_q.device)
    P = T * k
    jit.count_ids[(-(-P // 1024),)](ids32, counts, P, E, BP=1024, num_warps=4)
    y = torch.empty(T, k, d, dtype=_ydtype(odt), device=x_q.device)
    routed_experts(x_q, x_scale, ids32, weights.float().contiguous(), counts, *banks, y,
                   topk=k, swiglu_limit=swiglu_limit, cfg=kernel_config)
    return combine(y, out, topk=k, shared=False, rdt=odt)


def swiglu_mlp_q(x_q, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale, *, fmt, swiglu_limit,
                 act_fmt, out_dtype, kernel_config: GemmConfig | None = None):
    """kernels.fused.reference.swiglu_mlp_q: one dense SwiGLU expert (the shared expert)."""
    from megagraph.graph.interp import TORCH_DTYPES

    banks = [bank(w, s, fmt) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    if (not _q_ok(x_q, x_scale, act_fmt) or None in banks or banks[0].groups != 1
            or banks[0].k != x_q.shape[-1]):
        return _fallback("swiglu_mlp_q")(x_q, x_scale, w1, w1_scale, w3, w3_scale, w2, w2_scale,
                                         fmt=fmt, swiglu_limit=swiglu_limit, act_fmt=act_fmt,
                                         out_dtype=out_dtype)
    xq, xs = _flat(x_q), _flat(x_scale)
    out = torch.empty(xq.shape[0], banks[2].n, dtype=TORCH_DTYPES[out_dtype], device=x_q.device)
    if xq.shape[0]:
        shared_expert(xq, xs, *banks, out, swiglu_limit=swiglu_limit,
                      cfg=kernel_config or _GEMM)
    return out.reshape(*x_q.shape[:-1], banks[2].n)


def linear_q(x_q, x_scale, weight, scale=None, *, fmt, act_fmt, out_dtype,
             kernel_config: GemmConfig | None = None):
    """kernels.fused.reference.linear_q: y = dequant(x_q) @ dequant(W)^T on FP8-block (or MXFP4)
    weights; DeepGEMM's fp8_gemm_nt where importable and the scales are its 1x128 / 128x128
    recipe (V4 blocks), else cuBLAS's block-scaled FP8 GEMM (kernels/gemm/cublas_fp8.py: FP8-block
    weights reblocked once to 1x128 scales, >= cublas_min_rows rows, where its device check
    passed), else this Triton GEMM; kernel_config (GemmConfig) switches each off."""
    from megagraph.graph.interp import TORCH_DTYPES

    b = bank(weight, scale, fmt) if weight.dim() == 2 else None
    if not _q_ok(x_q, x_scale, act_fmt) or b is None or b.k != x_q.shape[-1]:
        return _fallback("linear_q")(x_q, x_scale, weight, scale, fmt=fmt, act_fmt=act_fmt,
                                     out_dtype=out_dtype)
    xq, xs = _flat(x_q), _flat(x_scale)
    odt = TORCH_DTYPES[out_dtype]
    g = kernel_config or _GEMM
    y = _deepgemm_linear(xq, xs, weight, scale, b, odt) if g.deepgemm else None
    if y is None and b.wfmt == 1 and not INTERPRET and xq.shape[0] >= g.cublas_min_rows:
        from megagraph.kernels.gemm import cublas_fp8

        y = cublas_fp8.linear(xq, xs, [(weight, scale)], odt, cfg=g)
    if y is None:
        y = torch.empty(xq.shape[0], b.n, dtype=odt, device=x_q.device)
        if xq.shape[0]:
            gemm(xq, xs, b, y, role="dense", rows_per_group=xq.shape[0], m=xq.shape[0], kc=g)
    return y.reshape(*x_q.shape[:-1], b.n)


def grouped_linear_q(x_q, x_scale, weight, scale=None, *, groups, fmt, act_fmt, out_dtype,
                     kernel_config: GemmConfig | None = None):
    """kernels.fused.reference.grouped_linear_q (block-diagonal): one batched launch, program
    axis 1 = group."""
    from megagraph.graph.interp import TORCH_DTYPES

    b = bank(weight, scale, fmt) if weight.dim() == 2 else None
    ok = (_q_ok(x_q, x_scale, act_fmt) and b is not None and x_q.dim() == 2
          and b.n % groups == 0 and x_q.shape[1] == groups * b.k and b.k % 128 == 0)
    if ok and b.wfmt == 1:
        ok = (b.n // groups) % b.bn == 0
    if not ok:
        return _fallback("grouped_linear_q")(x_q, x_scale, weight, scale, groups=groups, fmt=fmt,
                                             act_fmt=act_fmt, out_dtype=out_dtype)
    T = x_q.shape[0]
    o = b.n // groups
    g = kernel_config or _GEMM
    y = torch.empty(T, b.n, dtype=TORCH_DTYPES[out_dtype], device=x_q.device)
    if T == 0:
        return y
    if (b.wfmt == 1 and not INTERPRET and T >= g.cublas_grouped_min_rows
            and _cublas_groups(x_q, x_scale, weight, scale, groups, b, y, g)):
        return y
    # the weight as G groups of [o, K]: views with a group stride
    ws = b.w.shape[-1]
    wg = Bank(b.w.reshape(groups, o, ws), b.s.reshape(groups, -1, b.s.shape[-1]), b.wfmt, b.bn,
              b.bk, o, b.k)
    gemm(x_q, x_scale, wg, y, role="dense", rows_per_group=T, m=T, batched=True,
         a_group_stride=b.k, as_group_stride=b.k // 128, c_group_stride=o, kc=g)
    return y


def _cublas_groups(x_q: Tensor, x_scale: Tensor, weight: Tensor, scale: Tensor, groups: int,
                   b: Bank, y: Tensor, cfg: GemmConfig) -> bool:
    """grouped_linear_q as one cuBLAS block-scaled GEMM per group (kernels/gemm/cublas_fp8.py; each
    group's rows of the weight are their own cached reblocked weight): True when every group
    ran, False (y untouched) where the first group's weight does not take cuBLAS. Above
    cfg.cublas_grouped_min_rows only: at decode sizes G launches cost more than the one batched
    Triton launch."""
    from megagraph.kernels.gemm import cublas_fp8

    o, k = b.n // groups, b.k
    so = o // b.bn
    for g in range(groups):
        xg = x_q[:, g * k:(g + 1) * k].contiguous()
        sg = x_scale[:, g * k // 128:(g + 1) * k // 128]
        yg = cublas_fp8.linear(xg, sg, [(weight[g * o:(g + 1) * o], scale[g * so:(g + 1) * so])],
                               y.dtype, cfg=cfg)
        if yg is None:
            if g == 0:
                return False
            raise RuntimeError("cublas_fp8: group 0 of a grouped weight took cuBLAS, group "
                               f"{g} did not")
        y[:, g * o:(g + 1) * o] = yg
    return True


@functools.cache
def _deep_gemm():
    try:
        import deep_gemm
    except ImportError:
        return None
    return deep_gemm


def _deepgemm_linear(xq, xs, weight, scale, b: Bank, odt) -> Tensor | None:
    """DeepGEMM's sm90 FP8 GEMM when importable and the weight scales are 128x128 blocks (its
    1d2d recipe; V4.1's 32x32 blocks do not fit it): optional, never required."""
    if b.wfmt != 1 or (b.bn, b.bk) != (128, 128) or odt != torch.bfloat16 or INTERPRET:
        return None
    deep_gemm = _deep_gemm()
    if deep_gemm is None:
        return None
    try:
        from megagraph.kernels import formats

        y = torch.empty(xq.shape[0], b.n, dtype=torch.bfloat16, device=xq.device)
        deep_gemm.fp8_gemm_nt((xq, xs), (weight, formats.e8m0_to_f32(scale)), y)
        return y
    except Exception:  # noqa: BLE001  (an API / layout mismatch: the Triton GEMM runs)
        return None


def route(x, gate_w, bias=None, *, topk, route_scale, norm_topk=True, score_func="sqrtsoftplus",
          kernel_config: MoeConfig | None = None):
    """kernels.moe.reference.route: (ids i64 [T, k], weights f32 [T, k])."""
    if not (available() and on_device(x) and x.dim() == 2 and score_func in SCORES):
        from megagraph.kernels.moe.capturable import route as fallback

        return fallback(x, gate_w, bias, topk=topk, route_scale=route_scale,
                        norm_topk=norm_topk, score_func=score_func)
    return route_ids(x, gate_w, bias, topk=topk, route_scale=route_scale, norm_topk=norm_topk,
                     score_func=score_func, ids64=True, cfg=kernel_config)


def mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3, w3_scale,
             w2, w2_scale, sw1=None, sw1_scale=None, sw3=None, sw3_scale=None, sw2=None,
             sw2_scale=None, tid2eid=None, token_ids=None, *, topk, route_scale, norm_topk=True,
             score_func="sqrtsoftplus", fmt="dense", shared_fmt="dense", swiglu_limit=0.0,
             act_fmt, kernel_config: MoeConfig | None = None,
             gemm_config: GemmConfig | None = None):
    """kernels.fused.reference.mega_moe: route -> routed experts + shared expert -> combine ->
    hc_expand, in 9 launches (module doc). DeepGEMM's MegaMoE runs the routed experts instead
    where kernels/moe/deepgemm_mega.py takes the call (sm_100, opt-in; it returns None
    otherwise). kernel_config: the MoE choices; gemm_config: the shared expert's cuBLAS
    choices (None: GemmConfig's defaults)."""
    from megagraph.kernels.moe import deepgemm_mega

    cfg = kernel_config or _MOE
    y = deepgemm_mega.mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1,
                               w1_scale, w3, w3_scale, w2, w2_scale, sw1, sw1_scale, sw3,
                               sw3_scale, sw2, sw2_scale, tid2eid, token_ids, topk=topk,
                               route_scale=route_scale, norm_topk=norm_topk,
                               score_func=score_func, fmt=fmt, shared_fmt=shared_fmt,
                               swiglu_limit=swiglu_limit, act_fmt=act_fmt, kernel_config=cfg)
    if y is not None:
        return y
    banks = [bank(w, s, fmt) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    shared = sw1 is not None
    sbanks = ([bank(w, s, shared_fmt) for w, s in ((sw1, sw1_scale), (sw3, sw3_scale),
                                                    (sw2, sw2_scale))] if shared else [])
    ok = (_q_ok(x_q, x_scale, act_fmt) and None not in banks and None not in sbanks
          and x.dim() == 2 and streams.dim() == 3 and x.dtype in RDT and streams.dtype in RDT
          and score_func in SCORES and banks[0].k == x.shape[1]
          and (not shared or sbanks[0].groups == 1))
    if not ok:
        return _mega_moe_fallback(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1,
                                  w1_scale, w3, w3_scale, w2, w2_scale, sw1, sw1_scale, sw3,
                                  sw3_scale, sw2, sw2_scale, tid2eid, token_ids, topk=topk,
                                  route_scale=route_scale, norm_topk=norm_topk,
                                  score_func=score_func, fmt=fmt, shared_fmt=shared_fmt,
                                  swiglu_limit=swiglu_limit, act_fmt=act_fmt)
    T, d = x.shape
    E = banks[0].groups
    dev = x.device
    out = torch.empty(streams.shape, dtype=streams.dtype, device=dev)
    if T == 0:
        return out
    gcfg = gemm_config or _GEMM
    # the shared expert on the side stream while the router runs (cfg.shared_early)
    early = cfg.shared_early and T <= cfg.shared_early_max_tokens
    side = _side_stream(dev) if shared and early and not INTERPRET else None
    if side is not None:  # it needs x_q only
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
    s_out = None  # the shared expert's own output tensor (FP8 H on cuBLAS)
    if shared and _shared_fp8_h_may(x_q, T * topk / max(1, min(E, T * topk)), cfg):
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            s_out = shared_expert_fp8h(x_q, x_scale, *sbanks, swiglu_limit=swiglu_limit,
                                       out_dtype=_ydtype(x.dtype), gemm_cfg=gcfg)
        if side is not None and s_out is not None:
            s_out.record_stream(main)  # made on the side stream, read and freed on main
    ks = topk + int(shared and s_out is None)
    y = torch.empty(T, ks, d, dtype=_ydtype(x.dtype), device=dev)
    if side is not None and s_out is None:
        with torch.cuda.stream(side):
            shared_expert(x_q, x_scale, *sbanks, y[:, topk], swiglu_limit=swiglu_limit,
                          cfg=cfg, gemm_cfg=gcfg)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    ids, wts = route_ids(x, gate_w, gate_bias, topk=topk, route_scale=route_scale,
                         norm_topk=norm_topk, score_func=score_func, tid2eid=tid2eid,
                         token_ids=token_ids, counts=counts, cfg=cfg)
    if side is not None:
        main.wait_stream(side)  # joined before the routed experts, whose grids want every SM
    routed_experts(x_q, x_scale, ids, wts, counts, *banks, y, topk=topk,
                   swiglu_limit=swiglu_limit, cfg=cfg)
    if shared and side is None and s_out is None:
        shared_expert(x_q, x_scale, *sbanks, y[:, topk], swiglu_limit=swiglu_limit, cfg=cfg,
                      gemm_cfg=gcfg)
    sc = streams if streams.stride(-1) == 1 else streams.contiguous()
    return combine(y, out, topk=topk, shared=shared, rdt=x.dtype, streams=sc,
                   post=post.float().contiguous(), comb=comb.float().contiguous(),
                   shared_out=s_out)


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(dev: torch.device) -> torch.cuda.Stream | None:
    """One side stream per device for the shared expert while the router runs (captured into
    CUDA graphs as a fork / join: the graph then runs it as a parallel branch). Why: the gate
    GEMM, top-k and permutation are small launches that leave SMs idle (64 tokens on the H200:
    the layer 1.626 -> 1.607 ms); joined before the routed experts, whose grids want every SM."""
    if dev.type != "cuda":
        return None
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def _mega_moe_fallback(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3,
                       w3_scale, w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale,
                       tid2eid, token_ids, **attrs):
    if tid2eid is None:
        return _fallback("mega_moe")(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1,
                                     w1_scale, w3, w3_scale, w2, w2_scale, sw1, sw1_scale, sw3,
                                     sw3_scale, sw2, sw2_scale, **attrs)
    from megagraph.kernels.fused.reference import mega_moe as reference

    return reference(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3,
                     w3_scale, w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale,
                     tid2eid, token_ids, **attrs)


for _f in (moe_experts_q, swiglu_mlp_q, linear_q, grouped_linear_q, route, mega_moe):
    _f.capturable = True

__all__ = ["Tile", "available", "bank", "combine", "gemm",
           "grouped_linear_q", "linear_q", "mega_moe", "moe_experts_q", "num_sms", "on_device",
           "permute", "pick_tile", "route", "route_ids", "routed_experts", "shared_expert",
           "swiglu_mlp_q", "tile_list"]
