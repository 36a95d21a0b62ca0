"""V4.1's index-key cache (`L{i}.ikey`) is bf16 with quantize_kv on, f32 with it off.

With quantize_kv the compressor fake-quantizes every index key to MXFP4 before it is written: an
E2M1 value (at most 2 significant bits) times a power-of-two E8M0 scale inside fp32's exponent
range (amax floored at 1e-4). bf16 has fp32's exponent range and 8 significand bits, so the
narrowing store after the fake-quant is exact: a bf16 cache holds bitwise the values an f32 cache
would, and the indexer (which widens the keys to fp32, or multiplies bf16-exact operands) computes
bitwise the same scores. Unquantized keys are not bf16-exact, so without quantize_kv (and in V4)
the cache stays f32.

* the compiled graphs (every profile, the bounded-replay side graphs too) declare ikey bf16 with
  quantize_kv on, f32 with it off and for V4; the plan's bytes per token halve accordingly;
* the fused compressor (reference, capturable, Triton on CUDA or under TRITON_INTERPRET=1) writing
  into a bf16 cache gives bitwise the f32-cache result converted, and converting back loses
  nothing (fresh random inputs: blocks on the 1e-4 amax floor, 12 decades within a block, values
  near 1e30; every exact fake-quant format; ratios 1, 2, 4, 128); index scores over both caches
  are bitwise equal; without fake-quant the f32 keys are not bf16-exact (the check can fail);
* whole model: the tiny V4.1 with quantize_kv on, its bf16-ikey graph vs the same graph retyped
  to an f32 ikey cache, over prefill / decode / mixed steps (reference and capturable kernels,
  built and compiled graphs): bitwise equal logits and state.
"""
from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch

from megagraph.configs.process import triton_interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.graph.verify import verify_graph
from megagraph.kernels.capturable_table import CAPTURABLE
from megagraph.kernels.fused import capturable as cap_fused
from megagraph.kernels.indexer import capturable as cap_indexer
from megagraph.kernels.fused import reference as ref_fused
from megagraph.kernels.indexer import reference as ref_indexer
from megagraph.kernels.dense.quant import fake_quant
from megagraph.models.config import load_model_config
from megagraph.passes import CompileOptions, compile_graph, compile_model, load_hw_profile
from megagraph.passes.plan import state_plan
from tests.tiny import SeqChunk, random_tokens, session, tiny

V41, V4 = "v4.1-flash-tiny", "v4-flash-tiny"
INTERP = triton_interpret()
CUDA = torch.cuda.is_available() and not INTERP
TRITON = importlib.util.find_spec("triton") is not None and (CUDA or INTERP)
DEV = "cuda" if CUDA else "cpu"


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def ikey_types(g):
    return {lab: g.types[lab].dtype for lab in g.state_labels if lab.endswith(".ikey")}


# ---------------------------------------------------------------------------------------------
# the graphs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hw", ["cpu", "h200", "gb300"])
@pytest.mark.parametrize("quantize_kv", [True, False])
def test_compiled_v41_ikey_dtype_follows_quantize_kv(hw, quantize_kv):
    cfg = load_model_config(V41).replace(quantize_kv=quantize_kv)
    c = compile_model(cfg, load_hw_profile(hw), CompileOptions(bounded_replay=True))
    want = "bf16" if quantize_kv else "f32"
    graphs = {"built": c.built, "final": c.graph, **c.extra_graphs}
    assert len(graphs) > 2  # the bounded-replay graphs are checked too
    for name, g in graphs.items():  # side graphs may read a pool or its update as a plain input
        if name == "dspark-draft":
            continue  # the drafter has no indexer
        types = {v: t.dtype for v, t in g.types.items() if v.endswith((".ikey", ".ikey.next"))}
        assert types and set(types.values()) == {want}, (name, types)
        for n in g.nodes:  # the index scores read the bf16 pool (or its update) directly
            if n.op == "index_scores":
                assert g.types[n.inputs[2]].dtype == want, (name, n.outputs[0])
    if hw != "cpu":  # the fused compressor writes into the pool
        assert any(n.op == "compressor" for n in c.graph.nodes)


