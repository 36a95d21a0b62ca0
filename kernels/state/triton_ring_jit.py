"""Triton code of the batched sliding-window ring copies (imported by kernels/state/triton_ring.py)."""
from __future__ import annotations

import triton
import triton.language as tl

MAX_PAIRS = 8


@triton.jit
def ring_copy(pos_ptr, req_ptr, slots_ptr, last_ptr,
              r0, k0, r1, k1, r2, k2, r3, k3, r4, k4, r5, k5, r6, k6, r7, k7,
              s_rs, s_rw, s_kt, D: tl.constexpr, W: tl.constexpr, NP: tl.constexpr,
              BD: tl.constexpr):
    """Token t's row of each of the NP (ring, kv) pairs goes to ring[slot, p % W] if t is among its
    request's last W tokens (the rows the reference keeps; so no two tokens of one request hit one
    row). All rings of one launch share shape and strides."""
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    r = tl.load(req_ptr + t)
    if p > tl.load(last_ptr + r) - W:
        dst = tl.load(slots_ptr + r).to(tl.int64) * s_rs + (p % W) * s_rw
        src = t.to(tl.int64) * s_kt
        for c0 in tl.static_range(0, D, BD):
            d = c0 + tl.arange(0, BD)
            dm = d < D
            for j in tl.static_range(NP):
                if j == 0:
                    rp, kp = r0, k0
                elif j == 1:
                    rp, kp = r1, k1
                elif j == 2:
                    rp, kp = r2, k2
                elif j == 3:
                    rp, kp = r3, k3
                elif j == 4:
                    rp, kp = r4, k4
                elif j == 5:
                    rp, kp = r5, k5
                elif j == 6:
                    rp, kp = r6, k6
                else:
                    rp, kp = r7, k7
                v = tl.load(kp + src + d, mask=dm)
                tl.store(rp + dst + d, v.to(rp.dtype.element_ty), mask=dm)
