"""Operand checks the compressor-pool kernels share (the reference, the capturable and the V4
reference one), so that every table refuses the same operands with the same message."""
from __future__ import annotations

from torch import Tensor


def pool_passthrough(kv_proj: Tensor, gate_proj: Tensor | None, pend_kv: Tensor | None,
                     pend_gate: Tensor | None, ratio: int):
    """compress_pool's result at ratio 1 (latent = kv_proj, pending passed through), None at a
    pooling ratio; raises where the gate and pending operands do not fit the ratio."""
    if ratio == 1:
        if gate_proj is not None:
            raise ValueError("ratio 1 takes no gate projection")
        return kv_proj.float(), pend_kv, pend_gate
    if gate_proj is None or pend_kv is None or pend_gate is None:
        raise ValueError(f"ratio {ratio} needs gate_proj and pending state")
    return None


def v4_pool_dims(kv_proj: Tensor, gate_proj: Tensor, ape: Tensor, pend_kv: Tensor,
                 pend_gate: Tensor, *, ratio: int, overlap: bool):
    """(r, c, T, width, D, P) of v4_compress_pool: ratio r, c = 2 overlapped halves or 1, T tokens,
    projection width c·D and P = c·r pending rows; raises where a shape does not fit them."""
    r = int(ratio)
    c = 2 if overlap else 1
    T, width = kv_proj.shape
    if width % c:
        raise ValueError(f"kv_proj width {width} not divisible by {c}")
    D = width // c
    P = c * r
    if gate_proj.shape != kv_proj.shape:
        raise ValueError(f"gate_proj {tuple(gate_proj.shape)} != kv_proj {tuple(kv_proj.shape)}")
    if tuple(ape.shape) != (r, width):
        raise ValueError(f"ape must be [{r}, {width}], got {tuple(ape.shape)}")
    if pend_kv.shape[1:] != (P, width) or pend_gate.shape != pend_kv.shape:
        raise ValueError(f"pending state must be [S, {P}, {width}], got {tuple(pend_kv.shape)}, "
                         f"{tuple(pend_gate.shape)}")
    return r, c, T, width, D, P
