"""DSpark drafter (spec §3.9, §2.3, §4.1): target features and draft context rings in the main step,
the draft graph (block attention, Markov chain, confidence), its weights and its text form.

Tolerance as in test_v41_consistency: act_dtype f32, differences only from fp32 GEMMs
reassociating for different row counts (~1e-6), so 1e-4 catches any real state or masking bug.
The draft rings hold FP8 fake-quantized rows (`quantize_kv`); a different batch composition can
move one element across an E4M3 rounding boundary, so the quantized ring comparisons use the
same 2e-3 band as the mixed-batch test there and the exact state logic is checked with
quantize_kv off.
"""

import pytest
import torch

from megagraph.graph.interp import interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.graph.text import parse_graph, print_graph
from megagraph.kernels.dspark.reference import block_attn, draft_rows, markov_draft
from megagraph.kernels.gemm.reference import dequantize_weight
from megagraph.kernels.dense.quant import fake_quant
from megagraph.kernels.dense.rope import rope
from megagraph.models.build import build_step
from megagraph.models.checkpoint.synthetic import random_weights
from megagraph.models.config import load_model_config
from megagraph.models.dspark import build_dspark_draft, ring_name
from megagraph.models.session import initial_state, step_metadata, weight_specs
from tests.tiny import SeqChunk, random_tokens, session, tiny

TOL = dict(rtol=1e-4, atol=1e-4)
QTOL = dict(rtol=2e-3, atol=2e-3)
MODEL = "v4.1-flash-tiny"


def with_draft(model):
    """(cfg, main graph, weights of main + draft graph, constants, draft graph)."""
    cfg, g, w, consts = model
    d = build_dspark_draft(cfg)
    wd = random_weights(weight_specs(d), seed=0, init_std=cfg.hidden_size ** -0.5, stacked=True)
    for k, v in w.items():  # values are seeded per tensor name, so shared tensors agree
        if k in wd:
            assert torch.equal(wd[k].view(torch.uint8) if wd[k].dtype.itemsize == 1 else wd[k],
                               v.view(torch.uint8) if v.dtype.itemsize == 1 else v), k
    return cfg, g, {**w, **wd}, consts, d


@pytest.fixture(scope="module")
def model():
    return with_draft(tiny(MODEL, "f32", 0))


@pytest.fixture(scope="module")
def model_noq():
    return with_draft(tiny(MODEL, "f32", 0, quantize_kv=False))


def rings(state, cfg):
    return {ring_name(st): state[ring_name(st)] for st in range(cfg.num_mtp_layers)}


def run_draft(model, state, anchors, slots, cached, keep=()):
    cfg, _, w, _, d = model
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    inputs = {"anchor_ids": i64(anchors), "seq_slots": i64(slots), "seq_cached": i64(cached),
              **rings(state, cfg)}
    return interpret(d, inputs, w, reference_impls(), keep=keep)


def prefilled(model, prompts: dict[int, tuple[int, ...]]):
    """A session with each slot's prompt prefilled (one step each); returns (session, anchors)."""
    cfg, g, w, consts, _ = model
    s = session(cfg, g, w, consts)
    anchors = {}
    for slot, toks in prompts.items():
        anchors[slot] = int(s.step([SeqChunk(slot, toks)])[-1].argmax())
    return s, anchors


