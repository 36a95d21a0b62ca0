"""Triton MegaMoE / Mega-mHC / FP8-block GEMM kernels (kernels/moe/triton.py, mhc.py) against the
reference ops.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1: this module is run
by test_triton_interp.py in a child pytest), on small shapes: that covers the kernels' logic - tile scan, permutation, MMA
modes, scale folding, epilogues, combine, Sinkhorn - in every mode except the inline-PTX upcast,
whose bit logic is checked here by emulating the PTX. With CUDA the same tests run the compiled
kernels, plus the GPU-only checks (CUDA-graph capture, the PTX upcast).

Every output is checked against kernels.reference_table with fresh random inputs, under poisoned
allocations (every torch.empty of the call is filled with NaN / huge indices), so an element or
a workspace row the kernels read without writing it shows up as NaN or a crash.
Tolerances (relative Frobenius error; moe.py explains where the differences come from): fp32
outputs 2e-3 (fp16 SwiGLU output feeding the second GEMM), bf16 outputs 1e-2. These bounds are
fp16 H's: the calls pass FP16_H (MoeConfig with fp8_h_prefill off), since the default quantizes
H to E4M3 at prefill sizes on sm_90 (~3.4% relative); the FP8-H path has its own tests
(test_moe_gluon_l2_fp8.py, test_triton_moe_fp8h.py).
"""
from __future__ import annotations


import pytest
import torch

from cuda_capture import capture  # noqa: E402
from mhc_checks import check_mhc  # noqa: E402
from poisoned_alloc import poisoned  # noqa: E402

triton = pytest.importorskip("triton")

from megagraph.kernels import formats  # noqa: E402
from megagraph.kernels.fused import reference as rf  # noqa: E402
from megagraph.kernels.moe.reference import route as ref_route  # noqa: E402
from megagraph.kernels.mhc import triton as tmhc  # noqa: E402
from megagraph.kernels.moe import triton as tm  # noqa: E402
from megagraph.kernels.moe.config import MoeConfig  # noqa: E402
from megagraph.kernels.gemm.config import GemmConfig, Tile  # noqa: E402

# The interpreter must be chosen before triton is first imported (its own library functions are
# built then), which a shared pytest process cannot promise: without CUDA this module runs in a
# child pytest with TRITON_INTERPRET=1 (test_triton_interp.py) and is skipped here.
RUNNABLE = torch.cuda.is_available() or tm.INTERPRET
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")


DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"
ACT = "fp8_1x128"
# fp32-output GEMMs: the interpreter multiplies in fp32 (summation order only); on Hopper the FP8
# MMA accumulates each 128-column chunk with ~2^-14 relative precision before the fp32 promotion
TOL_GEMM = 1e-3 if GPU else 1e-5
TOL_COEF = 1e-4 if GPU else 1e-5  # mixer coefficients (approximate exp / rsqrt on the GPU)
FP16_H = MoeConfig(fp8_h_prefill=False)  # the fp16-H kernels these bounds are for