def test_v4_ikey_stays_f32():
    cfg = load_model_config(V4)
    g, _ = compile_graph(tiny(V4, "bf16")[1], load_hw_profile("h200"), CompileOptions())
    types = ikey_types(g)
    assert types and set(types.values()) == {"f32"}, (cfg.name, types)


def test_full_size_index_keys_take_2_bytes_per_channel():
    """V4.1-Flash: one compressed entry's index key is Di x 2 B (256 B), half of the f32 cache's."""
    from megagraph.models.build import build_step

    full = load_model_config("v4.1-flash")
    assert full.quantize_kv
    g = build_step(full)
    types = ikey_types(g)
    assert types and set(types.values()) == {"bf16"}
    for lab in types:
        t = g.types[lab]
        r = int(str(t.shape[1]).split("/")[1]) if "/" in str(t.shape[1]) else 1
        assert t.nbytes({"S": 1, "N": r}) == full.index_head_dim * 2
    per_token = state_plan(g, context=1)["per_token_bytes"]["index_keys"]
    g32 = build_step(full.replace(quantize_kv=False))
    assert state_plan(g32, context=1)["per_token_bytes"]["index_keys"] == 2 * per_token


# ---------------------------------------------------------------------------------------------
# the compressor's narrowing store
# ---------------------------------------------------------------------------------------------

# (slot, cached, new): group boundaries at every ratio, a 128-token group completed by a decode row
# and by a prefill chunk, an empty request row, a request completing nothing
REQS = [(2, 0, 37), (0, 13, 1), (3, 120, 10), (1, 127, 1), (4, 7, 0), (5, 200, 56), (6, 64, 2)]
SLOTS, CAP = 7, 256
DM, DC, DI = 64, 64, 128
ROPE = dict(rope_dim=16, theta=160000.0, yarn_factor=16.0, yarn_original=65536, yarn_beta_fast=32.0,
            yarn_beta_slow=1.0)
BLOCK = {"mxfp4": 32, "nvfp4": 16, "fp8_e4m3": 32}


def meta(reqs):
    pos, req = [], []
    for r, (_, c, n) in enumerate(reqs):
        pos += range(c, c + n)
        req += [r] * n
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=DEV)  # noqa: E731
    return i64(pos), i64(req), i64([s for s, _, _ in reqs])


def k_norm_weight(g):
    """Per-channel magnitudes of the index key (rms-normed, then scaled by this): a block around the
    1e-4 amax floor (scale 2^-15), a block spanning 12 decades, a block near 1e30, a block of O(1)
    values; random signs, channels shuffled within each block (RoPE pairs neighbours)."""
    mags = torch.cat([torch.logspace(-5, -3.7, 32), torch.logspace(-6, 6, 32), torch.logspace(27, 30, 32),
                      torch.rand(32, generator=g) + 0.5])
    mags = torch.cat([b[torch.randperm(32, generator=g)] for b in mags.split(32)])
    return mags * torch.where(torch.rand(DI, generator=g) < 0.5, -1.0, 1.0)