# -- the main step: target features and draft context rings ----------------------------------------
def test_features_are_the_stream_means_at_the_target_layer_inputs(model):
    cfg, g, w, consts, _ = model
    prods = g.producers()
    taps = []
    for i in cfg.dspark_target_layers:
        mixer = prods[f"L{i}.attn.pre"]  # the attention mixer reads the layer input (after Engram)
        assert mixer.op == "hc_mixer"
        feat = prods[f"L{i}.dspark_feat"]
        assert feat.op == "stream_mean" and feat.inputs == (mixer.inputs[0],)
        taps.append(mixer.inputs[0])
    toks = random_tokens(13, 11)
    inputs = {**step_metadata([SeqChunk(0, toks)], {}), **initial_state(g, slots=2, capacity=64),
              **consts}
    out = interpret(g, inputs, w, reference_impls(),
                    keep=(*taps, "dspark.features", "dspark.main_x"))
    F = torch.cat([out[t].mean(dim=1) for t in taps], dim=-1)
    assert F.shape == (13, len(cfg.dspark_target_layers) * cfg.hidden_size)
    torch.testing.assert_close(out["dspark.features"], F, rtol=1e-6, atol=1e-6)

    # main_x = main_norm(main_proj F); kvS = fp8(RoPE_base(kv_norm_S(wkv_S main_x))) in mtp.S.ring
    def dq(prefix):
        return dequantize_weight(w[f"{prefix}.weight"], w.get(f"{prefix}.scale"), "fp8_block")

    def rms(x, wt):
        return wt.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    main_x = rms(F @ dq("mtp.0.main_proj").t(), w["mtp.0.main_norm.weight"])
    torch.testing.assert_close(out["dspark.main_x"], main_x, **TOL)
    pos = torch.arange(13)
    W = cfg.sliding_window
    for st in range(cfg.num_mtp_layers):
        kv = rms(main_x @ dq(f"mtp.{st}.attn.wkv").t(), w[f"mtp.{st}.attn.kv_norm.weight"])
        kv = fake_quant(rope(kv, pos, rope_dim=cfg.rope_head_dim, theta=cfg.rope_theta),
                        fmt="fp8_e4m3", block=32)
        ring = out[ring_name(st)][0]
        for p in range(13 - W, 13):  # the last W positions, at row p % W
            torch.testing.assert_close(ring[p % W], kv[p], **QTOL)
        assert not out[ring_name(st)][1].any()  # other slots untouched


def test_main_graph_without_draft_stages_has_no_draft_state():
    cfg = load_model_config(MODEL).replace(num_mtp_layers=0)
    g = build_step(cfg)
    assert not [i for i in g.inputs if i.startswith("mtp.")]
    assert not [w for w in g.weights if w.startswith("mtp.")]
    assert "stream_mean" not in g.op_counts()


@pytest.mark.parametrize("which,tol", [("model_noq", TOL), ("model", QTOL)])
def test_draft_rings_prefill_equals_decode_and_chunked_prefill(which, tol, request):
    model = request.getfixturevalue(which)
    cfg, g, w, consts, _ = model
    toks = random_tokens(21, 12)  # crosses the window (8) twice
    full = session(cfg, g, w, consts)
    full.step([SeqChunk(1, toks)])
    inc = session(cfg, g, w, consts)
    for t in toks:
        inc.step([SeqChunk(1, (t,))])
    chunked = session(cfg, g, w, consts)
    i = 0
    for n in (5, 1, 8, 7):
        chunked.step([SeqChunk(1, toks[i:i + n])])
        i += n
    for st in range(cfg.num_mtp_layers):
        ref = full.state[ring_name(st)]
        assert ref[1].abs().sum() > 0 and not ref[0].any()
        torch.testing.assert_close(inc.state[ring_name(st)], ref, **tol)
        torch.testing.assert_close(chunked.state[ring_name(st)], ref, **tol)


# -- block attention ---------------------------------------------------------------------------------
def naive_block_attn(q, kv, ring, sink, spans, slots, cached, scale):
    """Per row: keys = the ring rows of positions c-W..c-1 (>= 0) + every row of its block."""
    W = ring.shape[1]
    out = torch.zeros_like(q)
    for (start, n), slot, c in zip(spans, slots, cached):
        ctx = [ring[slot, p % W] for p in range(max(0, c - W), c)]
        for t in range(start, start + n):
            keys = torch.stack(ctx + [kv[j] for j in range(start, start + n)])
            for h in range(q.shape[1]):
                sc = keys @ q[t, h] * scale
                m = sc.max()
                e = torch.exp(sc - m)
                out[t, h] = (e[:, None] * keys).sum(0) / (torch.exp(sink[h] - m) + e.sum())
    return out