def pinned(cfg: MoeConfig = FP16_H, **tiles: Tile) -> MoeConfig:
    """cfg with the Triton tile of each role given (l1=Tile(...), ...): that role runs moe_gemm
    with that tile (MoeConfig.tiles)."""
    import dataclasses

    return dataclasses.replace(cfg, tiles=tuple(t.spec(r) for r, t in tiles.items()))


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(*shape, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def mxfp4(E, N, K, g, lo=119, hi=124):
    w = torch.randint(-128, 128, (E, N, K // 2), dtype=torch.int8, generator=g)
    s = torch.randint(lo, hi + 1, (E, N, K // 32), dtype=torch.uint8, generator=g)
    return w.to(DEV), s.view(torch.float8_e8m0fnu).to(DEV)


def fp8_block(N, K, g, block=32, scale=0.05):
    w, s = formats.quantize_fp8_block(torch.randn(N, K, generator=g) * scale, block)
    return w.to(DEV), s.to(DEV)


def finite(*ts):
    for t in ts:
        assert not torch.isnan(t.float()).any(), "unwritten (poisoned) elements in the output"


# ---------------------------------------------------------------------------------------------
# the E2M1 -> E4M3 upcast: arithmetic helper semantics and the PTX (emulated) bit logic
# ---------------------------------------------------------------------------------------------


def _e4m3_ref_byte(c: int, rel_: int) -> int:
    """What both upcasts must produce: E4M3 of e2m1(c) * 2^rel, zero when rel < -5."""
    m = c & 7
    base = (m * 4 + 0x30 if m >= 2 else m * 0x30) + rel_ * 8
    if m == 0 or rel_ < -5:
        base = 0
    return base | ((c & 8) << 4)


def test_e4m3_fold_is_exact():
    """The folded E4M3 byte decodes to exactly e2m1(c) * 2^rel for rel in [-5, 6]."""
    codes = torch.arange(16)
    e2 = formats.e2m1_to_f32(codes)
    for r in range(-5, 7):
        b = torch.tensor([_e4m3_ref_byte(int(c), r) for c in codes], dtype=torch.uint8)
        got = b.view(torch.float8_e4m3fn).float()
        assert torch.equal(got, e2 * 2.0 ** r), r


def _prmt(a, b, c):
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        sel = (c >> (4 * k)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _run_ptx(asm: str, operands: list[int]) -> tuple[int, int]:
    """Emulate the integer PTX subset of moe_jit.FP4_E4M3_ASM."""
    m32 = 0xFFFFFFFF
    regs = {f"${i}": v for i, v in enumerate(operands)}
    preds = {}

    def s32(v):
        v &= m32
        return v - (1 << 32) if v & 0x80000000 else v

    def val(x):
        return regs[x] & m32 if x in regs else int(x, 0) & m32

    for line in asm.strip().splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        a = [x.strip() for x in rest.split(",")]
        if op == "bfe.s32":
            v = (val(a[1]) >> int(a[2])) & ((1 << int(a[3])) - 1)
            regs[a[0]] = (v - (1 << int(a[3])) if v >> (int(a[3]) - 1) else v) & m32
        elif op == "setp.lt.s32":
            preds[a[0]] = s32(val(a[1])) < s32(val(a[2]))
        elif op == "mul.lo.s32":
            regs[a[0]] = (s32(val(a[1])) * s32(val(a[2]))) & m32
        elif op in ("add.s32", "add.u32"):
            regs[a[0]] = (val(a[1]) + val(a[2])) & m32
        elif op == "sub.u32":
            regs[a[0]] = (val(a[1]) - val(a[2])) & m32
        elif op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "not.b32":
            regs[a[0]] = ~val(a[1]) & m32
        elif op == "selp.b32":
            regs[a[0]] = val(a[1]) if preds[a[3]] else val(a[2])
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "or.b32":
            regs[a[0]] = val(a[1]) | val(a[2])
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2], 0)
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << int(a[2], 0)) & m32
        elif op == "prmt.b32":
            regs[a[0]] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        else:
            raise AssertionError(f"unknown PTX op {op}")
    return regs["$0"], regs["$1"]


def test_ptx_upcast_bit_logic():
    """The prmt-based PTX upcast (4 packed bytes -> low-nibble and high-nibble E4M3 bytes)
    equals the arithmetic helper for every byte value and offset, with an independent offset in
    each of the 4 byte lanes ($3 = rel + 6 per lane: a pack may span rows / scale groups - the
    H200 failure of the swapped tiles when one offset served the whole pack).
    The GPU tests check that it compiles and runs (moe.asm_ok's device check)."""
    from megagraph.kernels.moe import triton_jit as moe_jit

    asm = moe_jit.FP4_E4M3_ASM.value
    g = gen(0)
    for b0 in range(256):  # every byte value in lane 0, random bytes and offsets in the others
        for r0 in range(13):
            bs = [b0] + torch.randint(0, 256, (3,), generator=g).tolist()
            rs = [r0] + torch.randint(0, 13, (3,), generator=g).tolist()
            w = sum(b << (8 * i) for i, b in enumerate(bs))
            rw = sum(r << (8 * i) for i, r in enumerate(rs))
            lo, hi = _run_ptx(asm, [0, 0, w, rw])
            for i, (b, r) in enumerate(zip(bs, rs)):
                assert (lo >> 8 * i) & 0xFF == _e4m3_ref_byte(b & 0xF, r - 6), (b, r, i)
                assert (hi >> 8 * i) & 0xFF == _e4m3_ref_byte(b >> 4, r - 6), (b, r, i)


# ---------------------------------------------------------------------------------------------
# routed experts, shared expert, dense GEMMs
# ---------------------------------------------------------------------------------------------


def _experts(E, d, F, g, **kw):
    return (*mxfp4(E, F, d, g, **kw), *mxfp4(E, F, d, g, **kw), *mxfp4(E, d, F, g, **kw))


def routed_case(T, E, d, F, k, seed, subset=None, **kw):
    """(x_q, x_scale, ids, weights, W1/W3/W2 banks) of a routed-expert call: T random tokens
    quantized as the plan does, each routed to k experts drawn from `subset` (default: all E)."""
    g = gen(seed)
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    bank = _experts(E, d, F, g, **kw)
    pool = torch.tensor(subset) if subset else torch.arange(E)
    ids = pool[torch.randint(0, len(pool), (T, k), generator=g)].to(DEV)
    wts = torch.rand(T, k, generator=g).to(DEV)
    return xq, xs, ids, wts, bank


def check_routed(xq, xs, ids, wts, bank, kw, cfg: MoeConfig = FP16_H) -> torch.Tensor:
    """tm.moe_experts_q (kernel_config cfg) under poisoned allocations against the reference op:
    finite, same dtype and shape, relative error < 2e-3 for fp32 outputs (fp16 H feeding the
    second GEMM), 1e-2 for bf16 ones. Returns the kernel's output."""
    with poisoned():
        y = tm.moe_experts_q(xq, xs, ids, wts, *bank, **kw, kernel_config=cfg)
    ref = rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw)
    finite(y)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert rel(y, ref) < (_f32_bound(xq, ids, bank, cfg) if kw["out_dtype"] == "f32" else 1e-2)
    return y


def _f32_bound(xq, ids, bank, cfg: MoeConfig = FP16_H) -> float:
    """check_routed's bound for fp32 outputs: 2e-3 (fp16 H), 5e-3 where the prefill L1 runs on
    cuBLAS's grouped FP8 GEMM (moe_grouped_cublas), whose bf16 output rounds W1 x and W3 x
    before the SwiGLU: 2^-9 relative per element, ~1.5e-3 on the norm on top of fp16 H."""
    from megagraph.kernels.moe import grouped_cublas as mgc

    b1, b3 = tm.bank(bank[0], bank[1], "mxfp4"), tm.bank(bank[2], bank[3], "mxfp4")
    if b1 is None or b3 is None:
        return 2e-3
    h = torch.empty(0, b1.n, dtype=torch.float16, device=xq.device)
    rpg = ids.numel() / max(1, min(b1.groups, ids.numel()))
    cub = (cfg.cublas_prefill and "l1" not in cfg.tile_overrides()
           and mgc.applies(xq, b1, b3, h, rpg, cfg.cublas_l1_min_rows))
    return 5e-3 if cub else 2e-3


def check_dense_swiglu(seed: int, T: int, cfg: GemmConfig | None = None) -> None:
    """The dense SwiGLU MLP on MXFP4 weights (d 256, F 128, one expert's banks) for T tokens under
    poisoned allocations (kernel_config cfg), against the reference: finite, relative error
    < 2e-3 (fp32 output)."""
    g = gen(seed)
    d, F = 256, 128
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    w1, s1, w3, s3, w2, s2 = (t[0] for t in _experts(1, d, F, g))
    kw = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT, out_dtype="f32")
    with poisoned():
        y = tm.swiglu_mlp_q(xq, xs, w1, s1, w3, s3, w2, s2, **kw, kernel_config=cfg)
    ref = rf.swiglu_mlp_q(xq, xs, w1, s1, w3, s3, w2, s2, **kw)
    finite(y)
    assert rel(y, ref) < 2e-3


class LaunchSpy:
    """Stands in for a Triton kernel (e.g. moe_jit.moe_gemm): records the constexpr `key` of
    every launch (0 where the launch does not pass it) in `values`, then launches the kernel."""

    def __init__(self, real, key: str):
        self.real, self.key, self.values = real, key, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.values.append(kw.get(self.key, 0))
            return self.real[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("T,subset", [(1, None), (5, None), (17, (0, 2, 5))])
def test_moe_experts_q(T, subset):
    """Odd token counts; `subset`: only those experts picked, every other one empty."""
    xq, xs, ids, wts, bank = routed_case(T, 8, 256, 128, 3, seed=T, subset=subset)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                             out_dtype="f32"))


