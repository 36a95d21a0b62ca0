"""FP8 block-scaled dense GEMMs on cuBLAS (torch ``scaled_mm``, Hopper): the issue's
"`torch._scaled_mm` where it fits" for the attention projections and the shared expert.

Why: the Triton FP8-block GEMM (kernels/moe/triton.py, role "dense") ran at 17-18% of the FP8
peak at 8192 rows and 5-29% of the copy bandwidth at 64 rows on the H200
(benchmarks/results/kernels-moe-h200.md), while cuBLAS's per-tensor FP8 GEMM at the same shapes
was 3-6x faster. Since CUDA 12.9 cuBLAS also takes DeepSeek's block scales on sm_90: activation
scales per (row, 128 columns) and weight scales per (row, 128 columns) or per 128 x 128 block,
fp32, through ``torch.nn.functional.scaled_mm`` (ScalingType.BlockWise1x128 / BlockWise128x128).

The weights do not always fit that recipe as they are: V4.1-Flash's dense FP8 weights carry one
E8M0 scale per 32 x 32 block (V4-Flash: 128 x 128). ``reblock`` rewrites a weight once into one
scale per (row, 128 columns) - the largest of the 4 (or 1) sub-block scales it covers - and
re-rounds the elements of the smaller sub-blocks to E4M3 at that scale. That is exact for
128-column blocks and for every element whose shifted value stays a normal E4M3 number; the
others round to the E4M3 subnormal grid, an absolute error of at most 2^-10 * 2^emax (half a
subnormal step at the new scale; ``REBLOCK_ABS_ERR``), against the 2^-4 relative rounding every
FP8 weight element already carries. The rewritten weight is cached per source tensor (``prepare``:
once, at warm-up - never inside a CUDA-graph capture, where a miss falls back to the caller's
kernel), so the model's weights stay the reference the graph describes. Cost: one reblocked
copy of every dense FP8 weight that is not exact as it is (V4.1: ~160 MB per layer); none for
128 x 128 source blocks (the scales only expand per row).

Every form of the call is checked against fp32 math on the device once (``supported``), as the
Triton kernels' PTX paths are; anything it does not accept keeps the Triton GEMM.
"""
from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from megagraph.kernels.gemm.config import GemmConfig

log = logging.getLogger(__name__)

ACT_BLOCK = 128
# |reblocked - original| per element, in units of the element's new scale 2^emax: half the E4M3
# subnormal step 2^-9 (elements that stay normal are exact: a power-of-two shift)
REBLOCK_ABS_ERR = 2.0 ** -10
# the call forms (torch's scaled_mm takes the weight's block scales either per (row, 128 columns)
# or per 128 x 128 block on sm_90); supported() takes the first one the device accepts,
# GemmConfig.cublas_form first. Measured on the H200
# (benchmarks/results/scaled-mm-probe-h200.md): 1x128 is 1.5-2x faster at <= 64 rows (decode),
# 128x128 20-25% faster at >= 1024 rows; both 4-5x faster than the Triton GEMM at 8192 rows.
# 1x128 is the default: decode-bound serving, and it re-rounds fewer elements (one row's blocks).
FORMS = ("1x128", "128x128")
# The recipe for prefill-sized calls of callers that ask for it (GemmConfig.prefill_form: the
# shared expert's two GEMMs at >= cublas_prefill_rows rows, where the same probe measured
# 128x128 20-25% faster: 380 -> 307 us and 206 -> 166 us at 8192 rows). Its cost: a second
# reblocked copy of those weights (V4.1's 32 x 32 blocks re-rounded per 128 x 128 block, the same
# error bound as 1x128's; ~31 MB a layer for the shared expert).
# the device check's bound on |cuBLAS fp32 output - fp32 math| / |fp32 math|: Hopper's FP8 MMA
# accumulates each 128-column block at reduced precision before the fp32 promotion (2.0e-4
# measured on the H200 at K 512-8192), far below a bf16 output's own rounding (~2e-3 on these
# norms) and far below what a wrong scale layout gives (O(1))
CHECK_REL = 2e-3


@dataclass(frozen=True)
class CublasWeight:
    """A dense FP8 weight as the cuBLAS call takes it: e4m3 ``w`` [N, K] (the source, or its
    reblocked copy) and fp32 scales ``s`` (form "1x128": [N, K/128] outer-dim-major; "128x128":
    [ceil(K/128) padded to 4, N/128] as scaled_mm wants them); ``exact``: no element re-rounded."""

    w: Tensor
    s: Tensor
    form: str
    exact: bool

    @property
    def n(self) -> int:
        return self.w.shape[0]


