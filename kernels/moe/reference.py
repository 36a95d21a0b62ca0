"""Mixture of experts: router, routed experts and shared SwiGLU expert (spec §3.5)."""
from __future__ import annotations

import torch
from torch import Tensor

from megagraph.kernels.gemm.reference import dequantize_weight
from megagraph.kernels.dense.quant import fake_quant

# formats of the expert's hidden activation H = silu(g) * u before the down-projection W2:
# None keeps fp32; "fp8_1x128" rounds H per row and 128 channels to E4M3 with a power-of-two scale
# 2^ceil(log2(max(amax, 1e-4) / 448)) (= fused.quantize_act / dequant_act fp8_1x128, DeepSeek's
# inference numerics for the w2 input; the Triton FP8-H path, kernels/moe/triton.py FP8_H)
H_FMTS = {None: None, "fp8_1x128": ("fp8_e4m3", 128)}


def router_scores(logits: Tensor, score_func: str) -> Tensor:
    """Router scores from fp32 logits: sqrt(softplus) (V4/V4.1), softmax or sigmoid."""
    if score_func == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(logits))
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown score_func {score_func!r}")


def route(x: Tensor, gate_w: Tensor, bias: Tensor | None, *, topk: int, route_scale: float,
          norm_topk: bool = True, score_func: str = "sqrtsoftplus") -> tuple[Tensor, Tensor]:
    """Top-k expert routing.

    x [T, d]; gate_w [E, d]; bias f32[E] or None (selection bias only).
    Logits ``l = x·gate_wᵀ`` (fp32); scores σ = sqrt(softplus(l)) (``sqrtsoftplus``), softmax(l) or
    sigmoid(l). Experts = topk(σ + bias) (descending); weights = σ of those experts, divided by
    (their sum + 1e-20) when norm_topk, times route_scale.
    Returns (ids i64[T, topk], weights f32[T, topk]).
    """
    sc = router_scores(x.float() @ gate_w.float().t(), score_func)
    sel = sc if bias is None else sc + bias.float()
    ids = sel.topk(topk, dim=-1).indices
    wts = sc.gather(1, ids)
    if norm_topk:
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, wts * route_scale


def _swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, swiglu_limit: float | None,
            h_fmt: str | None = None) -> Tensor:
    """fp32 SwiGLU with dequantized fp32 weights: W2(silu(min(W1x, lim)) ⊙ clamp(W3x, ±lim)); the
    hidden activation fake-quantized to h_fmt (H_FMTS) before W2 when given."""
    g = x @ w1.t()
    u = x @ w3.t()
    if swiglu_limit is not None and swiglu_limit > 0:
        u = u.clamp(-swiglu_limit, swiglu_limit)
        g = g.clamp(max=swiglu_limit)
    h = torch.nn.functional.silu(g) * u
    if H_FMTS[h_fmt] is not None:
        fmt, block = H_FMTS[h_fmt]
        h = fake_quant(h, fmt=fmt, block=block)
    return h @ w2.t()


def swiglu_mlp(x: Tensor, w1: Tensor, w1_scale: Tensor | None, w3: Tensor, w3_scale: Tensor | None,
               w2: Tensor, w2_scale: Tensor | None, *, fmt: str, swiglu_limit: float | None,
               h_fmt: str | None = None) -> Tensor:
    """One SwiGLU expert (the shared expert): x [T, d]; w1, w3 [F, d]; w2 [d, F] (quantized layouts and
    scales as for ``linear``). ``u = clamp(W3x, −lim, lim)``, ``g = min(W1x, lim)``,
    ``y = W2(silu(g) ⊙ u)`` (no clamp when swiglu_limit is None or ≤ 0). fp32 math, x.dtype out;
    h_fmt: the hidden activation fake-quantized before W2 (H_FMTS), as moe_experts'.
    """
    y = _swiglu(x.float(), dequantize_weight(w1, w1_scale, fmt), dequantize_weight(w3, w3_scale, fmt),
                dequantize_weight(w2, w2_scale, fmt), swiglu_limit, h_fmt)
    return y.to(x.dtype)


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, w1: Tensor, w1_scale: Tensor | None,
                w3: Tensor, w3_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None, *, fmt: str,
                swiglu_limit: float | None, h_fmt: str | None = None) -> Tensor:
    """Routed experts: ``y[t] = Σ_k weights[t,k] · E_{ids[t,k]}(x[t])``.

    x [T, d]; ids i64[T, k]; weights f32[T, k]; stacked expert weights w1, w3 [E, F, d] (mxfp4:
    int8 [E, F, d/2]), w2 [E, d, F] (mxfp4: [E, d, F/2]); scales stacked the same way ([E, …]) or
    None for ``dense``. Each expert as in :func:`swiglu_mlp`. fp32 accumulate, x.dtype out.
    h_fmt ``"fp8_1x128"``: each expert's hidden activation rounded to E4M3 per row and 128
    channels (power-of-two scales) before W2, as DeepSeek's inference (and the Triton FP8-H path)
    does; None (default) keeps it fp32.
    """
    T, d = x.shape
    xf = x.float()
    y = torch.zeros(T, d, dtype=torch.float32, device=x.device)

    def sc(s: Tensor | None, e: int) -> Tensor | None:
        return None if s is None else s[e]

    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        ye = _swiglu(xf[tok], dequantize_weight(w1[e], sc(w1_scale, e), fmt),
                     dequantize_weight(w3[e], sc(w3_scale, e), fmt),
                     dequantize_weight(w2[e], sc(w2_scale, e), fmt), swiglu_limit, h_fmt)
        y.index_add_(0, tok, ye * weights[tok, slot].float()[:, None])
    return y.to(x.dtype)