@pytest.mark.parametrize("spread", [0, 11, 14])
def test_mxfp4_scale_spread(spread):
    """Block scales of one row spanning `spread` binades within 128 columns: the E4M3 fold is
    exact up to 11; beyond, the lowest blocks flush (error < 2^-11 of the chunk's largest
    weight, far below the bound)."""
    check_scale_spread(100 + spread, 6, ((1, 120), (3, 120), (5, 120)), spread)


def check_scale_spread(seed: int, T: int, bases, spread: int, cfg: MoeConfig = FP16_H) -> None:
    """Routed experts (4 experts, d 256, F 128, top-2) whose scale banks `bases` ((bank index,
    base exponent) pairs: 1 = W1, 3 = W3, 5 = W2) hold exponents base - spread .. base inside
    every 128 columns, against the reference: relative error < 2e-3 (fp32 output)."""
    g = gen(seed)
    E, d, F, k = 4, 256, 128, 2
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    bank = list(_experts(E, d, F, g))
    for i, base in bases:
        s = torch.full(bank[i].shape, base, dtype=torch.uint8)
        s[..., 0::4] = base - spread
        bank[i] = s.view(torch.float8_e8m0fnu).to(DEV)
    ids = torch.randint(0, E, (T, k), generator=g).to(DEV)
    wts = torch.rand(T, k, generator=g).to(DEV)
    kw = dict(fmt="mxfp4", swiglu_limit=0.0, act_fmt=ACT, out_dtype="f32")
    y = tm.moe_experts_q(xq, xs, ids, wts, *bank, **kw, kernel_config=cfg)
    ref = rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw)
    assert rel(y, ref) < 2e-3


