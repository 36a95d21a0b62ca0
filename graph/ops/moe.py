"""Mixture of experts: router, routed experts (stacked weights), shared expert."""

from ..registry import REQUIRED, expect, op
from ..types import TensorType, scale_dim
from .core import _check_scale, _weight_in_features

SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@op("route", ("x", "gate_w", "bias?"), ("ids", "weights"),
    attrs={"topk": REQUIRED, "route_scale": REQUIRED, "norm_topk": True, "score_func": "sqrtsoftplus"},
    cost="gemm")
def route(x, gate_w, bias, *, topk, route_scale, norm_topk, score_func):
    """Scores s = f(gate_w @ x) in fp32; experts = top-k of s + bias (bias for selection only);
    weights = s of the chosen experts, normalized, times route_scale."""
    expect(score_func in SCORE_FUNCS, f"score_func must be one of {SCORE_FUNCS}")
    expect(gate_w.rank == 2 and gate_w.shape[1] == x.shape[-1], f"gate_w must be [E, {x.shape[-1]}], got {gate_w}")
    if bias is not None:
        expect(bias.shape == gate_w.shape[:1], f"bias must be [{gate_w.shape[0]}], got {bias}")
    return TensorType("i64", (x.shape[0], topk)), TensorType("f32", (x.shape[0], topk))


def _expert_bank(w1, s1, w3, s3, w2, s2, fmt, d, stacked: bool):
    lead = 1 if stacked else 0
    for w in (w1, w3, w2):
        expect(w.rank == 2 + lead, f"expert weight must be {'[E, O, I]' if stacked else '[O, I]'}, got {w}")
    as2d = (lambda t: None if t is None else TensorType(t.dtype, t.shape[lead:]))
    i1 = _weight_in_features(as2d(w1), fmt)
    _check_scale(w1, s1, fmt)
    _check_scale(w3, s3, fmt)
    _check_scale(w2, s2, fmt)
    f = w1.shape[lead]
    expect(i1 == d and w3.shape == w1.shape, f"w1/w3 must be [{'E, ' if stacked else ''}F, {d}], got {w1} / {w3}")
    i2 = _weight_in_features(as2d(w2), fmt)
    expect(w2.shape[lead] == d and i2 == f, f"w2 must be [{'E, ' if stacked else ''}{d}, {f}], got {w2}")


@op("moe_experts", ("x", "ids", "weights", "w1", "w1_scale?", "w3", "w3_scale?", "w2", "w2_scale?"),
    attrs={"fmt": "dense", "swiglu_limit": 0.0}, cost="gemm")
def moe_experts(x, ids, weights, w1, s1, w3, s3, w2, s2, *, fmt, swiglu_limit) -> TensorType:
    """sum_k weights[t, k] * Expert[ids[t, k]](x[t]); expert = W2 (silu(clamp W1 x) * clamp W3 x)."""
    expect(x.rank == 2, f"x must be [T, d], got {x}")
    expect(ids.shape == weights.shape and ids.shape[0] == x.shape[0], f"ids/weights must be [T, k], got {ids} / {weights}")
    _expert_bank(w1, s1, w3, s3, w2, s2, fmt, x.shape[1], stacked=True)
    return x


@op("swiglu_mlp", ("x", "w1", "w1_scale?", "w3", "w3_scale?", "w2", "w2_scale?"),
    attrs={"fmt": "dense", "swiglu_limit": 0.0}, cost="gemm")
def swiglu_mlp(x, w1, s1, w3, s3, w2, s2, *, fmt, swiglu_limit) -> TensorType:
    """One (shared) expert: W2 (silu(clamp W1 x) * clamp W3 x)."""
    _expert_bank(w1, s1, w3, s3, w2, s2, fmt, x.shape[-1], stacked=False)
    return x


__all__ = ["scale_dim"]