def _exponents(scale: Tensor) -> Tensor:
    """E8M0 scales (float8_e8m0fnu or uint8 biased exponents) -> int32 unbiased exponents."""
    return scale.view(torch.uint8).to(torch.int32) - 127


def reblock(weight: Tensor, scale: Tensor, form: str = "1x128") -> tuple[Tensor, Tensor, bool]:
    """(w' e4m3 [N, K], scales fp32, exact) for the cuBLAS recipe ``form`` from an FP8 weight
    [N, K] with E8M0 block scales [ceil(N/bn), K/bk] (bk divides 128, K % 128 == 0).

    "1x128": one scale per (row, 128 columns) = the largest sub-block scale there; elements of
    smaller sub-blocks are re-rounded (RNE) at it (module doc: exact unless they fall below the
    normal range; error <= REBLOCK_ABS_ERR * 2^emax). Scales [N, K/128], outer-dim-major.
    "128x128": one per 128 x 128 block (the same rule over the block's rows too); only for
    weights whose N is a multiple of 128; scales transposed to [K/128 (padded to 4), N/128]."""
    from megagraph.kernels import formats

    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"reblock: expected a 2-D float8_e4m3fn weight, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if K % ACT_BLOCK:
        raise ValueError(f"reblock: K = {K} is not a multiple of {ACT_BLOCK}")
    bn, bk = formats.infer_block_size((N, K), tuple(scale.shape))
    if ACT_BLOCK % bk:
        raise ValueError(f"reblock: weight blocks of {bk} columns do not tile {ACT_BLOCK}")
    if form not in FORMS:
        raise ValueError(f"reblock: unknown form {form!r} (one of {FORMS})")
    if form == "128x128" and (N % 128 or bn > 128 or 128 % bn):
        raise ValueError(f"reblock: 128x128 needs N % 128 == 0 and row blocks tiling 128 "
                         f"(N = {N}, bn = {bn})")
    e = _exponents(scale)  # [ceil(N/bn), K/bk]
    kb = K // ACT_BLOCK
    e_rows = e.repeat_interleave(bn, 0)[:N]  # [N, K/bk]
    e_blk = e_rows.view(N, kb, ACT_BLOCK // bk).amax(dim=2)  # [N, K/128]
    if form == "128x128":
        e_blk = e_blk.view(N // 128, 128, kb).amax(dim=1)  # [N/128, K/128]
        e_new = e_blk.repeat_interleave(128, 0)
    else:
        e_new = e_blk
    shift = e_rows - e_new.repeat_interleave(ACT_BLOCK // bk, 1)  # [N, K/bk], <= 0
    exact = bool((shift == 0).all())
    if exact:
        w2 = weight
    else:  # power-of-two shifts: exact in fp32, one RNE rounding to e4m3 (no saturation)
        w2 = torch.empty_like(weight)
        step = max(1, (1 << 24) // K)  # rows per chunk: bounded fp32 temporaries
        for r in range(0, N, step):
            f = torch.exp2(shift[r:r + step].float()).repeat_interleave(bk, 1)
            w2[r:r + step] = (weight[r:r + step].float() * f).to(torch.float8_e4m3fn)
    s = torch.exp2(e_blk.float())
    if form == "1x128":
        s = s.t().contiguous().t()  # [N, K/128] with stride (1, N): outer-dim-major
    else:
        pad = -kb % 4
        s = torch.nn.functional.pad(s, (0, pad)).t()  # [K/128 + pad, N/128] view
    return w2, s, exact


def dequant_reblocked(w: Tensor, s: Tensor, form: str) -> Tensor:
    """fp32 [N, K] of a reblocked weight (the math the cuBLAS call must reproduce)."""
    N, K = w.shape
    kb = K // ACT_BLOCK
    if form == "1x128":
        per = s
    else:
        per = s.t()[:, :kb].repeat_interleave(128, 0)[:N]
    return w.float() * per.repeat_interleave(ACT_BLOCK, 1)


# ---------------------------------------------------------------------------------------------
# the device check and the call
# ---------------------------------------------------------------------------------------------


def _act_scales(x_scale: Tensor) -> Tensor:
    """[M, K/128] fp32 activation scales, outer-dim-major (stride (1, M)) as cuBLAS reads them."""
    return x_scale if x_scale.stride(0) == 1 else x_scale.t().contiguous().t()


def matmul(x_q: Tensor, x_scale: Tensor, cw: CublasWeight, out_dtype: torch.dtype) -> Tensor:
    """y [M, N] = dequant(x_q, x_scale) @ dequant(cw)^T on cuBLAS; M % 4 rows are padded with
    zeros (cuBLAS wants the activation scales in rows of 4)."""
    F = torch.nn.functional
    M = x_q.shape[0]
    pad = -M % 4
    if pad:
        x_q = F.pad(x_q.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        x_scale = F.pad(x_scale, (0, 0, 0, pad), value=1.0)
    recipe_b = (F.ScalingType.BlockWise1x128 if cw.form == "1x128"
                else F.ScalingType.BlockWise128x128)
    y = F.scaled_mm(x_q, cw.w.t(), _act_scales(x_scale), F.ScalingType.BlockWise1x128, cw.s,
                    recipe_b, output_dtype=out_dtype)
    return y[:M] if pad else y


@functools.cache
def supported(index: int, first: str = "1x128") -> str | None:
    """The first form of FORMS whose cuBLAS call matches fp32 math on CUDA device ``index``
    (form_ok), `first` (GemmConfig.cublas_form) first, or None; cached per device."""
    for form in sorted(FORMS, key=lambda f: f != first):
        if form_ok(index, form):
            return form
    return None


@functools.cache
def form_ok(index: int, form: str) -> bool:
    """Whether cuBLAS's call in this form matches fp32 math on CUDA device ``index`` (odd
    sub-block scales, 6 rows: the padding path); cached per device and form."""
    if not torch.cuda.is_available() or form not in FORMS:
        return False
    F = torch.nn.functional
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return False
    from megagraph.kernels import formats
    from megagraph.kernels.fused import reference as rf

    dev = torch.device("cuda", index)
    g = torch.Generator(device=dev).manual_seed(7)
    M, N, K = 6, 256, 512
    x = torch.randn(M, K, device=dev, generator=g)
    w = torch.randn(N, K, device=dev, generator=g)
    w = w * torch.exp2(torch.randint(-3, 3, (N // 32, K // 32), device=dev, generator=g)
                       .float()).repeat_interleave(32, 0).repeat_interleave(32, 1)
    wq, ws = formats.quantize_fp8_block(w, 32)
    xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
    xf = rf.dequant_act(xq, xs, act_fmt="fp8_1x128")
    try:
        w2, s2, exact = reblock(wq, ws, form)
        want = xf @ dequant_reblocked(w2, s2, form).t()
        got = matmul(xq, xs, CublasWeight(w2, s2, form, exact), torch.float32)
        torch.cuda.synchronize(dev)
        err = float((got - want).norm() / want.norm())
    except Exception as e:  # noqa: BLE001  (a form this torch / cuBLAS rejects)
        log.info("cublas_fp8: form %s rejected on cuda:%d: %s", form, index, e)
        return False
    if err < CHECK_REL:
        return True
    log.warning("cublas_fp8: form %s gives rel. err %.2e on cuda:%d; not used", form, err,
                index)
    return False


# ---------------------------------------------------------------------------------------------
# the per-weight cache
# ---------------------------------------------------------------------------------------------

_CACHE: dict[tuple, tuple] = {}
_LOCK = threading.Lock()


def _root(t: Tensor) -> Tensor:
    """The tensor a view was made from (moe.bank's [1, N, K] views are new objects per call; the
    parameter they view is what lives as long as the model)."""
    return t if t._base is None else t._base


def _key(weight: Tensor, scale: Tensor) -> tuple:
    return (weight.data_ptr(), weight._version, tuple(weight.shape), scale.data_ptr(),
            scale._version, tuple(scale.shape))


def _stack(parts: list[tuple[Tensor, Tensor, bool]], form: str) -> tuple[Tensor, Tensor, bool]:
    """Reblocked weights stacked along N: one GEMM for [W1; W3]."""
    if len(parts) == 1:
        return parts[0]
    w = torch.cat([p[0] for p in parts], 0)
    if form == "1x128":
        s = torch.cat([p[1] for p in parts], 0).t().contiguous().t()
    else:
        s = torch.cat([p[1].t() for p in parts], 0).t()
    return w, s, all(p[2] for p in parts)


def derived(pairs: tuple[tuple[Tensor, Tensor], ...], tag: str, build):
    """The cached build(pairs) of CUDA weights (weight, scale) for this tag: built once, outside
    any CUDA-graph capture (None there on a miss: the caller's kernel runs, since a build captured
    into a graph would re-run at every replay), completed on the device before it is returned
    (any stream may read it: mega_moe runs the shared expert on a side stream). An entry lives as
    long as its weights (weak references) and is rebuilt after an in-place change (the version
    counter). build may return None (does not apply: not cached)."""
    ws = [w for w, _ in pairs]
    key = (tag,) + tuple(_key(w, sc) for w, sc in pairs)
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None and all(r() is _root(w) for r, w in zip(hit[0], ws)):
        return hit[1]
    if torch.cuda.is_current_stream_capturing():
        log.warning("cublas_fp8: weight %s first used inside a CUDA-graph capture; the Triton "
                    "GEMM runs (warm up before capturing)", tuple(ws[0].shape))
        return None
    out = build(pairs)
    if out is None:
        return None
    torch.cuda.current_stream(ws[0].device).synchronize()
    refs = tuple(weakref.ref(_root(w), lambda _r, k=key: _CACHE.pop(k, None)) for w in ws)
    with _LOCK:
        _CACHE[key] = (refs, out)
    return out


def prepare(*pairs: tuple[Tensor, Tensor], form: str | None = None,
            first: str = "1x128") -> CublasWeight | None:
    """The cached CublasWeight of one or more (weight, scale) pairs stacked along N (reblocked on
    first use, derived()); None where the device check failed or the shapes do not fit. form:
    this recipe instead of the device's default (supported()) where the device takes it
    (form_ok) and the weights fit it (reblock; else the default: a recipe is a speed choice,
    both match the same fp32 math); each form is its own cached copy. first: supported()'s."""
    ws = [w for w, _ in pairs]
    if not ws or any(w.device.type != "cuda" or w.dim() != 2 for w in ws):
        return None
    if len({(w.device, w.shape[1]) for w in ws}) != 1:
        return None
    index = ws[0].device.index or 0
    default = supported(index, first)
    if form is None or not form_ok(index, form):
        form = default
    if form is None:
        return None

    def build(pairs):
        try:
            w2, s2, exact = _stack([reblock(w, sc, form) for w, sc in pairs], form)
        except ValueError:
            return None
        return CublasWeight(w2, s2, form, exact)

    cw = derived(tuple(pairs), form, build)
    return cw if cw is not None or form == default else prepare(*pairs, first=first)


def dense_bf16(weight: Tensor, scale: Tensor, cfg: GemmConfig | None = None) -> Tensor | None:
    """The cached bf16 [N, K] of an FP8-block weight (exact: an E4M3 value times a power of two
    is a bf16 number), for a GEMM whose other operand is not FP8 (the shared expert's W2 on its
    fp16 / bf16 H: cuBLAS's block-scaled GEMM takes FP8 operands only); None off CUDA or when
    GemmConfig.cublas_fp8 is off."""
    if not (cfg or GemmConfig()).cublas_fp8 or weight.device.type != "cuda" or weight.dim() != 2:
        return None
    from megagraph.kernels import formats

    return derived(((weight, scale),), "bf16",
                   lambda p: formats.dequantize_fp8_block(*p[0]).to(torch.bfloat16))


def linear(x_q: Tensor, x_scale: Tensor, pairs: list[tuple[Tensor, Tensor]],
           out_dtype: torch.dtype, form: str | None = None,
           cfg: GemmConfig | None = None) -> Tensor | None:
    """y = dequant(x_q) @ dequant([W_1; W_2; ...])^T on cuBLAS (pairs: (weight, E8M0 scale) of
    one or more FP8-block weights with the same K, stacked along N), or None (the caller's GEMM
    runs) where cfg.cublas_fp8 is off, the device check failed, the output dtype is not bf16 /
    fp32 or a weight does not reblock. form: prepare's (None: the device's default recipe)."""
    cfg = cfg or GemmConfig()
    if not cfg.cublas_fp8 or out_dtype not in (torch.bfloat16, torch.float32):
        return None
    if x_q.dtype != torch.float8_e4m3fn or x_scale.dtype != torch.float32 or x_q.dim() != 2:
        return None
    cw = prepare(*pairs, form=form, first=cfg.cublas_form)
    if cw is None:
        return None
    return matmul(x_q, x_scale, cw, out_dtype)