@pytest.mark.parametrize("par", [False, True])
def test_moe_tiles_interleaved_and_parity(par):
    """Both B layouts of the MXFP4 upcast (interleaved tile / K split by column parity) at a
    second tile shape."""
    tile = Tile(16, 16, 64, 4, 1, par=par) if not GPU else Tile(64, 64, 128, 4, 3, par=par)
    xq, xs, ids, wts, bank = routed_case(9, 4, 256, 128, 2, seed=31)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                             out_dtype="f32"), pinned(l1=tile, l2=tile))


def test_moe_exact_mode():
    """MoeConfig.exact: fully dequantized operands, fp32 H (bf16 / fp32 MMA): agrees to fp32
    summation order."""
    g = gen(7)
    E, d, F, k, T = 4, 256, 128, 2, 5
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    bank = _experts(E, d, F, g)
    ids = torch.randint(0, E, (T, k), generator=g).to(DEV)
    wts = torch.rand(T, k, generator=g).to(DEV)
    kw = dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT, out_dtype="f32")
    y = tm.moe_experts_q(xq, xs, ids, wts, *bank, **kw, kernel_config=MoeConfig(exact=True))
    ref = rf.moe_experts_q(xq, xs, ids, wts, *bank, **kw)
    assert rel(y, ref) < (1e-3 if GPU else 1e-5)


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("T", [1, 9, 40])
def test_swiglu_mlp_q_fp8_block(block, T):
    g = gen(block + T)
    d, F = 256, 256
    x = randn(T, d, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    ws = (*fp8_block(F, d, g, block), *fp8_block(F, d, g, block), *fp8_block(d, F, g, block))
    kw = dict(fmt="fp8_block", swiglu_limit=10.0, act_fmt=ACT, out_dtype="bf16")
    with poisoned():
        y = tm.swiglu_mlp_q(xq, xs, *ws, **kw)
    ref = rf.swiglu_mlp_q(xq, xs, *ws, **kw)
    finite(y)
    assert y.dtype == torch.bfloat16 and rel(y, ref) < 1e-2


@pytest.mark.parametrize("T", [3, 20])
@pytest.mark.parametrize("fmt,block", [("fp8_block", 32), ("fp8_block", 128), ("mxfp4", 32)])
def test_linear_q(fmt, block, T):
    """2 T rows (decode-size tiles at 6, the 64-row tile at 40)."""
    g = gen(block)
    K, N = 384, 96
    x = randn(2, T, K, g=g)  # leading dims are flattened
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    if fmt == "mxfp4":
        w, s = mxfp4(1, N, K, g)
        w, s = w[0], s[0]
    else:
        w, s = fp8_block(N, K, g, block)
    with poisoned():
        y = tm.linear_q(xq, xs, w, s, fmt=fmt, act_fmt=ACT, out_dtype="f32")
    ref = rf.linear_q(xq, xs, w, s, fmt=fmt, act_fmt=ACT, out_dtype="f32")
    finite(y)
    assert y.shape == ref.shape and rel(y, ref) < TOL_GEMM


def test_grouped_linear_q():
    g = gen(3)
    T, G, I, O = 5, 4, 128, 64
    x = randn(T, G * I, g=g)
    xq, xs = rf.quantize_act(x, act_fmt=ACT)
    w, s = fp8_block(G * O, I, g, 32)
    with poisoned():
        y = tm.grouped_linear_q(xq, xs, w, s, groups=G, fmt="fp8_block", act_fmt=ACT,
                                out_dtype="f32")
    ref = rf.grouped_linear_q(xq, xs, w, s, groups=G, fmt="fp8_block", act_fmt=ACT,
                              out_dtype="f32")
    finite(y)
    assert rel(y, ref) < TOL_GEMM


# ---------------------------------------------------------------------------------------------
# router, MegaMoE
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_route(score_func, with_bias):
    g = gen(11)
    T, d, E, k = 13, 128, 24, 6
    x = randn(T, d, g=g, dtype=torch.bfloat16)
    gw = randn(E, d, g=g, scale=0.1, dtype=torch.bfloat16)
    bias = randn(E, g=g, scale=0.1) if with_bias else None
    kw = dict(topk=k, route_scale=1.5, norm_topk=True, score_func=score_func)
    with poisoned():
        ids, w = tm.route(x, gw, bias, **kw)
    rids, rw = ref_route(x, gw, bias, **kw)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), rids.cpu())
    assert rel(w, rw) < TOL_COEF