def test_block_attn_is_non_causal_and_sees_exactly_the_window_before_the_block():
    torch.manual_seed(0)
    H, D, W, B = 3, 16, 8, 4
    slots, cached = [2, 0, 1], [5, 8, 19]  # ring partly filled, exactly full, wrapped
    R = len(slots)
    q, kv = torch.randn(R * B, H, D), torch.randn(R * B, D)
    ring, sink = torch.randn(4, W, D), torch.randn(H)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    _, pos, req = draft_rows(i64([7, 7, 7]), i64(cached), block=B, noise_id=9)
    args = (sink, pos, req, i64(slots), i64(cached))
    o = block_attn(q, kv, ring, *args, window=W, scale=D ** -0.5)
    spans = [(r * B, B) for r in range(R)]
    torch.testing.assert_close(o, naive_block_attn(q, kv, ring, sink, spans, slots, cached, D ** -0.5),
                               rtol=1e-5, atol=1e-5)
    # ring rows holding no position < c (slot 2 has 5 tokens: rows 5..7) and other slots are unseen
    junk = ring.clone()
    junk[2, 5:] = 1e4
    junk[3] = 1e4
    torch.testing.assert_close(block_attn(q, kv, junk, *args, window=W, scale=D ** -0.5), o)
    # non-causal: the LAST row of a block changes the FIRST row's output, not other requests'
    kv2 = kv.clone()
    kv2[2 * B - 1] += 1.0
    o2 = block_attn(q, kv2, ring, *args, window=W, scale=D ** -0.5)
    assert (o2[B] - o[B]).abs().max() > 1e-3
    torch.testing.assert_close(o2[:B], o[:B])
    torch.testing.assert_close(o2[2 * B:], o[2 * B:])
    # every ring position c-W..c-1 is seen by every row (also by row 0 at position c)
    ring2 = ring.clone()
    oldest = (cached[2] - W) % W
    ring2[1, oldest] += 1.0
    o3 = block_attn(q, kv, ring2, *args, window=W, scale=D ** -0.5)
    assert ((o3[2 * B:] - o[2 * B:]).abs().amax(dim=(1, 2)) > 1e-4).all()


def test_draft_graph_block_attention_reads_its_stage_ring(model):
    cfg = model[0]
    s, anchors = prefilled(model, {0: random_tokens(11, 13), 3: random_tokens(4, 14)})
    slots = [3, 0]
    cached = [s.cached[sl] for sl in slots]
    keep = tuple(f"mtp{st}.attn.{v}" for st in range(cfg.num_mtp_layers) for v in ("q", "kv", "o"))
    out = run_draft(model, s.state, [anchors[sl] for sl in slots], slots, cached, keep=keep)
    B = cfg.dspark_block_size
    spans = [(0, B), (B, B)]
    for st in range(cfg.num_mtp_layers):
        sink = model[2][f"mtp.{st}.attn.attn_sink"]
        want = naive_block_attn(out[f"mtp{st}.attn.q"], out[f"mtp{st}.attn.kv"], s.state[ring_name(st)],
                                sink, spans, slots, cached, cfg.head_dim ** -0.5)
        torch.testing.assert_close(out[f"mtp{st}.attn.o"], want, rtol=1e-5, atol=1e-5)


def test_draft_rows_layout():
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    ids, pos, req = draft_rows(i64([11, 22]), i64([7, 3]), block=3, noise_id=500)
    assert ids.tolist() == [11, 500, 500, 22, 500, 500]
    assert pos.tolist() == [7, 8, 9, 3, 4, 5]
    assert req.tolist() == [0, 0, 0, 1, 1, 1]


# -- Markov chain and confidence -----------------------------------------------------------------------
def naive_markov(u, z, anchors, E, Hm, cw, B):
    R = len(anchors)
    drafts, conf, logits = [], [], []
    for r in range(R):
        prev = int(anchors[r])
        for i in range(B):
            mu = E[prev]
            li = u[r * B + i] + Hm @ mu
            logits.append(li)
            conf.append(torch.sigmoid(cw[0] @ torch.cat([z[r * B + i], mu])))
            prev = int(li.argmax())
            drafts.append(prev)
    return (torch.tensor(drafts).reshape(R, B), torch.stack(conf).reshape(R, B), torch.stack(logits))


