"""kernels/capturable vs the reference kernels, op by op.

Every op of the capturable table has at least one case below (a builder of random inputs). Each
case is checked
* against the reference on the same inputs: fp32 outputs with rtol = atol = 1e-5 (the kernels only
  reorder fp32 sums: tiles, chunks, key order), integer / bool outputs exactly (top-k index sets
  have no ties: scores are continuous random values), dtypes and shapes identical;
* under tiny chunk / tile settings, so multi-chunk and multi-tile paths run too;
* (stateful and metadata ops) for padding tolerance: the step is run once with only the real
  requests and once with pad requests on a shared scratch slot (repeated in seq_slots, placed
  between real requests) and empty request rows; real rows' outputs and every non-scratch slot of
  the state must agree (same tolerance), and an empty real request's slot must stay unchanged;
* on the meta device under a dispatch mode that rejects any host tensor: a kernel that calls
  .item()/.tolist(), branches on a tensor value, uses nonzero / boolean-mask indexing / unique /
  bincount / repeat_interleave with tensor repeats, or builds a constant on the host (a
  host-to-device copy in a CUDA graph) fails there.
"""
from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from megagraph.kernels.reference_table import reference_impls
from megagraph.graph.registry import all_ops
from megagraph.kernels import formats
from megagraph.kernels.capturable_table import CAPTURABLE, capturable_impls
from megagraph.kernels.common import capturable as _common
from megagraph.kernels.engram.reference import engram_layout

REF = reference_impls()
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 reorderings only

# ---------------------------------------------------------------------------------------------
# step scenarios: (slot, cached, new) per request row; slot 5 is the pads' scratch slot
# ---------------------------------------------------------------------------------------------
S, N, SCRATCH = 6, 32, 5
REAL = [(2, 0, 5), (0, 13, 1), (3, 4, 9), (1, 20, 3), (4, 7, 0)]
PADS_BEFORE = {0: [(5, 0, 2)], 2: [(5, 3, 1)], 3: [(5, 0, 0)], 5: [(5, 6, 4)]}


def padded(reqs):
    out = []
    for i in range(len(reqs) + 1):
        out += PADS_BEFORE.get(i, [])
        if i < len(reqs):
            out.append(reqs[i])
    return out


PADDED = padded(REAL)


def meta(reqs) -> dict[str, torch.Tensor]:
    pos, req = [], []
    for r, (_, c, n) in enumerate(reqs):
        pos += range(c, c + n)
        req += [r] * n
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return dict(positions=i64(pos), token_req=i64(req), seq_slots=i64([s for s, _, _ in reqs]),
                seq_cached=i64([c for _, c, _ in reqs]), seq_new=i64([n for _, _, n in reqs]))