def _mhc_inputs(T, n, d, g, dtype=torch.bfloat16):
    streams = randn(T, n, d, g=g, dtype=dtype)
    fn = randn((2 + n) * n, n * d, g=g, scale=0.02)
    base = randn((2 + n) * n, g=g, scale=0.1)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    nw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEV)
    return streams, fn, base, scale, nw


def _moe_weights(E, d, F, g, shared_block=32):
    gate = randn(E, d, g=g, scale=0.05, dtype=torch.bfloat16)
    bias = randn(E, g=g, scale=0.1)
    routed = _experts(E, d, F, g)
    shared = (*fp8_block(F, d, g, shared_block), *fp8_block(F, d, g, shared_block),
              *fp8_block(d, F, g, shared_block))
    return gate, bias, routed, shared


MOE_KW = dict(route_scale=1.5, norm_topk=True, score_func="sqrtsoftplus", fmt="mxfp4",
              shared_fmt="fp8_block", swiglu_limit=10.0, act_fmt=ACT)


@pytest.mark.parametrize("T,with_shared,hashed", [(1, True, False), (7, True, False),
                                                  (6, False, False), (5, True, True)])
def test_mega_moe(T, with_shared, hashed):
    g = gen(20 + T)
    n, d, F, E, k = 4, 256, 128, 8, 3
    streams, fn, base, scale, nw = _mhc_inputs(T, n, d, g)
    x, xq, xs, pre, post, comb = rf.mega_mhc(streams, fn, base, scale, None, nw, eps=1e-20,
                                             hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20,
                                             act_fmt=ACT)
    gate, bias, routed, shared = _moe_weights(E, d, F, g)
    shared = shared if with_shared else (None,) * 6
    extra = ()
    if hashed:
        tid2eid = torch.randint(0, E, (50, k), generator=g).to(DEV)
        token_ids = torch.randint(0, 50, (T,), generator=g).to(DEV)
        extra, bias = (tid2eid, token_ids), None
    args = (x, xq, xs, streams, post, comb, gate, bias, *routed, *shared, *extra)
    with poisoned():
        out = tm.mega_moe(*args, topk=k, **MOE_KW, kernel_config=FP16_H)
    ref = rf.mega_moe(*args, topk=k, **MOE_KW)
    finite(out)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel(out, ref) < 1e-2


