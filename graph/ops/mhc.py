"""Manifold-constrained hyper-connections (mHC): the 4-stream residual and its mixers."""

from ..registry import REQUIRED, expect, op
from ..types import TensorType, scale_dim


@op("hc_embed", ("e",), ("streams", "pre_mix"), attrs={"n_hc": REQUIRED}, cost="memory")
def hc_embed(e: TensorType, *, n_hc) -> tuple[TensorType, TensorType]:
    """Copy the embedding into every stream; the carried collapse mix starts at (1, 0, ..., 0)."""
    expect(e.rank == 2, f"e must be [T, d], got {e}")
    return TensorType(e.dtype, (e.shape[0], n_hc, e.shape[1])), TensorType("f32", (e.shape[0], n_hc))


@op("hc_mixer", ("streams", "fn", "base", "scale"), ("pre", "post", "comb"),
    attrs={"eps": REQUIRED, "hc_eps": REQUIRED, "sinkhorn_iters": REQUIRED}, cost="gemm")
def hc_mixer(h: TensorType, fn: TensorType, base: TensorType, scale: TensorType, *, eps, hc_eps,
             sinkhorn_iters):
    """Per token: project the RMS-normalized flattened streams to (2+n)*n logits, then
    pre = sigmoid + eps, post = 2*sigmoid, comb = Sinkhorn-normalized n x n mix."""
    expect(h.rank == 3, f"streams must be [T, n, d], got {h}")
    t, n, d = h.shape
    expect(fn.shape == ((2 + n) * n, scale_dim(d, n)) and fn.dtype == "f32",
           f"fn must be f32[{(2 + n) * n}, {n}*{d}], got {fn}")
    expect(base.shape == ((2 + n) * n,), f"base must be [{(2 + n) * n}], got {base}")
    expect(scale.shape == (3,), f"scale must be [3], got {scale}")
    return TensorType("f32", (t, n)), TensorType("f32", (t, n)), TensorType("f32", (t, n, n))


@op("hc_collapse", ("streams", "mix"), cost="memory")
def hc_collapse(h: TensorType, w: TensorType) -> TensorType:
    """x[t] = sum_c mix[t, c] * streams[t, c] (fp32 accumulate)."""
    expect(h.rank == 3 and w.shape == h.shape[:2] and w.dtype == "f32",
           f"mix must be f32[{h.shape[0]}, {h.shape[1]}], got {w}")
    return TensorType(h.dtype, (h.shape[0], h.shape[2]))


@op("hc_expand", ("streams", "y", "post", "comb"), cost="memory")
def hc_expand(h: TensorType, y: TensorType, post: TensorType, comb: TensorType) -> TensorType:
    """Residual update: out[t, j] = post[t, j] * y[t] + sum_i comb[t, i, j] * streams[t, i]."""
    expect(y.shape == (h.shape[0], h.shape[2]), f"y must be [T, d] of {h}, got {y}")
    expect(post.shape == h.shape[:2] and comb.shape == (*h.shape[:2], h.shape[1]),
           f"post/comb must be [T, n] / [T, n, n], got {post} / {comb}")
    return h