def real_rows(reqs_padded, reqs_real) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and request rows of the real requests inside the padded layout."""
    rows, rrows, t = [], [], 0
    real = list(reqs_real)
    for r, q in enumerate(reqs_padded):
        if real and q == real[0]:
            rows += range(t, t + q[2])
            rrows.append(r)
            real.pop(0)
        t += q[2]
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(rrows, dtype=torch.int64)


class Tok:
    """Per-token random data: tensors of the padded layout; the real layout selects its rows, so
    both runs see identical data for real tokens."""

    def __init__(self, seed: int, t: int, rows: torch.Tensor | None = None):
        self.g = torch.Generator().manual_seed(seed)
        self.rows = rows
        self.cache: dict = {}
        self.t_pad = int(meta(PADDED)["positions"].shape[0]) if rows is not None else t

    def __call__(self, name, *shape, fn=None):
        if name not in self.cache:
            x = torch.randn(self.t_pad, *shape, generator=self.g) if fn is None else fn(self.g, self.t_pad)
            self.cache[name] = x
        x = self.cache[name]
        return x if self.rows is None else x[self.rows]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(g, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# stateful / metadata cases: build(m, tok, g) -> (args, kwargs, kinds), kinds per output:
# "tok" ([T, ...]), "state" ([S, ...]), "req" ([R, ...])
# ---------------------------------------------------------------------------------------------
H, D, W = 3, 16, 6


def _meta4(m):
    return m["positions"], m["token_req"], m["seq_slots"]


def sparse_attn_case(mode, ratio=2, dtype=torch.float32):
    def build(m, tok, g):
        C = N // ratio if ratio else 4
        K = 5
        q = tok("q", H, D).to(dtype) * 2
        kv = tok("kv", D).to(dtype)
        ring = rnd(g, S, W, D, dtype=dtype)
        ckv = rnd(g, S, C, D, dtype=dtype) if mode != "window" else None
        topk = tok("topk", fn=lambda gg, t: torch.randint(-1, C, (t, K), generator=gg)) if mode == "topk" else None
        sink = rnd(g, H)
        args = (q, kv, ring, ckv, topk, sink, m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"])
        kw = dict(window=W, scale=D ** -0.5, ratio=ratio if mode != "window" else 0,
                  attend_all_compressed=(mode == "all"))
        return args, kw, ("tok",)
    return build


def ring_update_case(dtype=torch.float32):
    def build(m, tok, g):
        return (rnd(g, S, W, D, dtype=dtype), tok("kv", D).to(dtype), *_meta4(m)), dict(window=W), ("state",)
    return build


def compress_pool_case(ratio):
    def build(m, tok, g):
        Dc = 8
        if ratio == 1:
            return (tok("kv", Dc), None, None, None, *_meta4(m)), dict(ratio=1), ("tok", "none", "none")
        args = (tok("kv", Dc), tok("gate", Dc), rnd(g, S, ratio, Dc), rnd(g, S, ratio, Dc), *_meta4(m))
        return args, dict(ratio=ratio), ("tok", "state", "state")
    return build


def v4_compress_pool_case(ratio, overlap):
    def build(m, tok, g):
        c, Dh = (2 if overlap else 1), 8
        P = c * ratio
        args = (tok("kv", c * Dh), tok("gate", c * Dh), rnd(g, ratio, c * Dh), rnd(g, S, P, c * Dh),
                rnd(g, S, P, c * Dh), *_meta4(m))
        return args, dict(ratio=ratio, overlap=overlap), ("tok", "state", "state")
    return build


def cache_write_case(ratio, dtype=torch.float32):
    def build(m, tok, g):
        return (rnd(g, S, N // ratio, D, dtype=dtype), tok("rows", D), *_meta4(m)), dict(ratio=ratio), ("state",)
    return build


def index_scores_case(ratio):
    def build(m, tok, g):
        Hi, Di = 2, 8
        args = (tok("qi", Hi, Di), tok("w", Hi), rnd(g, S, N // ratio, Di), *_meta4(m))
        return args, dict(ratio=ratio, weight_scale=0.3), ("tok",)
    return build


def published_scores_case(published_ratio):
    def build(m, tok, g):
        C = N // 2  # a ratio-2 owner's entries; the published pool has N // published_ratio
        args = (tok("scores", C), tok("published", N // published_ratio), m["positions"], m["token_req"],
                m["seq_cached"])
        return args, dict(ratio=2, published_ratio=published_ratio), ("tok",)
    return build


LAYOUT = engram_layout([1, 4], None, max_ngram=4, n_heads=2, vocab_start=1000, compressed_vocab=400)[4]


def _cids(gg, t):
    x = torch.randint(0, 400, (t,), generator=gg)
    x[::7] = -1  # DEAD ids
    return x


def _hist(g):
    h = torch.randint(-1, 400, (S, 3), generator=g)
    return h


def engram_hash_case(m, tok, g):
    args = (tok("cids", fn=_cids), _hist(g), *_meta4(m), m["seq_cached"])
    kw = dict(multipliers=LAYOUT.multipliers, primes=LAYOUT.primes, offsets=LAYOUT.offsets, pad_id=2,
              max_ngram=4)
    return args, kw, ("tok",)


def engram_hist_update_case(m, tok, g):
    return (_hist(g), tok("cids", fn=_cids), *_meta4(m), m["seq_cached"], m["seq_new"]), {}, ("state",)


def block_attn_case(m, tok, g):
    args = (tok("q", H, D), tok("kv", D), rnd(g, S, W, D), rnd(g, H), *_meta4(m), m["seq_cached"])
    return args, dict(window=W, scale=D ** -0.5), ("tok",)


def select_last_case(m, tok, g):
    return (tok("x", D), m["seq_new"]), {}, ("req",)


def ring_update_batched_case(m, tok, g):
    ops = (rnd(g, S, W, D), tok("kv0", D), rnd(g, S, W, D, dtype=torch.bfloat16), tok("kv1", D))
    return (*_meta4(m), *ops), dict(window=W), ("state", "state")


META_CASES = {
    "sparse_attn/topk": ("sparse_attn", sparse_attn_case("topk")),
    "sparse_attn/all": ("sparse_attn", sparse_attn_case("all", ratio=4)),
    "sparse_attn/window": ("sparse_attn", sparse_attn_case("window")),
    "sparse_attn/topk-r1": ("sparse_attn", sparse_attn_case("topk", ratio=1)),
    "ring_update": ("ring_update", ring_update_case()),
    "ring_update/bf16": ("ring_update", ring_update_case(torch.bfloat16)),
    "ring_update_batched": ("ring_update_batched", ring_update_batched_case),
    "compress_pool/r2": ("compress_pool", compress_pool_case(2)),
    "compress_pool/r4": ("compress_pool", compress_pool_case(4)),
    "compress_pool/r1": ("compress_pool", compress_pool_case(1)),
    "v4_compress_pool/csa": ("v4_compress_pool", v4_compress_pool_case(4, True)),
    "v4_compress_pool/hca": ("v4_compress_pool", v4_compress_pool_case(8, False)),
    "cache_write/r1": ("cache_write", cache_write_case(1)),
    "cache_write/r2": ("cache_write", cache_write_case(2, torch.bfloat16)),
    "cache_write/r4": ("cache_write", cache_write_case(4)),
    "index_scores/r2": ("index_scores", index_scores_case(2)),
    "index_scores/r1": ("index_scores", index_scores_case(1)),
    "published_scores/r1": ("published_scores", published_scores_case(1)),
    "published_scores/r4": ("published_scores", published_scores_case(4)),
    "engram_hash": ("engram_hash", engram_hash_case),
    "engram_hist_update": ("engram_hist_update", engram_hist_update_case),
    "block_attn": ("block_attn", block_attn_case),
    "select_last": ("select_last", select_last_case),
}

# ---------------------------------------------------------------------------------------------
# token-parallel cases: build(g) -> (args, kwargs)
# ---------------------------------------------------------------------------------------------


def fp8_weight(g, o, i, block=32):
    q, s = formats.quantize_fp8_block(torch.randn(o, i, generator=g) * 0.2, (block, block))
    return q, s


def mxfp4_weight(g, *shape):
    *lead, o, i = shape
    packed = torch.randint(0, 256, (*lead, o, i // 2), dtype=torch.uint8, generator=g).view(torch.int8)
    scale = torch.randint(120, 126, (*lead, o, i // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return packed, scale


def stacked_fp8(g, e, o, i):
    qs = [fp8_weight(g, o, i) for _ in range(e)]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def linear_case(fmt, dtype=torch.float32):
    def build(g):
        x = rnd(g, 5, 64, dtype=dtype)
        if fmt == "dense":
            return (x, rnd(g, 40, 64, scale=0.2, dtype=torch.bfloat16), None), dict(fmt=fmt)
        w, s = fp8_weight(g, 40, 64) if fmt == "fp8_block" else mxfp4_weight(g, 40, 64)
        return (x, w, s), dict(fmt=fmt)
    return build


def grouped_linear_case(fmt):
    def build(g):
        x = rnd(g, 5, 2 * 64)
        if fmt == "dense":
            return (x, rnd(g, 2 * 16, 64, scale=0.2), None), dict(groups=2, fmt=fmt)
        w, s = fp8_weight(g, 32, 64) if fmt == "fp8_block" else mxfp4_weight(g, 32, 64)
        return (x, w, s), dict(groups=2, fmt=fmt)
    return build


def moe_case(fmt, T=9, k=2, E=6):
    def build(g):
        d, F = 64, 32
        x = rnd(g, T, d)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        wts = torch.rand(T, k, generator=g)
        if fmt == "dense":
            w1, w3, w2 = rnd(g, E, F, d, scale=0.2), rnd(g, E, F, d, scale=0.2), rnd(g, E, d, F, scale=0.2)
            s1 = s3 = s2 = None
        elif fmt == "fp8_block":
            (w1, s1), (w3, s3), (w2, s2) = stacked_fp8(g, E, F, d), stacked_fp8(g, E, F, d), stacked_fp8(g, E, d, F)
        else:
            (w1, s1), (w3, s3), (w2, s2) = mxfp4_weight(g, E, F, d), mxfp4_weight(g, E, F, d), mxfp4_weight(g, E, d, F)
        return (x, ids, wts, w1, s1, w3, s3, w2, s2), dict(fmt=fmt, swiglu_limit=1.5)
    return build


def swiglu_case(fmt):
    def build(g):
        args, kw = moe_case(fmt, E=1)(g)
        x, _, _, w1, s1, w3, s3, w2, s2 = args
        sq = lambda t: None if t is None else t[0]  # noqa: E731
        return (x, sq(w1), sq(s1), sq(w3), sq(s3), sq(w2), sq(s2)), kw
    return build


def route_case(func, bias):
    def build(g):
        x = rnd(g, 7, 16)
        return (x, rnd(g, 12, 16, dtype=torch.bfloat16), rnd(g, 12) if bias else None), \
            dict(topk=3, route_scale=1.5, norm_topk=func != "softmax", score_func=func)
    return build


def hash_route_case(g):
    return (rnd(g, 7, 16), rnd(g, 12, 16), torch.randint(0, 12, (30, 3), generator=g),
            torch.randint(0, 30, (7,), generator=g)), dict(topk=3, route_scale=1.5)


def hc_mixer_case(g):
    n, d = 4, 16
    return (rnd(g, 5, n, d), rnd(g, (2 + n) * n, n * d, scale=0.1), rnd(g, (2 + n) * n), rnd(g, 3)), \
        dict(eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)


def scores_prefix(g, T=6, C=20):
    s = torch.randn(T, C, generator=g)
    vis = torch.tensor([0, 1, 5, 9, 17, 20])[:T]
    return torch.where(torch.arange(C)[None, :] < vis[:, None], s, float("-inf"))


def rope_case(dim3, yarn, inverse, offset=0, dtype=torch.float32):
    def build(g):
        x = rnd(g, 7, 3, 24, dtype=dtype) if dim3 else rnd(g, 7, 24, dtype=dtype)
        pos = torch.randint(0, 5000, (7,), generator=g)
        kw = dict(rope_dim=16, theta=160000.0 if yarn else 10000.0, offset=offset, inverse=inverse)
        if yarn:
            kw.update(yarn_factor=16.0, yarn_original=64, yarn_beta_fast=32.0, yarn_beta_slow=1.0)
        return (x, pos), kw
    return build


def engram_lookup_case(quant, out_dtype=None):
    def build(g):
        ids = torch.randint(0, 50, (5, 3), generator=g)
        kw = {} if out_dtype is None else dict(out_dtype=out_dtype)
        if quant:
            q, s = formats.quantize_fp8_rows(torch.randn(50, 64, generator=g))
            return (q, s, ids), kw
        dtype = torch.bfloat16 if out_dtype is None else torch.float32
        return (rnd(g, 50, 64, dtype=dtype), None, ids), kw
    return build


def markov_case(g):
    R, B, V, d, r = 3, 4, 40, 16, 8
    return (rnd(g, R * B, V), rnd(g, R * B, d), torch.randint(0, V, (R,), generator=g), rnd(g, V, r),
            rnd(g, V, r), rnd(g, 1, d + r)), dict(block=B)


PLAIN_CASES = {
    "rms_norm/w": ("rms_norm", lambda g: ((rnd(g, 5, 3, 32), rnd(g, 32)), dict(eps=1e-6))),
    "rms_norm/bf16-noweight": ("rms_norm", lambda g: ((rnd(g, 5, 32, dtype=torch.bfloat16), None), dict(eps=1e-20))),
    "linear/dense": ("linear", linear_case("dense")),
    "linear/fp8": ("linear", linear_case("fp8_block")),
    "linear/mxfp4-bf16": ("linear", linear_case("mxfp4", torch.bfloat16)),
    "grouped_linear/dense": ("grouped_linear", grouped_linear_case("dense")),
    "grouped_linear/fp8": ("grouped_linear", grouped_linear_case("fp8_block")),
    "grouped_linear/mxfp4": ("grouped_linear", grouped_linear_case("mxfp4")),
    "rope/plain": ("rope", rope_case(False, False, False)),
    "rope/yarn-heads": ("rope", rope_case(True, True, False, offset=-3)),
    "rope/inverse-bf16": ("rope", rope_case(True, True, True, dtype=torch.bfloat16)),
    "fake_quant/fp8": ("fake_quant", lambda g: ((rnd(g, 5, 64, scale=3),), dict(fmt="fp8_e4m3", block=32))),
    "fake_quant/mxfp4": ("fake_quant", lambda g: ((rnd(g, 5, 2, 64, scale=3),), dict(fmt="mxfp4", block=32))),
    "fake_quant/nvfp4-bf16": ("fake_quant", lambda g: ((rnd(g, 5, 64, dtype=torch.bfloat16),), dict(fmt="nvfp4", block=16))),
    "add": ("add", lambda g: ((rnd(g, 5, 8, dtype=torch.bfloat16), rnd(g, 5, 8, dtype=torch.bfloat16)), {})),
    "embed": ("embed", lambda g: ((torch.randint(0, 30, (7,), generator=g), rnd(g, 30, 8)), {})),
    "split_heads": ("split_heads", lambda g: ((rnd(g, 5, 12),), dict(heads=3))),
    "merge_heads": ("merge_heads", lambda g: ((rnd(g, 5, 3, 4),), {})),
    "cast": ("cast", lambda g: ((rnd(g, 5, 4),), dict(dtype="bf16"))),
    "hc_embed": ("hc_embed", lambda g: ((rnd(g, 5, 8),), dict(n_hc=4))),
    "hc_mixer": ("hc_mixer", hc_mixer_case),
    "hc_collapse": ("hc_collapse", lambda g: ((rnd(g, 5, 4, 8, dtype=torch.bfloat16), rnd(g, 5, 4)), {})),
    "hc_expand": ("hc_expand", lambda g: ((rnd(g, 5, 4, 8), rnd(g, 5, 8), rnd(g, 5, 4), rnd(g, 5, 4, 4)), {})),
    "hc_head_mix": ("hc_head_mix", lambda g: ((rnd(g, 5, 4, 8), rnd(g, 4, 32), rnd(g, 4), rnd(g, 1)),
                                              dict(eps=1e-6, hc_eps=1e-6))),
    "candidate_mask": ("candidate_mask", lambda g: ((scores_prefix(g),), dict(block=3, topk_blocks=2))),
    "candidate_mask/many": ("candidate_mask", lambda g: ((scores_prefix(g),), dict(block=2, topk_blocks=50))),
    "topk_select": ("topk_select", lambda g: ((scores_prefix(g),), dict(k=4))),
    "topk_select/mask": ("topk_select", lambda g: ((scores_prefix(g), torch.rand(6, 20, generator=g) > 0.3), dict(k=4))),
    "topk_select/k>C": ("topk_select", lambda g: ((scores_prefix(g),), dict(k=25))),
    "route/sqrtsoftplus": ("route", route_case("sqrtsoftplus", True)),
    "route/softmax": ("route", route_case("softmax", False)),
    "route/sigmoid": ("route", route_case("sigmoid", True)),
    "hash_route": ("hash_route", hash_route_case),
    "moe_experts/dense": ("moe_experts", moe_case("dense")),
    "moe_experts/fp8": ("moe_experts", moe_case("fp8_block")),
    "moe_experts/mxfp4": ("moe_experts", moe_case("mxfp4")),
    "moe_experts/decode": ("moe_experts", moe_case("mxfp4", T=2, k=2, E=8)),
    "swiglu_mlp/fp8": ("swiglu_mlp", swiglu_case("fp8_block")),
    "swiglu_mlp/mxfp4": ("swiglu_mlp", swiglu_case("mxfp4")),
    "token_map": ("token_map", lambda g: ((torch.randint(0, 30, (7,), generator=g), torch.randint(0, 9, (30,), generator=g)), {})),
    "engram_lookup/fp8": ("engram_lookup", engram_lookup_case(True)),
    "engram_lookup/bf16": ("engram_lookup", engram_lookup_case(False)),
    "engram_lookup/fp8-f32": ("engram_lookup", engram_lookup_case(True, "f32")),
    "engram_lookup/f32": ("engram_lookup", engram_lookup_case(False, "f32")),
    "engram_gate": ("engram_gate", lambda g: ((rnd(g, 5, 4, 16), rnd(g, 5, 5 * 16), rnd(g, 4, 16), rnd(g, 4, 16)),
                                              dict(eps=1e-6))),
    "select_rows": ("select_rows", lambda g: ((rnd(g, 7, 4), torch.tensor([6, 2, 2, 0])), {})),
    "fill": ("fill", lambda g: ((rnd(g, 3, 4, dtype=torch.bfloat16),), dict(value=-1.0))),
    "stream_mean": ("stream_mean", lambda g: ((rnd(g, 5, 4, 8, dtype=torch.bfloat16),), {})),
    "concat": ("concat", lambda g: ((rnd(g, 5, 3), rnd(g, 5, 4), rnd(g, 5, 1)), {})),
    "draft_rows": ("draft_rows", lambda g: ((torch.tensor([7, 3, 9]), torch.tensor([4, 0, 11])), dict(block=3, noise_id=500))),
    "markov_draft": ("markov_draft", markov_case),
    # expert parallelism on one rank (ep_size=1: the all-to-all is the identity); multi-rank
    # cases run under torch.distributed in tests/parallel
    "ep_place": ("ep_place", lambda g: ((torch.randint(0, 6, (7, 2), generator=g),
                                         torch.tensor([[0, -1], [5, 1], [2, -1], [3, 4], [6, -1], [7, -1]])),
                                        dict(ep_size=1, slots_per_rank=8))),
    "ep_dispatch": ("ep_dispatch", lambda g: ((torch.randint(0, 6, (5, 2), generator=g), rnd(g, 5, 8)),
                                              dict(ep_size=1, slots_per_rank=6, max_tokens=7))),
    "ep_combine": ("ep_combine", lambda g: ((rnd(g, 14, 8), torch.ones(14, 1), torch.randint(0, 14, (5, 2), generator=g),
                                             rnd(g, 5, 2)), dict(ep_size=1, slots_per_rank=6, max_tokens=7))),
}


# fused (pass-created) ops, composed from the above
def quantized(g, T, d, act_fmt):
    from megagraph.kernels.fused.capturable import quantize_act

    return quantize_act(rnd(g, T, d), act_fmt=act_fmt)


def _fused_cases():
    def linear_q(g):
        xq, xs = quantized(g, 5, 64, "mxfp8")
        w, s = fp8_weight(g, 40, 64)
        return (xq, xs, w, s), dict(fmt="fp8_block", act_fmt="mxfp8", out_dtype="bf16")

    def grouped_linear_q(g):
        xq, xs = quantized(g, 5, 256, "fp8_1x128")
        return (xq, xs, rnd(g, 32, 128, scale=0.1), None), dict(groups=2, fmt="dense", act_fmt="fp8_1x128", out_dtype="f32")

    def moe_experts_q(g):
        (x, ids, wts, *ws), kw = moe_case("mxfp4")(g)
        xq, xs = quantized(g, x.shape[0], 64, "mxfp8")
        return (xq, xs, ids, wts, *ws), dict(kw, act_fmt="mxfp8", out_dtype="f32")

    def swiglu_mlp_q(g):
        (x, *ws), kw = swiglu_case("fp8_block")(g)
        xq, xs = quantized(g, x.shape[0], 64, "fp8_1x128")
        return (xq, xs, *ws), dict(kw, act_fmt="fp8_1x128", out_dtype="bf16")

    def mega_mhc(g):
        (h, fn, base, scale), kw = hc_mixer_case(g)
        return (h, fn, base, scale, None, rnd(g, 16)), dict(kw, norm_eps=1e-6, act_fmt="mxfp8")

    def mega_moe(g):
        d, E, F, T = 64, 6, 32, 5
        x = rnd(g, T, d)
        xq, xs = quantized(g, T, d, "mxfp8")
        (w1, s1), (w3, s3), (w2, s2) = mxfp4_weight(g, E, F, d), mxfp4_weight(g, E, F, d), mxfp4_weight(g, E, d, F)
        (a1, t1), (a3, t3), (a2, t2) = fp8_weight(g, F, d), fp8_weight(g, F, d), fp8_weight(g, d, F)
        args = (x, xq, xs, rnd(g, T, 4, d), rnd(g, T, 4), rnd(g, T, 4, 4), rnd(g, E, d), rnd(g, E),
                w1, s1, w3, s3, w2, s2, a1, t1, a3, t3, a2, t2)
        return args, dict(topk=2, route_scale=1.5, norm_topk=True, score_func="sqrtsoftplus", fmt="mxfp4",
                          shared_fmt="fp8_block", swiglu_limit=10.0, act_fmt="mxfp8")

    def mega_moe_hash(g):
        """a hash-routed layer: experts from tid2eid by token id (the graph passes 22 inputs)"""
        args, kw = mega_moe(g)
        T, E = args[0].shape[0], args[6].shape[0]
        tid2eid = torch.randint(0, E, (50, kw["topk"]), generator=g)
        return (*args, tid2eid, torch.randint(0, 50, (T,), generator=g)), kw

    def suffix_meta(g):
        m = meta(PADDED)
        keep_rows = torch.tensor([0, 1, 2, 5, 6, 9, 10, 11])
        return (keep_rows, m["positions"], m["token_req"], m["seq_new"]), dict(keep=3)

    return {"linear_q": linear_q, "grouped_linear_q": grouped_linear_q, "moe_experts_q": moe_experts_q,
            "swiglu_mlp_q": swiglu_mlp_q, "mega_mhc": mega_mhc, "mega_moe": mega_moe,
            "mega_moe/hash": mega_moe_hash,
            "quantize_act": lambda g: ((rnd(g, 5, 200, scale=3),), dict(act_fmt="fp8_1x128")),
            "suffix_meta": suffix_meta}


def sparse_attn_q_case(m, tok, g):
    args, kw, _ = sparse_attn_case("topk")(m, tok, g)
    return args, dict(kw, rope_dim=8, theta=160000.0, yarn_factor=16.0, yarn_original=64,
                      yarn_beta_fast=32.0, yarn_beta_slow=1.0, act_fmt="mxfp8"), ("tok", "tok")


def compressor_case(ratio, fmts):
    def build(m, tok, g):
        d, Dc, Di = 24, 32, 32
        wg = rnd(g, Dc, d, scale=0.3) if ratio > 1 else None
        pk = rnd(g, S, ratio, Dc) if ratio > 1 else None
        pg = rnd(g, S, ratio, Dc) if ratio > 1 else None
        args = (tok("x", d), rnd(g, Dc, d, scale=0.3), wg, pk, pg, rnd(g, Dc), rnd(g, Di, Dc, scale=0.3),
                rnd(g, Di), rnd(g, S, N // ratio, Di), rnd(g, S, N // ratio, Dc, dtype=torch.bfloat16), *_meta4(m))
        kw = dict(ratio=ratio, eps=1e-6, rope_dim=8, theta=160000.0, yarn_factor=16.0, yarn_original=64,
                  yarn_beta_fast=32.0, yarn_beta_slow=1.0, offset=1 - ratio, ikey_fmt=fmts[0], ckv_fmt=fmts[1])
        return args, kw, ("state",) * (4 if ratio > 1 else 2)
    return build


def v4_compressor_case(ratio, overlap):
    def build(m, tok, g):
        d, Dh = 24, 8
        c = 2 if overlap else 1
        args = (tok("x", d), rnd(g, c * Dh, d, scale=0.3), rnd(g, c * Dh, d, scale=0.3), rnd(g, ratio, c * Dh),
                rnd(g, S, c * ratio, c * Dh), rnd(g, S, c * ratio, c * Dh), rnd(g, Dh),
                rnd(g, S, N // ratio, Dh, dtype=torch.bfloat16), *_meta4(m))
        kw = dict(ratio=ratio, overlap=overlap, eps=1e-6, rope_dim=8, theta=160000.0, yarn_factor=16.0,
                  yarn_original=64, yarn_beta_fast=32.0, yarn_beta_slow=1.0, offset=1 - ratio)
        return args, kw, ("state",) * 3
    return build


FUSED_META_CASES = {
    "sparse_attn_q": ("sparse_attn_q", sparse_attn_q_case),
    "compressor/r2": ("compressor", compressor_case(2, ("mxfp4", "nvfp4"))),
    "compressor/r1": ("compressor", compressor_case(1, ("none", "fp8_e4m3"))),
    "v4_compressor/csa": ("v4_compressor", v4_compressor_case(4, True)),
    "v4_compressor/hca": ("v4_compressor", v4_compressor_case(8, False)),
}
FUSED_PLAIN_CASES = {name: (name.split("/")[0], fn) for name, fn in _fused_cases().items()}
# cases of ops the reference table has (fused / DSpark reference kernels are written concurrently)
ALL_META = {k: v for k, v in {**META_CASES, **FUSED_META_CASES}.items() if v[0] in REF}
ALL_PLAIN = {k: v for k, v in {**PLAIN_CASES, **FUSED_PLAIN_CASES}.items() if v[0] in REF}

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
SETTINGS = {"default": {}, "tiny": dict(CHUNK_ELEMS=1, MAX_TOKEN_TILE=3, MAX_EXPERT_TILE=2),
            "tile1": dict(MAX_TOKEN_TILE=1, MAX_EXPERT_TILE=1)}


@pytest.fixture(params=list(SETTINGS))
def setting(request, monkeypatch):
    for k, v in SETTINGS[request.param].items():
        monkeypatch.setattr(_common, k, v)
    return request.param


def clone_args(args):
    return tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def assert_same(a, b, what=""):
    for x, y in zip(as_tuple(a), as_tuple(b), strict=True):
        if x is None or y is None:
            assert x is None and y is None, what
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        tol = TOL if x.dtype == torch.float32 else ({} if x.dtype.is_floating_point else dict(rtol=0, atol=0))
        torch.testing.assert_close(x.float() if x.dtype.is_floating_point and x.dtype != torch.float32 else x,
                                   y.float() if y.dtype.is_floating_point and y.dtype != torch.float32 else y,
                                   msg=lambda m: f"{what}: {m}", equal_nan=True, **tol)


def build_meta_case(case, reqs, seed=0, rows=None):
    op, build = case
    m = meta(reqs)
    return op, build(m, Tok(seed + 1, m["positions"].shape[0], rows), gen(seed))


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_PLAIN))
def test_plain_op_matches_reference(name, setting):
    op, build = ALL_PLAIN[name]
    args, kw = build(gen(zlib.crc32(name.encode()) % 1000))
    assert_same(CAPTURABLE[op](*clone_args(args), **kw), REF[op](*clone_args(args), **kw), name)


@pytest.mark.parametrize("name", sorted(ALL_META))
@pytest.mark.parametrize("reqs", ["padded", "real", "decode", "rows>tokens"])
def test_meta_op_matches_reference(name, reqs, setting):
    """Ragged batch (prefill chunks + decode rows, window / groups crossed), the same batch with
    scratch-slot pads and empty rows, a pure decode batch, and more request rows than tokens."""
    layout = {"padded": PADDED, "real": REAL,
              "decode": [(0, 13, 1), (3, 7, 1), (5, 0, 1), (5, 2, 1), (1, 31, 1)],
              "rows>tokens": [(5, 0, 0), (0, 13, 1), (5, 0, 0), (5, 0, 0), (2, 3, 2), (4, 9, 0)]}[reqs]
    op, (args, kw, kinds) = build_meta_case(ALL_META[name], layout, seed=3)
    if op == "select_last" and layout[0][2] == 0:
        pytest.skip("the reference indexes row -1 for a leading empty request (see test_select_last_*)")
    got = CAPTURABLE[op](*clone_args(args), **kw)
    want = REF[op](*clone_args(args), **kw)
    if any(q[0] == SCRATCH for q in layout):  # pads' writes may collide there: compare real slots
        got, want = [tuple(v if k != "state" else v[:SCRATCH] for v, k in zip(as_tuple(o), kinds))
                     for o in (got, want)]
    assert_same(got, want, f"{name}/{reqs}")


@pytest.mark.parametrize("name", sorted(n for n, (op, _) in ALL_META.items() if op != "select_last"))
def test_pads_and_empty_rows_do_not_change_real_requests(name, setting):
    rows, _ = real_rows(PADDED, REAL)
    op, (args_p, kw, kinds) = build_meta_case(ALL_META[name], PADDED, seed=7)
    _, (args_r, _, _) = build_meta_case(ALL_META[name], REAL, seed=7, rows=rows)
    state_in = [a for a in args_p if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] == S]
    out_p = as_tuple(CAPTURABLE[op](*clone_args(args_p), **kw))
    out_r = as_tuple(CAPTURABLE[op](*clone_args(args_r), **kw))
    for k, a, b in zip(kinds, out_p, out_r):
        if k == "tok":
            assert_same(a[rows], b, f"{name} token rows")
        elif k == "state":
            assert_same(a[:SCRATCH], b[:SCRATCH], f"{name} state")
    empty_slot = 4  # real request (4, 7, 0)
    for k, o in zip(kinds, out_p):
        if k == "state":
            assert any(torch.equal(o[empty_slot], s[empty_slot]) for s in state_in if s.shape == o.shape), \
                f"{name}: the empty request's slot changed"


def test_select_last_rows_of_nonempty_requests():
    for layout in (PADDED, [(5, 0, 0), (0, 13, 1), (5, 0, 0), (2, 3, 2), (4, 9, 0)]):
        m = meta(layout)
        x = torch.randn(m["positions"].shape[0], 3)
        got = CAPTURABLE["select_last"](x, m["seq_new"])
        ends = torch.cumsum(m["seq_new"], 0) - 1
        nonempty = m["seq_new"] > 0
        assert got.shape == (len(layout), 3)
        assert torch.equal(got[nonempty], x[ends[nonempty]])


@pytest.mark.parametrize("op,variant", [("ring_update", "ring_update"), ("cache_write", "cache_write/r2"),
                                        ("compress_pool", "compress_pool/r2"),
                                        ("v4_compress_pool", "v4_compress_pool/csa"),
                                        ("ring_update_batched", "ring_update_batched")])
def test_inplace_state_variant_matches_and_aliases(op, variant):
    _, (args, kw, kinds) = build_meta_case(ALL_META[variant], PADDED)
    inplace = capturable_impls(inplace_state=True)[op]
    a2 = clone_args(args)
    got = as_tuple(inplace(*a2, **kw))
    want = as_tuple(CAPTURABLE[op](*clone_args(args), **kw))
    for k, g_, w_ in zip(kinds, got, want):
        if k == "state":
            assert_same(g_[:SCRATCH], w_[:SCRATCH], variant)
            assert any(g_ is a for a in a2), f"{variant}: in-place output does not alias its state input"


@pytest.mark.parametrize("name", ["ring_update", "cache_write/r1", "cache_write/r4", "compress_pool/r2",
                                  "compress_pool/r4", "v4_compress_pool/csa", "v4_compress_pool/hca",
                                  "compressor/r2", "v4_compressor/hca"])
def test_state_writes_do_not_depend_on_duplicate_order(name, monkeypatch):
    """Tokens of one request that hit one state row must write equal values (a GPU scatter picks
    any of them): reversing the scatter order must not change the result."""
    import importlib

    attention = importlib.import_module("megagraph.kernels.attention.capturable")
    compressor = importlib.import_module("megagraph.kernels.state.capturable")
    orig = _common.final_writer_update

    def reversed_order(buf, slot, row, writer, use_new, src, *, inplace):
        flip = lambda t: t.flip(0)  # noqa: E731
        return orig(buf, flip(slot), flip(row), flip(writer), flip(use_new), src, inplace=inplace)

    for mod in (attention, compressor):
        monkeypatch.setattr(mod, "final_writer_update", reversed_order)
    op, (args, kw, kinds) = build_meta_case(ALL_META[name], PADDED, seed=5)
    got = as_tuple(CAPTURABLE[op](*clone_args(args), **kw))
    want = as_tuple(REF[op](*clone_args(args), **kw))
    for k, a, b in zip(kinds, got, want):
        if k == "state":
            assert_same(a[:SCRATCH], b[:SCRATCH], name)


def test_sparse_attn_window_and_groups_vs_longer_contexts():
    """Contexts much longer than the window and the compressed capacity stress ring positions and
    visibility; decode (T == R) and a long prefill chunk, default and tiny chunking."""
    reqs = [(0, 0, 40), (1, 57, 1), (2, 63, 1), (3, 20, 23)]
    g = gen(11)
    m = meta(reqs)
    T = m["positions"].shape[0]
    C = 32
    args = (rnd(g, T, H, D), rnd(g, T, D), rnd(g, 4, W, D), rnd(g, 4, C, D),
            torch.randint(-1, C, (T, 7), generator=g), rnd(g, H),
            m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"])
    kw = dict(window=W, scale=0.25, ratio=2)
    want = REF["sparse_attn"](*args, **kw)
    assert_same(CAPTURABLE["sparse_attn"](*args, **kw), want, "default")
    old = _common.CHUNK_ELEMS
    try:
        _common.CHUNK_ELEMS = 1
        assert_same(CAPTURABLE["sparse_attn"](*args, **kw), want, "chunked")
    finally:
        _common.CHUNK_ELEMS = old


# ---------------------------------------------------------------------------------------------
# no host sync: every case on the meta device, host tensors rejected
# ---------------------------------------------------------------------------------------------


class HostTensorGuard(TorchDispatchMode):
    """Fails on any aten op that touches a non-meta tensor (inputs are all on meta, so such a
    tensor was built on the host: a constant that a CUDA graph would copy host-to-device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.device.type != "meta":
                raise AssertionError(f"{func}: host tensor {a.dtype}{tuple(a.shape)} in a device computation")
        out = func(*args, **kwargs)
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                raise AssertionError(f"{func} produced a host tensor {o.dtype}{tuple(o.shape)}")
        return out


def on_meta(x):
    return tree_map(lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a, x)


def check_no_sync(fn, args, kw):
    """Run fn on meta copies of args under HostTensorGuard; outputs must match the CPU run's
    shapes and dtypes."""
    cpu = as_tuple(fn(*clone_args(args), **kw))
    margs = on_meta(args)
    with HostTensorGuard():
        out = as_tuple(fn(*margs, **kw))
    for a, b in zip(cpu, out, strict=True):
        if a is None:
            assert b is None
            continue
        assert b.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype


def op_case(name):
    """(op, args, kw) of the ALL_PLAIN or ALL_META case `name`: a plain case built from gen(1),
    a meta case at the PADDED requests."""
    if name in ALL_PLAIN:
        op, build = ALL_PLAIN[name]
        args, kw = build(gen(1))
    else:
        op, (args, kw, _) = build_meta_case(ALL_META[name], PADDED)
    return op, args, kw


@pytest.mark.parametrize("name", sorted(ALL_PLAIN) + sorted(ALL_META))
def test_no_host_sync_on_meta(name):
    op, args, kw = op_case(name)
    check_no_sync(CAPTURABLE[op], args, kw)
    if op in ("ring_update", "cache_write", "compress_pool", "v4_compress_pool", "compressor"):
        check_no_sync(capturable_impls(inplace_state=True)[op], args, kw)


def test_guard_catches_syncing_kernels():
    """The mechanism itself: the reference kernels that sync (loops over requests with .tolist(),
    torch.unique + nonzero in the MoE, host-built constants) fail under it."""
    for name in ("sparse_attn/topk", "index_scores/r2"):
        op, (args, kw, _) = build_meta_case(ALL_META[name], PADDED)
        with pytest.raises(Exception):  # noqa: B017 (guard, meta or device errors)
            check_no_sync(REF[op], args, kw)
    for name in ("moe_experts/dense", "rope/plain", "fake_quant/mxfp4"):
        op, build = ALL_PLAIN[name]
        args, kw = build(gen(1))
        with pytest.raises(Exception):  # noqa: B017 (guard, meta or device errors)
            check_no_sync(REF[op], args, kw)


def test_every_op_has_a_capturable_kernel_and_a_case():
    ops = all_ops()
    missing = [n for n in ops if n not in CAPTURABLE]
    assert not missing, f"ops without a capturable kernel: {missing}"
    cased = {op for op, _ in itertools.chain(ALL_PLAIN.values(), ALL_META.values())}
    uncased = sorted(n for n in CAPTURABLE if n in REF and n not in cased)
    assert not uncased, f"capturable kernels without a test case: {uncased}"


@pytest.mark.parametrize("seed", range(4))
def test_count_at_most_is_searchsorted_right(seed):
    """_common.count_at_most replaces torch.searchsorted (miscompiled by Inductor on CUDA): same
    counts for nondecreasing ends with repeats, zeros and values past n."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.cumsum(torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g), 0)
    n = int(ends[-1]) + int(torch.randint(-5, 6, (1,), generator=g)) if seed else 0
    n = max(n, 0)
    want = torch.searchsorted(ends, torch.arange(n), right=True)
    assert torch.equal(_common.count_at_most(ends, n), want)