def test_mega_moe_fallbacks():
    """Inputs the kernels do not take (here mxfp8 activations) run the capturable kernels."""
    g = gen(5)
    T, n, d, F, E, k = 3, 4, 256, 128, 8, 2
    streams, fn, base, scale, nw = _mhc_inputs(T, n, d, g)
    x, xq, xs, pre, post, comb = rf.mega_mhc(streams, fn, base, scale, None, nw, eps=1e-20,
                                             hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20,
                                             act_fmt="mxfp8")
    gate, bias, routed, shared = _moe_weights(E, d, F, g)
    kw = {**MOE_KW, "act_fmt": "mxfp8"}
    args = (x, xq, xs, streams, post, comb, gate, bias, *routed, *shared)
    out = tm.mega_moe(*args, topk=k, **kw)
    ref = rf.mega_moe(*args, topk=k, **kw)
    assert rel(out, ref) < 1e-2


# ---------------------------------------------------------------------------------------------
# Mega-mHC
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,dtype,act_fmt,with_mix", [
    (3, torch.bfloat16, "fp8_1x128", False),   # split-K projection (atomics)
    (40, torch.bfloat16, "fp8_1x128", True),   # one program per 16 tokens
    (5, torch.float32, "mxfp8", True),
])
def test_mega_mhc(T, dtype, act_fmt, with_mix):
    g = gen(T)
    n, d = 4, 256
    streams, fn, base, scale, nw = _mhc_inputs(T, n, d, g, dtype)
    mix = torch.softmax(torch.randn(T, n, generator=g), -1).to(DEV) if with_mix else None
    kw = dict(eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20, act_fmt=act_fmt)
    with poisoned():
        out = tmhc.mega_mhc(streams, fn, base, scale, mix, nw, **kw)
    ref = rf.mega_mhc(streams, fn, base, scale, mix, nw, **kw)
    finite(*out)
    check_mhc(out, ref, act_fmt)


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def test_registry_h200_picks_triton(monkeypatch):
    """Validated on an H200 (kernels/registry.py status "available"): the h200 profile gets them
    without opting in."""
    from megagraph.kernels import registry
    from megagraph.passes.hw import load_hw_profile as load_profile

    hw = load_profile("h200")
    for op, attrs, name in (("mega_moe", {}, "triton.mega_moe"),
                            ("mega_mhc", {}, "triton.mega_mhc"),
                            ("moe_experts_q", {"act_fmt": ACT}, "triton.moe_fp8_mxfp4"),
                            ("swiglu_mlp_q", {"act_fmt": ACT}, "triton.swiglu_fp8_block"),
                            ("linear_q", {"act_fmt": ACT}, "triton.fp8_block_gemm"),
                            ("grouped_linear_q", {"act_fmt": ACT}, "triton.grouped_fp8_gemm")):
        impl, why = registry.choose_kernel(op, attrs, hw.capabilities, hw.arch)
        assert impl == name, (op, why)
        fn = registry.load_impl(impl, op)
        assert fn is not None and getattr(fn, "capturable", False), op
    cpu = load_profile("cpu")
    assert registry.choose_kernel("mega_moe", {}, cpu.capabilities, cpu.arch)[0] == "reference"


# ---------------------------------------------------------------------------------------------
# GPU only: CUDA-graph capture, the PTX upcast, decode/prefill tiles
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_ptx_upcast_device_check():
    """The one-time device check of the PTX upcast (both paths, every byte and offset, bit for
    bit). False only disables the fast path; the result is what the kernels use by default."""
    tm._ASM_CHECKED.clear()
    ok = tm.asm_ok(torch.device(DEV))
    if not ok:
        pytest.xfail("PTX upcast disabled on this device (check failed or did not compile)")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("asm,shared_mode", [(False, "serial"), (True, "serial"),
                                              (True, "early")])