def test_markov_chain_is_sequential():
    torch.manual_seed(1)
    R, B, V, d, k = 2, 5, 50, 12, 6
    u, z = torch.randn(R * B, V), torch.randn(R * B, d)
    E, Hm, cw = torch.randn(V, k), torch.randn(V, k), torch.randn(1, d + k)
    anchors = torch.tensor([3, 41])
    drafts, conf, logits = markov_draft(u, z, anchors, E, Hm, cw, block=B)
    for got, want in zip((drafts, conf, logits), naive_markov(u, z, anchors, E, Hm, cw, B)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # force another first draft: row 1's logits move by head (E[new] - E[old]) through prev
    old = int(drafts[0, 0])
    new = (old + 1) % V
    u2 = u.clone()
    u2[0, new] = 1e4
    d2, c2, l2 = markov_draft(u2, z, anchors, E, Hm, cw, block=B)
    assert int(d2[0, 0]) == new
    torch.testing.assert_close(l2[1] - logits[1], Hm @ (E[new] - E[old]), rtol=1e-4, atol=1e-4)
    assert int(d2[0, 1]) == int(l2[1].argmax())
    torch.testing.assert_close(c2[0, 0], conf[0, 0])  # conf_0 sees mu_0 = embed[x0] only
    assert c2[0, 1] != conf[0, 1]
    torch.testing.assert_close(d2[1], drafts[1])  # the other request is independent
    for got, want in zip((d2, c2, l2), naive_markov(u2, z, anchors, E, Hm, cw, B)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_draft_graph_outputs_follow_the_chain(model):
    cfg, _, w, _, _ = model
    s, anchors = prefilled(model, {1: random_tokens(9, 15)})
    out = run_draft(model, s.state, [anchors[1]], [1], [9], keep=("head.base_logits", "head.z"))
    B, V = cfg.dspark_block_size, cfg.vocab_size
    assert out["drafts"].shape == (1, B) and out["confidence"].shape == (1, B)
    assert out["logits"].shape == (B, V) and out["logits"].dtype == torch.float32
    assert ((out["confidence"] > 0) & (out["confidence"] < 1)).all()
    pre = "mtp.2."
    want = naive_markov(out["head.base_logits"], out["head.z"], [anchors[1]],
                        w[pre + "markov_head.embed.weight"].float(),
                        w[pre + "markov_head.head.weight"].float(),
                        w[pre + "confidence_head.proj.weight"].float(), B)
    assert torch.equal(out["drafts"], want[0])
    torch.testing.assert_close(out["confidence"], want[1], **TOL)
    torch.testing.assert_close(out["logits"], want[2], **TOL)
    assert torch.equal(out["drafts"][0], out["logits"].argmax(dim=-1))


def transcribed_draft(cfg, w, ring_state, anchor, slot, cached):
    """Spec §3.9 written out directly with the reference kernels (no graph): one request."""
    from megagraph.kernels.reference_table import REFERENCE as K
    from megagraph.kernels.dense.structural import merge_heads, split_heads

    B, n, d, eps = cfg.dspark_block_size, cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
    H, D, G = cfg.num_heads, cfg.head_dim, cfg.o_groups
    pos = torch.arange(cached, cached + B)
    rot = dict(rope_dim=cfg.rope_head_dim, theta=cfg.rope_theta)
    mix = dict(eps=eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)

    def lin(x, name):
        return x @ dequantize_weight(w[f"{name}.weight"], w.get(f"{name}.scale"), "fp8_block").t()

    def norm(x, name):
        return K["rms_norm"](x, w[name], eps=eps)

    def site(prefix):
        return [w[f"{prefix}_{k}"] for k in ("fn", "base", "scale")]

    ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (B - 1))
    hs = w["embed.weight"][ids].float()[:, None, :].expand(B, n, d).contiguous()
    pre = torch.zeros(B, n)
    pre[:, 0] = 1.0
    for st in range(cfg.num_mtp_layers):
        p = f"mtp.{st}."
        a_pre, a_post, a_comb = K["hc_mixer"](hs, *site(p + "hc_attn"), **mix)
        x = norm(K["hc_collapse"](hs, pre), p + "attn_norm.weight")
        q = lin(norm(lin(x, p + "attn.wq_a"), p + "attn.q_norm.weight"), p + "attn.wq_b")
        q = rope(split_heads(q, heads=H), pos, **rot)
        kv = fake_quant(rope(norm(lin(x, p + "attn.wkv"), p + "attn.kv_norm.weight"), pos, **rot),
                        fmt="fp8_e4m3", block=32)
        o = naive_block_attn(q, kv, ring_state[ring_name(st)], w[p + "attn.attn_sink"], [(0, B)], [slot],
                             [cached], D ** -0.5)
        o = merge_heads(rope(o, pos, inverse=True, **rot))
        wo_a = dequantize_weight(w[p + "attn.wo_a.weight"], w[p + "attn.wo_a.scale"], "fp8_block")
        o = torch.cat([og @ wg.t() for og, wg in zip(o.chunk(G, dim=-1), wo_a.chunk(G, dim=0))], dim=-1)
        hs = K["hc_expand"](hs, lin(o, p + "attn.wo_b"), a_post, a_comb)
        f_pre, f_post, f_comb = K["hc_mixer"](hs, *site(p + "hc_ffn"), **mix)
        x = norm(K["hc_collapse"](hs, a_pre), p + "ffn_norm.weight")
        e_ids, e_w = K["route"](x, w[p + "ffn.gate.weight"], w[p + "ffn.gate.bias"],
                                topk=cfg.dspark_experts_per_token, route_scale=cfg.route_scale)
        assert e_ids.max() < cfg.dspark_n_routed_experts
        bank = [w[f"{p}ffn.experts.*.{m}.{k}"] for m in ("w1", "w3", "w2") for k in ("weight", "scale")]
        y = K["moe_experts"](x, e_ids, e_w, *bank, fmt="mxfp4", swiglu_limit=cfg.swiglu_limit)
        sh = [w[f"{p}ffn.shared_experts.{m}.{k}"] for m in ("w1", "w3", "w2") for k in ("weight", "scale")]
        y = y + K["swiglu_mlp"](x, *sh, fmt="fp8_block", swiglu_limit=cfg.swiglu_limit)
        hs = K["hc_expand"](hs, y, f_post, f_comb)
        pre = f_pre
    last = f"mtp.{cfg.num_mtp_layers - 1}."
    z = K["hc_collapse"](hs, pre)
    u = norm(z, last + "norm.weight") @ w["head.weight"].float().t()
    return naive_markov(u, z, [anchor], w[last + "markov_head.embed.weight"].float(),
                        w[last + "markov_head.head.weight"].float(),
                        w[last + "confidence_head.proj.weight"].float(), B)


def test_draft_graph_equals_a_direct_transcription_of_the_spec(model):
    cfg, _, w, _, _ = model
    s, anchors = prefilled(model, {2: random_tokens(17, 19)})
    out = run_draft(model, s.state, [anchors[2]], [2], [17])
    drafts, conf, logits = transcribed_draft(cfg, w, s.state, anchors[2], 2, 17)
    # QTOL: the draft's KV is FP8 fake-quantized (block 32) and its input is summed in another
    # order here than in the graph, so an E4M3 rounding can flip (this prompt: 1.4e-3 on logits;
    # three other prompts agree to 1e-4)
    torch.testing.assert_close(out["logits"], logits, **QTOL)
    torch.testing.assert_close(out["confidence"], conf, **QTOL)
    assert torch.equal(out["drafts"], drafts)


def test_drafts_are_deterministic_and_batching_does_not_change_them(model):
    prompts = {0: random_tokens(13, 16), 1: random_tokens(5, 17), 2: random_tokens(21, 18)}
    s, anchors = prefilled(model, prompts)
    order = [2, 0, 1]
    args = ([anchors[sl] for sl in order], order, [s.cached[sl] for sl in order])
    a, b = run_draft(model, s.state, *args), run_draft(model, s.state, *args)
    for k in ("drafts", "confidence", "logits"):
        assert torch.equal(a[k], b[k]), k
    B = model[0].dspark_block_size
    for r, sl in enumerate(order):
        alone = run_draft(model, s.state, [anchors[sl]], [sl], [s.cached[sl]])
        assert torch.equal(a["drafts"][r], alone["drafts"][0])
        torch.testing.assert_close(a["confidence"][r], alone["confidence"][0], **TOL)
        torch.testing.assert_close(a["logits"][r * B:(r + 1) * B], alone["logits"], **TOL)


# -- weights and full-size graphs ------------------------------------------------------------------------
def expected_mtp_weights(cfg) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Spec §2.3 `mtp.*` tensors (shape patterns in config terms): name -> (dtype, shape)."""
    d, V, k, n = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank, cfg.hc_mult
    q, H, D, G, o = cfg.q_lora_rank, cfg.num_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    E, F, blk = cfg.dspark_n_routed_experts, cfg.moe_intermediate_size, cfg.fp8_block
    c = lambda a: -(-a // blk)  # noqa: E731
    out = {}

    def fp8(name, O, I):
        out[f"{name}.weight"] = ("fp8e4m3", (O, I))
        out[f"{name}.scale"] = ("e8m0", (c(O), c(I)))

    for st in range(cfg.num_mtp_layers):
        p = f"mtp.{st}."
        for site in ("attn", "ffn"):
            out[f"{p}hc_{site}_fn"] = ("f32", ((2 + n) * n, n * d))
            out[f"{p}hc_{site}_base"] = ("f32", ((2 + n) * n,))
            out[f"{p}hc_{site}_scale"] = ("f32", (3,))
            out[f"{p}{site}_norm.weight"] = ("bf16", (d,))
        fp8(p + "attn.wq_a", q, d)
        out[p + "attn.q_norm.weight"] = ("bf16", (q,))
        fp8(p + "attn.wq_b", H * D, q)
        fp8(p + "attn.wkv", D, d)
        out[p + "attn.kv_norm.weight"] = ("bf16", (D,))
        fp8(p + "attn.wo_a", G * o, H * D // G)
        fp8(p + "attn.wo_b", d, G * o)
        out[p + "attn.attn_sink"] = ("f32", (H,))
        out[p + "ffn.gate.weight"] = ("bf16", (E, d))
        out[p + "ffn.gate.bias"] = ("f32", (E,))
        fp8(p + "ffn.shared_experts.w1", F, d)
        fp8(p + "ffn.shared_experts.w3", F, d)
        fp8(p + "ffn.shared_experts.w2", d, F)
        for m, (O, I) in (("w1", (F, d)), ("w3", (F, d)), ("w2", (d, F))):
            out[f"{p}ffn.experts.*.{m}.weight"] = ("fp4x2", (E, O, I // 2))
            out[f"{p}ffn.experts.*.{m}.scale"] = ("e8m0", (E, O, I // 32))
    fp8("mtp.0.main_proj", d, len(cfg.dspark_target_layers) * d)
    out["mtp.0.main_norm.weight"] = ("bf16", (d,))
    last = f"mtp.{cfg.num_mtp_layers - 1}."
    out[last + "norm.weight"] = ("bf16", (d,))
    out[last + "markov_head.embed.weight"] = ("bf16", (V, k))
    out[last + "markov_head.head.weight"] = ("bf16", (V, k))
    out[last + "confidence_head.proj.weight"] = ("bf16", (1, d + k))
    return out


def mtp_weights(*graphs):
    got = {}
    for g in graphs:
        for w in g.weights:
            if w.startswith("mtp."):
                t = g.types[w]
                assert got.setdefault(w, (t.dtype, t.shape)) == (t.dtype, t.shape), w
    return got


def test_mtp_weights_match_the_spec_inventory_at_tiny_widths():
    cfg = load_model_config(MODEL)
    g, d = build_step(cfg), build_dspark_draft(cfg)
    assert mtp_weights(g, d) == expected_mtp_weights(cfg)
    # the main step reads only the context projections; the draft graph the rest
    assert set(mtp_weights(g)) == {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale",
                                   "mtp.0.main_norm.weight"} | {
        f"mtp.{st}.attn.{n}" for st in range(3) for n in ("wkv.weight", "wkv.scale", "kv_norm.weight")}
    assert mtp_weights(g, d)["mtp.0.main_proj.weight"] == ("fp8e4m3", (64, 192))  # [d, 3d]
    assert mtp_weights(d)["mtp.2.markov_head.embed.weight"] == ("bf16", (129408, 16))  # [V, rank]
    assert mtp_weights(d)["mtp.2.confidence_head.proj.weight"] == ("bf16", (1, 80))  # [1, d + rank]
    assert {"embed.weight", "head.weight"} <= set(d.weights)  # shared with the backbone


def test_full_size_main_and_draft_graphs_match_the_spec_shapes(monkeypatch):
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    cfg = load_model_config("v4.1-flash")
    g, d = build_step(cfg.replace(name="v4.1-flash-dspark")), build_dspark_draft(cfg)
    assert not made
    got = mtp_weights(g, d)
    assert got == expected_mtp_weights(cfg)
    spec = {  # literal rows of spec §2.3
        "mtp.0.main_proj.weight": ("fp8e4m3", (5120, 15360)), "mtp.0.main_proj.scale": ("e8m0", (160, 480)),
        "mtp.0.main_norm.weight": ("bf16", (5120,)), "mtp.2.norm.weight": ("bf16", (5120,)),
        "mtp.2.markov_head.embed.weight": ("bf16", (129280, 256)),
        "mtp.2.markov_head.head.weight": ("bf16", (129280, 256)),
        "mtp.2.confidence_head.proj.weight": ("bf16", (1, 5376)),
        "mtp.1.attn.wq_b.weight": ("fp8e4m3", (32768, 1280)), "mtp.1.attn.wq_b.scale": ("e8m0", (1024, 40)),
        "mtp.0.attn.wo_a.weight": ("fp8e4m3", (8192, 4096)), "mtp.0.attn.wo_a.scale": ("e8m0", (256, 128)),
        "mtp.2.attn.wkv.weight": ("fp8e4m3", (512, 5120)), "mtp.2.attn.wkv.scale": ("e8m0", (16, 160)),
        "mtp.0.ffn.gate.weight": ("bf16", (128, 5120)), "mtp.0.ffn.gate.bias": ("f32", (128,)),
        "mtp.1.hc_ffn_fn": ("f32", (24, 20480)), "mtp.2.attn.attn_sink": ("f32", (64,)),
        "mtp.0.ffn.experts.*.w1.weight": ("fp4x2", (128, 2304, 2560)),
        "mtp.0.ffn.experts.*.w2.scale": ("e8m0", (128, 5120, 72)),
        "mtp.2.ffn.shared_experts.w2.weight": ("fp8e4m3", (5120, 2304)),
    }
    for name, want in spec.items():
        assert got[name] == want, name
    assert not [w for w in got if ".compressor." in w or ".indexer." in w]
    for st in range(3):
        assert str(g.types[ring_name(st)]) == "bf16[S, 128, 512]" and ring_name(st) in g.state_labels
        assert str(d.types[ring_name(st)]) == "bf16[S, 128, 512]"
    assert not d.state_labels  # the draft graph reads the rings, never writes them
    assert [(lab, str(d.type_of(v))) for lab, v in d.outputs] == [
        ("drafts", "i64[R, 5]"), ("confidence", "f32[R, 5]"), ("logits", "f32[R*5, 129280]")]
    ropes = [n for n in d.nodes if n.op == "rope"] + [n for n in g.nodes if n.op == "rope"
                                                        and n.outputs[0].startswith("dspark.")]
    assert ropes and all(n.attr("theta") == 10000.0 and n.attr("yarn_factor", 1.0) == 1.0 for n in ropes)


@pytest.mark.parametrize("name", ["v4.1-flash", MODEL])
def test_draft_graph_text_round_trip_is_identical(name):
    d = build_dspark_draft(load_model_config(name))
    text = print_graph(d)
    assert print_graph(parse_graph(text)) == text
    assert parse_graph(text) == d
