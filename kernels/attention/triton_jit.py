"""Triton code of the CSA2 attention path (imported only by kernels/attention/triton.py and its
siblings, after triton imported): sparse attention with sink (split-K over the key list, online
softmax), its epilogue (sink, inverse RoPE, FP8 quantization), and the number-format helpers the
compressor shares (power-of-two scales, E4M3 / E2M1 rounding, interleaved RoPE in registers).

Key list of one token t (request r, slot s, position p, request cached c, window W):
  ring tiles   j in [0, W):       ring[s, j], a key iff it holds a position q with q >= 0,
                                  q >= p-W+1 (q < c holds by construction);
  step tiles   u in [0, min(W,T)): kv[t-u], a key iff row t-u is in request r with position in
                                  [p-W+1, p] (requests are contiguous, positions increasing, so the
                                  window's step rows are the u < W nearest ones);
  comp tiles   k in [0, K):       ckv[s, topk[t, k]], a key iff 0 <= idx < min((p+1)//ratio, C)
                                  and idx != topk[t, k-1] (duplicates count once in sorted rows);
               (attend_all:       ckv[s, g] for g < min((p+1)//ratio, C)).
Split `sid` of NS takes tiles sid, sid+NS, ... of each kind (balanced even when step tiles are
mostly empty); tiles without a key are skipped.
"""
from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# number formats
# ---------------------------------------------------------------------------------------------