@pytest.mark.parametrize("T", [64, 1000, 1200])
def test_mega_moe_cuda_graph(T, asm, shared_mode):
    """Captured once, replayed with new inputs copied into the static buffers: equals eager and
    the reference (tiles: decode at 64 tokens, prefill at 1000; at 1200, 112 rows per expert,
    the FP8-H prefill path on sm_90: the warp-specialized kernels with their Triton A copies,
    the shared expert on cuBLAS FP8 with its own output tensor - bounded against the fp32-H
    reference by 1e-2 + test_triton_moe_fp8h's LOOSE[1], H's E4M3 rounding); the shared expert
    after the routed experts or on the side stream during the router (shared_early, at every T
    here): the same kernels, so eager gives the serial order's bits in every mode. The
    default config (FP8 H at prefill sizes)."""
    cfg = MoeConfig(fp4_asm="on" if asm else "off", shared_early=shared_mode == "early",
                    shared_early_max_tokens=1 << 20)
    g = gen(T)
    n, d, F, E, k = 4, 1024, 512, 64, 6
    streams, fn, base, scale, nw = _mhc_inputs(T, n, d, g)
    gate, bias, routed, shared = _moe_weights(E, d, F, g)
    mkw = dict(eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20, act_fmt=ACT)

    def step(s):
        x, xq, xs, pre, post, comb = tmhc.mega_mhc(s, fn, base, scale, None, nw, **mkw)
        return tm.mega_moe(x, xq, xs, s, post, comb, gate, bias, *routed, *shared, topk=k,
                           **MOE_KW, kernel_config=cfg)

    static = streams.clone()
    graph, out = capture(lambda: step(static), warmup=1)
    fresh = randn(T, n, d, g=g, dtype=torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    eager = step(fresh)
    x, xq, xs, pre, post, comb = rf.mega_mhc(fresh, fn, base, scale, None, nw, **mkw)
    ref = rf.mega_moe(x, xq, xs, fresh, post, comb, gate, bias, *routed, *shared, topk=k,
                      **MOE_KW)
    assert rel(out, eager) < 1e-3
    fp8_h = tm._prefill_fp8_h_may(xq, T * k / E, cfg)
    assert rel(out, ref) < 1e-2 + (2.0 ** -4 if fp8_h else 0.0)
    cfg = MoeConfig(fp4_asm=cfg.fp4_asm, shared_early=False)
    assert torch.equal(eager, step(fresh)), "the shared expert's stream changed the bits"


@pytest.mark.parametrize("dtype,K,strided", [(torch.float8_e4m3fn, 1024, False),
                                               (torch.float8_e4m3fn, 5120, True),
                                               (torch.float8_e4m3fn, 20, False),
                                               (torch.bfloat16, 96, False),
                                               (torch.float8_e4m3fn, 6, False)])
@pytest.mark.parametrize("triton_prep", [True, False])
def test_sorted_rows(dtype, K, strided, triton_prep):
    """moe.sorted_rows (the warp-specialized L1's expert-sorted A copy): row r = a[a_idx[r] //
    topk] bit for bit against index_select, for 32-bit words of 16-byte rows (K 1024 / 5120, a
    row-strided view), rows of 5 words (K 20: the masked column block) and bf16 rows; K 6 takes
    index_select itself (rows no multiple of 4 bytes). P = 1 + 331 * 3 (odd, partial last
    block); every row of the poisoned output written. triton_copy off (MoeConfig.a_prep_triton):
    index_select."""
    g = torch.Generator().manual_seed(K)
    T, topk = 331, 3
    base = torch.randint(-128, 128, (T, K + (16 if strided else 0)), generator=g,
                         dtype=torch.int8)
    a = base.view(torch.uint8).view(dtype) if dtype.itemsize == 1 else \
        torch.randn(T, K, generator=g).to(dtype)
    a = a[:, :K].to(DEV)
    a_idx = torch.randperm(T * topk, generator=g)[:T * topk - 2].to(torch.int32)
    a_idx = torch.cat([a_idx, torch.tensor([0, T * topk - 1], dtype=torch.int32)]).to(DEV)
    with poisoned():
        got = tm.sorted_rows(a, a_idx, topk, triton_prep)
    want = a.index_select(0, a_idx.long() // topk)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kc", [3, 40])
@pytest.mark.parametrize("triton_prep", [True, False])
def test_tile_scales(kc, triton_prep):
    """moe.tile_scales (the warp-specialized L1's STMA A scales in tile order): column j BM + r
    = the scales of tile j's row r (its sorted row's token), 0 past a tile's rows and past the
    list's total (entries there are garbage, one in range, one out), against a loop over a
    hand-made list; BM = 128, kc 3 (padded to 4 lanes) and 40 (the V4 K = 5120); the Triton
    kernel and the torch ops (a_prep_triton off) alike."""
    P, MT, BM, topk = 136, 5, 128, 3
    g = torch.Generator().manual_seed(kc)
    a_scale = torch.rand(50, kc + 1, generator=g) + 0.5
    a_idx = torch.randint(0, 50 * topk, (P,), generator=g, dtype=torch.int32)
    # experts of 3, 0, 133 rows: tiles (row0, rend) = (0, 3), (3, 136), (131, 136)
    tiles = torch.tensor([3, 0, 2, 2, 7, -5, 0, 3, 131, 1, 999, 3, 136, 136, 2, 4],
                         dtype=torch.int32)
    with poisoned():
        got = tm.tile_scales(a_scale.to(DEV), a_idx.to(DEV), topk, tiles.to(DEV), MT, kc, BM,
                             triton_prep)
    want = torch.zeros(kc, MT * BM)
    for j, (r0, r1) in enumerate([(0, 3), (3, 136), (131, 136)]):
        for r in range(min(BM, r1 - r0)):
            want[:, j * BM + r] = a_scale[a_idx[r0 + r].long() // topk, :kc]
    assert got.shape == (kc, MT * BM) and got.is_contiguous()
    assert torch.equal(got.cpu(), want)


def test_zero_tokens():
    """Empty steps: every op returns its empty outputs without launching."""
    g = gen(0)
    n, d, F, E, k = 4, 256, 128, 8, 3
    streams, fn, base, scale, nw = _mhc_inputs(0, n, d, g)
    out = tmhc.mega_mhc(streams, fn, base, scale, None, nw, eps=1e-20, hc_eps=1e-6,
                        sinkhorn_iters=20, norm_eps=1e-20, act_fmt=ACT)
    assert [tuple(t.shape) for t in out] == [(0, d), (0, d), (0, d // 128), (0, n), (0, n),
                                             (0, n, n)]
    x, xq, xs, pre, post, comb = out
    gate, bias, routed, shared = _moe_weights(E, d, F, g)
    y = tm.mega_moe(x, xq, xs, streams, post, comb, gate, bias, *routed, *shared, topk=k,
                    **MOE_KW)
    assert y.shape == streams.shape
    ids = torch.zeros(0, k, dtype=torch.int64, device=DEV)
    w = torch.zeros(0, k, device=DEV)
    y = tm.moe_experts_q(xq, xs, ids, w, *routed, fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                         out_dtype="bf16")
    assert y.shape == (0, d)
    y = tm.linear_q(xq, xs, shared[0], shared[1], fmt="fp8_block", act_fmt=ACT, out_dtype="bf16")
    assert y.shape == (0, F)


def test_gate_split_fills_the_gpu_at_decode():
    """The router's gate GEMM splits over K when few tokens give few tiles (64 tokens x 384
    experts: 4 x 6 tiles of 16 x 64), into slices that are whole BK chunks, and not when the
    tiles alone fill the GPU."""
    assert tm._gate_split(4 * 6, 5120, 64) == 4
    assert tm._gate_split(1, 5120, 64) == 8
    assert tm._gate_split(128 * 6, 5120, 64) == 1
    for programs in (1, 3, 24, 60):
        s = tm._gate_split(programs, 5120, 64)
        assert 5120 % (s * 64) == 0 and programs * s <= 128
    assert tm._gate_split(1, 192, 64) == 1  # 192 = 3 chunks: no even split