def case(ratio, fmt, s):
    g = torch.Generator().manual_seed(s)
    rn = lambda *sh, sc=1.0: torch.randn(*sh, generator=g) * sc  # noqa: E731
    pos, req, slots = meta(REQS)
    T = pos.shape[0]
    bf = torch.bfloat16
    x = rn(T, DM).to(bf)
    wkv = rn(DC, DM, sc=DM ** -0.5).to(bf)
    wgate = rn(DC, DM, sc=DM ** -0.5).to(bf) if ratio > 1 else None
    pk = rn(SLOTS, ratio, DC) if ratio > 1 else None
    pg = rn(SLOTS, ratio, DC) if ratio > 1 else None
    nw = torch.rand(DC, generator=g) + 0.5
    wk = rn(DI, DC, sc=DC ** -0.5).to(bf)
    knw = k_norm_weight(g)
    ikey0 = rn(SLOTS, CAP // ratio, DI).to(bf)  # old entries must survive: bf16-exact contents
    ckv = rn(SLOTS, CAP // ratio, DC).to(bf)
    args = [x, wkv, wgate, pk, pg, nw, wk, knw, ikey0, ckv]
    args = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    kw = dict(ratio=ratio, eps=1e-20, offset=1 - ratio, ikey_fmt=fmt, ckv_fmt="nvfp4", **ROPE)
    return args, (pos, req, slots), kw


def run_both(impl, args, meta_, kw):
    """The compressor over an f32 and a bf16 index-key cache holding the same old entries."""
    a32, a16 = list(args), list(args)
    a32[8], a16[8] = args[8].float(), args[8].clone()
    a32 = [a.clone() if isinstance(a, torch.Tensor) else a for a in a32]
    a16 = [a.clone() if isinstance(a, torch.Tensor) else a for a in a16]
    return impl(*a32, *meta_, **kw), impl(*a16, *meta_, **kw)


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_exact(want, got, old):
    """got (bf16 ikey cache) == want (f32 cache) converted, bitwise; nothing lost; rest identical."""
    ik32, ik16 = want[0], got[0]
    assert ik32.dtype == torch.float32 and ik16.dtype == torch.bfloat16
    written = (ik32 != old.float()).any(-1)
    assert written.sum() >= 3, "the case must write entries"
    assert torch.equal(bits(ik16), bits(ik32.to(torch.bfloat16))), "bf16 store != converted f32 result"
    assert torch.equal(ik16.float(), ik32), "the f32 keys are not exact in bf16"
    assert (ik32[written] == 0).float().mean() < 0.9  # not a trivial all-zero write
    for a, b in zip(want[1:], got[1:]):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    return written


IMPLS = {"reference": ref_fused.compressor, "capturable": cap_fused.compressor}


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e4m3"])
@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_compressor_bf16_ikey_store_is_exact(impl, ratio, fmt):
    args, m, kw = case(ratio, fmt, seed("store", impl, ratio, fmt))
    want, got = run_both(IMPLS[impl], args, m, kw)
    written = check_exact(want, got, args[8])
    if fmt == "mxfp4":  # keys from near the floor to ~2^100: the exponents survive the narrowing
        k = got[0].float()[written]
        e = torch.frexp(k[k != 0])[1]
        assert int(e.min()) <= -12 and int(e.max()) > 90


@pytest.mark.parametrize("ratio", [1, 4])
def test_capturable_inplace_bf16_ikey_store_is_exact(ratio):
    args, m, kw = case(ratio, "mxfp4", seed("inplace", ratio))
    impl = lambda *a, **k: cap_fused.compressor(*a, **k, inplace=True)  # noqa: E731
    want, got = run_both(impl, args, m, kw)
    check_exact(want, got, args[8])


@pytest.mark.parametrize("impl", list(IMPLS))
def test_unquantized_keys_are_not_bf16_exact(impl):
    """Why quantize_kv off keeps the f32 cache (and that check_exact can fail)."""
    args, m, kw = case(2, "none", seed("none", impl))
    want, got = run_both(IMPLS[impl], args, m, kw)
    assert not torch.equal(got[0].float(), want[0])


@pytest.mark.parametrize("products", ["fp32", "bf16"])
@pytest.mark.parametrize("ratio", [2, 4])
def test_index_scores_over_bf16_and_f32_caches_are_bitwise_equal(ratio, products):
    args, (pos, req, slots), kw = case(ratio, "mxfp4", seed("scores", ratio))
    want, got = run_both(ref_fused.compressor, args, (pos, req, slots), kw)
    g = torch.Generator().manual_seed(seed("q", ratio))
    T, Hi = pos.shape[0], 4
    qi = fake_quant(torch.randn(T, Hi, DI, generator=g), fmt="mxfp4", block=32).to(DEV)
    w = torch.randn(T, Hi, generator=g).to(DEV)
    skw = dict(ratio=ratio, weight_scale=DI ** -0.5 * Hi ** -0.5, products=products)
    for scores in (ref_indexer.index_scores, cap_indexer.index_scores):
        a = scores(qi, w, want[0], pos, req, slots, **skw)
        b = scores(qi, w, got[0], pos, req, slots, **skw)
        assert torch.isfinite(a).any() and torch.equal(bits(a), bits(b))


@pytest.mark.skipif(not TRITON, reason="needs CUDA + triton, or TRITON_INTERPRET=1")
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("ratio", [1, 2, 128])
def test_triton_compressor_bf16_ikey_store_is_exact(ratio, fmt, inplace):
    """The kernel fake-quantizes in fp32 registers, then casts to the cache's element type on the
    store (cast_to: round to nearest even under the interpreter too)."""
    from megagraph.kernels.state import triton_compressor as tc

    args, m, kw = case(ratio, fmt, seed("triton", ratio, fmt, inplace))
    assert tc.supports(args[0], args[1], args[6], ratio, ROPE["rope_dim"])
    impl = lambda *a, **k: tc.compressor(*a, **k, inplace=inplace)  # noqa: E731
    want, got = run_both(impl, args, m, kw)
    check_exact([t.cpu() for t in want], [t.cpu() for t in got], args[8].cpu())


# ---------------------------------------------------------------------------------------------
# whole model
# ---------------------------------------------------------------------------------------------

def with_f32_ikey(g):
    """The same graph with the index-key pools (and the values that update them) typed f32."""
    pools = set(ikey_types(g))
    retyped = {p: g.types[p].with_dtype("f32") for p in pools}
    for n in g.nodes:
        src = n.inputs[0] if n.op == "cache_write" else n.inputs[8] if n.op == "compressor" else None
        if src in retyped:
            retyped[n.outputs[0]] = g.types[n.outputs[0]].with_dtype("f32")
    g32 = g.with_nodes(g.nodes, types=retyped)
    verify_graph(g32)
    return g32


STEPS = [
    [SeqChunk(0, random_tokens(40, 1)), SeqChunk(2, random_tokens(5, 2))],
    [SeqChunk(1, random_tokens(11, 3)), SeqChunk(0, random_tokens(1, 4)), SeqChunk(2, random_tokens(6, 5))],
    [SeqChunk(0, random_tokens(1, 6)), SeqChunk(1, random_tokens(1, 7)), SeqChunk(2, random_tokens(1, 8)),
     SeqChunk(3, random_tokens(3, 9))],
]


@pytest.mark.parametrize("graph", ["built", "gb300"])
@pytest.mark.parametrize("impls", ["reference", "capturable"])
def test_model_with_bf16_ikey_equals_f32_ikey_bitwise(graph, impls):
    cfg, g, w, consts = tiny(V41, "f32", 0, quantize_kv=True)
    if graph != "built":  # the fused compressor and the bf16 products writing / reading the pools
        opt = CompileOptions(passes=("fuse-compressor", "indexer-products"))
        g, _ = compile_graph(g, load_hw_profile(graph), opt)
        assert any(n.op == "compressor" for n in g.nodes)
        assert all(n.attr("products") == "bf16" for n in g.nodes if n.op == "index_scores")
    assert set(ikey_types(g).values()) == {"bf16"}
    g32 = with_f32_ikey(g)
    im = None if impls == "reference" else {**reference_impls(), **CAPTURABLE}
    s16, s32 = (session(cfg, x, w, consts, slots=4, capacity=64, impls=im) for x in (g, g32))
    for i, st in enumerate(STEPS):
        a, b = s32.step(st), s16.step(st)
        assert torch.equal(bits(a), bits(b)), f"step {i}: logits differ"
    for k, a in s32.state.items():
        b = s16.state[k]
        if k in ikey_types(g):
            assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
            assert torch.equal(b.float(), a) and bool((a != 0).any()), k
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), k