@triton.jit
def pow2_ceil_exp(y):
    """Biased exponent (int32) of 2^ceil(log2(y)) for positive finite normal fp32 y."""
    yb = y.to(tl.int32, bitcast=True)
    e = (yb >> 23) & 0xFF
    return e + ((yb & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def exp_to_f32(e):
    """2^(e-127) for a biased exponent e in [1, 254]."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_half_even(y):
    """Round fp32 to the nearest integer, ties to even (|y| < 2^22): the 1.5*2^23 trick."""
    big = 12582912.0
    return (y + big) - big


@triton.jit
def round_e4m3(v):
    """Round |v| <= 448 to the E4M3 grid (nearest, ties to even) in fp32 arithmetic: what the
    hardware cast does; used under the Triton interpreter, whose fp8 cast mis-rounds carries."""
    a = tl.abs(v)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 127 - 6) - 3  # ulp exponent: 3 mantissa bits, subnormal step 2^-9
    ulp = exp_to_f32(e)
    inv = exp_to_f32(254 - e)
    r = round_half_even(a * inv) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def to_e4m3(v, MANUAL: tl.constexpr):
    if MANUAL:
        v = round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def e4m3_value(v, MANUAL: tl.constexpr):
    """fp32 value of v rounded to E4M3 (|v| <= 448)."""
    if MANUAL:
        return round_e4m3(v)
    return v.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def cast_to(x, dtype: tl.constexpr, MANUAL: tl.constexpr):
    """x (fp32) cast to dtype; under the interpreter (MANUAL), whose fp32 -> bf16 cast truncates,
    round to nearest even first."""
    if MANUAL and dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def round_e2m1(v):
    """Nearest E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6} (signed), ties to the even code, saturating
    at 6 (kernels.formats.f32_to_e2m1_codes with ties='even')."""
    a = tl.abs(v)
    n = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) \
        + (a > 5.0).to(tl.int32)
    nf = n.to(tl.float32)
    mag = tl.where(n < 4, nf * 0.5, tl.where(n < 6, nf - 2.0, tl.where(n == 6, 4.0, 6.0)))
    return tl.where(v < 0, -mag, mag)


@triton.jit
def rope_chunk(x, pos_f, freq_ptr, ROWS: tl.constexpr, CW: tl.constexpr, c0, DTOT: tl.constexpr,
               ROPE_DIM: tl.constexpr, INVERSE: tl.constexpr):
    """x [ROWS, CW] holds channels c0 .. c0+CW-1 (c0 even) of rows DTOT wide: rotate those among
    the last ROPE_DIM channels as interleaved pairs by the angle pos_f[row] * freq[k] (conjugate
    if INVERSE), k = the pair's index inside the rotated part; pos_f f32[ROWS]."""
    a, b = tl.split(tl.reshape(x, (ROWS, CW // 2, 2)))
    kp = c0 // 2 + tl.arange(0, CW // 2) - (DTOT - ROPE_DIM) // 2
    isr = kp >= 0
    f = tl.load(freq_ptr + tl.maximum(kp, 0), mask=isr, other=0.0)
    ang = pos_f[:, None] * f[None, :]
    cs = tl.cos(ang)
    sn = tl.sin(ang)
    if INVERSE:
        sn = -sn
    a2 = tl.where(isr[None, :], a * cs - b * sn, a)
    b2 = tl.where(isr[None, :], a * sn + b * cs, b)
    return tl.reshape(tl.join(a2, b2), (ROWS, CW))


@triton.jit
def fake_quant_rows(x, ROWS: tl.constexpr, CW: tl.constexpr, FMT: tl.constexpr,
                    BLOCK: tl.constexpr, MANUAL_FP8: tl.constexpr):
    """kernels.dense.quant.fake_quant of x [ROWS, CW] in blocks of BLOCK channels
    (CW % BLOCK == 0). FMT 0: none; 1: fp8_e4m3 (pow2 scale of amax/448, amax >= 1e-4);
    2: mxfp4 (pow2 scale of amax/6, amax >= 1e-4, E2M1 ties to even); 3: nvfp4 (E4M3 scale of
    min(max(amax, 6*2^-9)/6, 448), E2M1 of x/scale)."""
    if FMT == 0:
        return x
    NB: tl.constexpr = CW // BLOCK
    xb = tl.reshape(x, (ROWS, NB, BLOCK))
    amax = tl.max(tl.abs(xb), axis=2)
    if FMT == 3:
        s = tl.minimum(tl.math.div_rn(tl.maximum(amax, 6.0 * 0.001953125), 6.0), 448.0)
        scale = e4m3_value(s, MANUAL_FP8)
        q = round_e2m1(tl.math.div_rn(xb, scale[:, :, None]))
    else:
        if FMT == 1:
            e = pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
        else:
            e = pow2_ceil_exp(tl.math.div_rn(tl.maximum(amax, 1e-4), 6.0))
        scale = exp_to_f32(e)
        y = xb * exp_to_f32(254 - e)[:, :, None]
        if FMT == 1:
            q = e4m3_value(tl.minimum(tl.maximum(y, -448.0), 448.0), MANUAL_FP8)
        else:
            q = round_e2m1(y)
    return tl.reshape(q * scale[:, :, None], (ROWS, CW))


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


@triton.jit
def _attend(q, k, valid, m_i, l_i, acc, scale_log2, DOT_F32: tl.constexpr):
    """One key tile: online-softmax update (log2 domain) of (m, l, acc). DOT_F32: exact fp32
    products (fp32 inputs; and the Triton interpreter, whose bf16 dot is wrong)."""
    if DOT_F32:
        k = k.to(tl.float32)
        s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    pexp = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pexp, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(pexp, k, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pexp.to(k.dtype), k)
    return m_new, l_i, acc


@triton.jit
def _finish(acc, m_i, l_i, heads, hmask, t, p, sink_ptr, freq_ptr, o_ptr, os_ptr, H,
            D: tl.constexpr, BLOCK_H: tl.constexpr, MODE: tl.constexpr, ROPE_DIM: tl.constexpr,
            QBLOCK: tl.constexpr, E8M0: tl.constexpr, MANUAL_FP8: tl.constexpr,
            OUT_DT: tl.constexpr):
    """Normalize with the sink in the denominator (rows without a key -> 0), then
    MODE 0: store o [T, H, D] in o_ptr's dtype;
    MODE 1: round to OUT_DT (q's dtype), inverse RoPE at p, round to OUT_DT again (the unfused
            graph's rounding points), quantize per QBLOCK channels to E4M3 with a power-of-two
            scale (f32, or e8m0 bytes if E8M0), store o_q [T, H*D] and scales [T, H*D/QBLOCK]."""
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634  # log2 e
    den = l_i + tl.exp2(sink - m_i)
    o = acc / den[:, None]
    o = tl.where((l_i > 0)[:, None], o, 0.0)
    d = tl.arange(0, D)
    t64 = t.to(tl.int64)
    if MODE == 0:
        ptrs = o_ptr + t64 * H * D + heads[:, None] * D + d[None, :]
        tl.store(ptrs, cast_to(o, o_ptr.dtype.element_ty, MANUAL_FP8), mask=hmask[:, None])
    else:
        # the reference's rounding points: sparse_attn returns q's dtype, rope returns its input's
        o = cast_to(o, OUT_DT, MANUAL_FP8).to(tl.float32)
        if ROPE_DIM > 0:
            pos_f = tl.zeros([BLOCK_H], tl.float32) + p.to(tl.float32)
            o = rope_chunk(o, pos_f, freq_ptr, BLOCK_H, D, 0, D, ROPE_DIM, True)
            o = cast_to(o, OUT_DT, MANUAL_FP8).to(tl.float32)
        NB: tl.constexpr = D // QBLOCK
        ob = tl.reshape(o, (BLOCK_H, NB, QBLOCK))
        amax = tl.maximum(tl.max(tl.abs(ob), axis=2), 1e-4)
        e = tl.minimum(pow2_ceil_exp(tl.math.div_rn(amax, 448.0)), 254)
        inv = exp_to_f32(254 - e)
        qv = tl.minimum(tl.maximum(ob * inv[:, :, None], -448.0), 448.0)
        q8 = to_e4m3(tl.reshape(qv, (BLOCK_H, D)), MANUAL_FP8)
        tl.store(o_ptr + t64 * H * D + heads[:, None] * D + d[None, :], q8, mask=hmask[:, None])
        sp = os_ptr + t64 * H * NB + heads[:, None] * NB + tl.arange(0, NB)[None, :]
        if E8M0:
            tl.store(sp, e.to(tl.uint8), mask=hmask[:, None])
        else:
            tl.store(sp, exp_to_f32(e), mask=hmask[:, None])


@triton.jit
def sparse_attn_fwd(
        q_ptr, kv_ptr, ring_ptr, ckv_ptr, topk_ptr, sink_ptr,
        pos_ptr, req_ptr, slot_ptr, cached_ptr, freq_ptr,
        o_ptr, os_ptr, po_ptr, pml_ptr,
        T, H, C, ratio, scale_log2,
        s_qt, s_qh, s_kvt, s_rs, s_rw, s_cs, s_cc, s_tt,
        W: tl.constexpr, D: tl.constexpr, K: tl.constexpr, NT_STEP: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NS: tl.constexpr,
        HAS_COMP: tl.constexpr, ALL_COMP: tl.constexpr, MODE: tl.constexpr,
        ROPE_DIM: tl.constexpr, QBLOCK: tl.constexpr, E8M0: tl.constexpr,
        MANUAL_FP8: tl.constexpr, DOT_F32: tl.constexpr, PIPE: tl.constexpr = False):
    """PIPE: the top-k tiles without the skip of empty tiles, so the loop is a straight
    software-pipelined one (the gathered key loads of the next tiles in flight under this tile's
    products); an empty tile then costs its products (scores all -inf, so alpha = 1 and p = 0:
    m, l, acc unchanged - the same result)."""
    OUT_DT: tl.constexpr = q_ptr.dtype.element_ty
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sid = tl.program_id(2)
    p = tl.load(pos_ptr + t)
    r = tl.load(req_ptr + t)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    c = tl.load(cached_ptr + r)
    lo = p - (W - 1)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t.to(tl.int64) * s_qt + heads[:, None] * s_qh + d[None, :],
                mask=hmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    offs = tl.arange(0, BLOCK_N)

    # sliding-window ring (earlier steps)
    NT_RING: tl.constexpr = (W + BLOCK_N - 1) // BLOCK_N
    if (c > 0) & (lo < c):
        for it in range(sid, NT_RING, NS):
            j = it * BLOCK_N + offs
            rp = (c - 1) - (((c - 1 - j) % W) + W) % W
            valid = (j < W) & (rp >= 0) & (rp >= lo)
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                k = tl.load(ring_ptr + slot * s_rs + j[:, None] * s_rw + d[None, :],
                            mask=valid[:, None], other=0.0)
                m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale_log2, DOT_F32)

    # this step's rows of the same request inside the window
    for it in range(sid, NT_STEP, NS):
        u = it * BLOCK_N + offs
        ts = t - u
        inb = (ts >= 0) & (u < W)
        tsc = tl.maximum(ts, 0)
        rq = tl.load(req_ptr + tsc, mask=inb, other=-1)
        kp = tl.load(pos_ptr + tsc, mask=inb, other=-1)
        valid = inb & (rq == r) & (kp >= lo) & (kp <= p)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            k = tl.load(kv_ptr + tsc.to(tl.int64)[:, None] * s_kvt + d[None, :],
                        mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale_log2, DOT_F32)

    # compressed entries
    if HAS_COMP:
        nvis = tl.minimum((p + 1) // ratio, C)
        if ALL_COMP:
            n_ct = (nvis + BLOCK_N - 1) // BLOCK_N
            for it in range(sid, n_ct, NS):
                g = it * BLOCK_N + offs
                valid = g < nvis
                k = tl.load(ckv_ptr + slot * s_cs + g.to(tl.int64)[:, None] * s_cc + d[None, :],
                            mask=valid[:, None], other=0.0)
                m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale_log2, DOT_F32)
        else:
            NT_COMP: tl.constexpr = (K + BLOCK_N - 1) // BLOCK_N
            trow = topk_ptr + t.to(tl.int64) * s_tt
            for it in range(sid, NT_COMP, NS):
                kk = it * BLOCK_N + offs
                km = kk < K
                idx = tl.load(trow + kk, mask=km, other=-1)
                prev = tl.load(trow + kk - 1, mask=km & (kk > 0), other=-2)
                valid = km & (idx >= 0) & (idx < nvis) & (idx != prev)
                # PIPE (constexpr): no branch in the loop, so the pipeliner overlaps the tiles
                if PIPE or tl.max(valid.to(tl.int32), axis=0) > 0:
                    k = tl.load(ckv_ptr + slot * s_cs + tl.maximum(idx, 0)[:, None] * s_cc + d[None, :],
                                mask=valid[:, None], other=0.0)
                    m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale_log2, DOT_F32)

    if NS == 1:
        _finish(acc, m_i, l_i, heads, hmask, t, p, sink_ptr, freq_ptr, o_ptr, os_ptr, H, D,
                BLOCK_H, MODE, ROPE_DIM, QBLOCK, E8M0, MANUAL_FP8, OUT_DT)
    else:
        base = (t.to(tl.int64) * NS + sid) * H + heads
        tl.store(po_ptr + base[:, None] * D + d[None, :], acc, mask=hmask[:, None])
        tl.store(pml_ptr + base * 2, m_i, mask=hmask)
        tl.store(pml_ptr + base * 2 + 1, l_i, mask=hmask)


@triton.jit
def sparse_attn_combine(
        po_ptr, pml_ptr, pos_ptr, sink_ptr, freq_ptr, o_ptr, os_ptr, H,
        D: tl.constexpr, BLOCK_H: tl.constexpr, NS: tl.constexpr, MODE: tl.constexpr,
        ROPE_DIM: tl.constexpr, QBLOCK: tl.constexpr, E8M0: tl.constexpr,
        MANUAL_FP8: tl.constexpr, OUT_DT: tl.constexpr):
    """Merge the NS partial (acc, m, l) of one token and head block, then the epilogue."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    p = tl.load(pos_ptr + t)
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    for s in range(NS):
        base = (t.to(tl.int64) * NS + s) * H + heads
        m = tl.maximum(m, tl.load(pml_ptr + base * 2, mask=hmask, other=-1.0e30))
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for s in range(NS):
        base = (t.to(tl.int64) * NS + s) * H + heads
        ms = tl.load(pml_ptr + base * 2, mask=hmask, other=-1.0e30)
        ls = tl.load(pml_ptr + base * 2 + 1, mask=hmask, other=0.0)
        w = tl.exp2(ms - m)
        l_i += w * ls
        acc += w[:, None] * tl.load(po_ptr + base[:, None] * D + d[None, :], mask=hmask[:, None],
                                    other=0.0)
    _finish(acc, m, l_i, heads, hmask, t, p, sink_ptr, freq_ptr, o_ptr, os_ptr, H, D, BLOCK_H,
            MODE, ROPE_DIM, QBLOCK, E8M0, MANUAL_FP8, OUT_DT)
