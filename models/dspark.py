"""DeepSeek-V4.1 DSpark block drafter as graphs (spec §3.9, §4.1; weights §2.3 `mtp.*`).

Two pieces:

* `draft_context(s, published)` — called by the main step builder (models/v41.py) when
  `num_mtp_layers > 0`: the target features F(t) = concat of the stream means at the inputs of the
  `dspark_target_layers` (captured in the main blocks, `L<i>.dspark_feat`), projected
  `main_x = main_norm(main_proj F)` (stage-0 weights), and per stage S the draft context rows
  `kvS = fake_quant_fp8(RoPE_base(kv_norm_S(wkv_S main_x)))` written into the state ring
  `mtp.S.ring` [S, W, D] with `ring_update` (same layout as the main layers' `L<i>.ring`). So every
  main step (prefill chunk, decode, multi-row verify) keeps the draft rings in step with the
  committed tokens; the rings hold the main stream's keys, never the drafts'.
* `build_dspark_draft(cfg)` — the draft graph: per request, B = dspark_block_size rows (row 0 =
  the anchor x0 the main model produced for position P+1, rows 1.. = the noise token) at
  positions P+1 .. P+B, three V4.1-style blocks (single-pass mHC, attn_norm, attention, ffn_norm,
  MoE with the stage's own expert bank) whose attention reads the stage's ring (positions
  P-W+1 .. P, all visible) plus the block's own rows non-causally (`block_attn`), then the last
  stage's collapse z, base logits U = head(norm(z)) and the sequential Markov chain with the
  confidence head (`markov_draft`). It reads the draft rings and updates no state.

# dims: R requests, S state slots; rows R*B (B = dspark_block_size, request-major);
#       d hidden, n = 4 streams, H heads, D = head_dim latent (K = V), W = sliding_window
"""

from __future__ import annotations

from megagraph.graph.builder import GraphBuilder
from megagraph.graph.ir import Graph
from megagraph.graph.types import T

from .blocks import Step, hc_sublayers, rope_attrs
from .config import ModelConfig
from .weights import Weights

DRAFT_DIMS = ("R", "S")


def _check(cfg: ModelConfig) -> None:
    if not cfg.is_v41 or cfg.num_mtp_layers <= 0:
        raise ValueError(f"{cfg.name}: DSpark needs a V4.1 config with num_mtp_layers > 0")
    if not cfg.dspark_target_layers or not all(0 <= i < cfg.num_layers for i in cfg.dspark_target_layers):
        raise ValueError(f"{cfg.name}: dspark_target_layers {list(cfg.dspark_target_layers)} must be "
                         f"non-empty layer ids in 0..{cfg.num_layers - 1}")
    if not 0 < cfg.dspark_experts_per_token <= cfg.dspark_n_routed_experts:
        raise ValueError(f"{cfg.name}: need 0 < dspark_experts_per_token <= dspark_n_routed_experts")
    if cfg.dspark_block_size < 1 or not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        raise ValueError(f"{cfg.name}: bad dspark_block_size / dspark_noise_token_id")


def ring_name(stage: int) -> str:
    """State name of stage `stage`'s draft context ring."""
    return f"mtp.{stage}.ring"


def context_kv(s: Step, stage: int, x: str, pos: str) -> str:
    """A stage's draft key/value rows from x [T, d] at `pos` (base RoPE, FP8 fake-quant):
    used for the context (x = main_x) and for the draft block's own rows."""
    cfg, b = s.cfg, s.b
    pfx = f"mtp.{stage}.attn"
    kv = b.op("rms_norm", s.linear(x, s.w.fp8(f"{pfx}.wkv", cfg.head_dim, cfg.hidden_size), name="kv_a"),
              s.w.vector(f"{pfx}.kv_norm.weight", cfg.head_dim), eps=cfg.rms_norm_eps, name="kv_norm")
    kv = b.op("rope", kv, pos, **rope_attrs(cfg, 0), name="kv_rot")
    if cfg.quantize_kv:
        kv = b.op("fake_quant", kv, fmt="fp8_e4m3", block=32, name="kv")
    return kv


# -- main-step part ------------------------------------------------------------------------------
def draft_context(s: Step, published: dict[str, str]) -> None:
    """Target features -> main_x -> each stage's context rows -> `mtp.S.ring` state updates.

    published["dspark_feat.<i>"]: the stream mean [T, d] at the input of target layer i
    (emitted by models/v41.py's `block`, after any Engram, before the attention mixer)."""
    cfg, b = s.cfg, s.b
    _check(cfg)
    feats = [published[f"dspark_feat.{i}"] for i in cfg.dspark_target_layers]
    d, W = cfg.hidden_size, cfg.sliding_window
    pos, req, slots = s.m("positions", "token_req", "seq_slots")
    with b.scope("dspark"):
        f = b.op("concat", *feats, name="features")
        proj = s.linear(f, s.w.fp8("mtp.0.main_proj", d, len(feats) * d), name="main_proj")
        main_x = b.op("rms_norm", proj, s.w.vector("mtp.0.main_norm.weight", d), eps=cfg.rms_norm_eps,
                      name="main_x")
        for st in range(cfg.num_mtp_layers):
            with b.scope(f"mtp{st}"):
                kv = context_kv(s, st, main_x, pos)
                ring = s.state(ring_name(st), "S", W, cfg.head_dim, dtype=s.act)
                s.update(ring_name(st), b.op("ring_update", ring, kv, pos, req, slots, window=W,
                                             name="ring.next"))


# -- the draft graph -------------------------------------------------------------------------------
def build_dspark_draft(cfg: ModelConfig) -> Graph:
    """The DSpark draft step: inputs anchor_ids i64[R], seq_slots i64[R], seq_cached i64[R]
    (= P+1) and the rings `mtp.S.ring` (read only); outputs drafts i64[R, B], confidence
    f32[R, B] and logits f32[R*B, V] (the Markov chain's per-row logits).

    `confidence` is a probability in (0, 1), not a logit: sigmoid(confidence_head.proj ·
    [z_i ; mu_i]) with the pre-norm collapse z_i, as spec §3.9 gives it (an estimated acceptance
    probability), so a caller thresholds it directly (e.g. verify drafts while conf > 0.5).
    Its weights and every other `mtp.*` tensor load with the model:
    `models.load.load_weights(cfg, [step_graph, draft_graph], ckpt)`."""
    _check(cfg)
    B, n_st = cfg.dspark_block_size, cfg.num_mtp_layers
    b = GraphBuilder(f"{cfg.name}/dspark_draft", DRAFT_DIMS, model=cfg.name, family=cfg.family,
                     step="dspark_draft", block=B)
    s = Step(b, cfg, Weights(b, cfg))
    anchor = b.input("anchor_ids", T("i64", "R"))
    s.meta["seq_slots"] = b.input("seq_slots", T("i64", "R"))
    s.meta["seq_cached"] = b.input("seq_cached", T("i64", "R"))
    rings = [s.state(ring_name(st), "S", cfg.sliding_window, cfg.head_dim, dtype=s.act)
             for st in range(n_st)]
    ids, pos, req = b.op("draft_rows", anchor, s.meta["seq_cached"], block=B,
                         noise_id=cfg.dspark_noise_token_id, name=("token_ids", "positions", "token_req"))
    s.meta.update(token_ids=ids, positions=pos, token_req=req)
    emb = b.op("embed", ids, s.w.tensor("embed.weight", cfg.vocab_size, cfg.hidden_size), name="emb")
    if b.type_of(emb).dtype != s.act:
        emb = b.op("cast", emb, dtype=s.act, name="emb_act")
    streams, pre_mix = b.op("hc_embed", emb, n_hc=cfg.hc_mult, name=("streams", "pre_mix"))
    for st in range(n_st):
        with b.scope(f"mtp{st}"):
            streams, pre_mix = draft_stage(s, st, streams, pre_mix, rings[st])
    last = f"mtp.{n_st - 1}"
    with b.scope("head"):
        z = b.op("hc_collapse", streams, pre_mix, name="z")
        zn = b.op("rms_norm", z, s.w.vector(f"{last}.norm.weight", cfg.hidden_size), eps=cfg.rms_norm_eps,
                  name="zn")
        zn32 = b.op("cast", zn, dtype="f32", name="zn32")
        u = b.op("linear", zn32, s.w.tensor("head.weight", cfg.vocab_size, cfg.hidden_size), None,
                 name="base_logits")
        rank = cfg.dspark_markov_rank
        drafts, conf, logits = b.op(
            "markov_draft", u, z, anchor,
            s.w.tensor(f"{last}.markov_head.embed.weight", cfg.vocab_size, rank),
            s.w.tensor(f"{last}.markov_head.head.weight", cfg.vocab_size, rank),
            s.w.tensor(f"{last}.confidence_head.proj.weight", 1, cfg.hidden_size + rank),
            block=B, name=("drafts", "confidence", "logits"))
    b.output("drafts", drafts)
    b.output("confidence", conf)
    b.output("logits", logits)
    return b.build()


def draft_stage(s: Step, st: int, streams: str, pre_mix: str, ring: str) -> tuple[str, str]:
    """One DSpark stage: a V4.1 block with block attention and the stage's expert bank."""
    cfg = s.cfg
    return hc_sublayers(s, streams, pre_mix, f"mtp.{st}", lambda x: draft_attention(s, st, x, ring),
                        st, n_experts=cfg.dspark_n_routed_experts,
                        topk=cfg.dspark_experts_per_token)


def draft_attention(s: Step, st: int, x: str, ring: str) -> str:
    """q/kv projections (base RoPE), block attention over ring + block, inverse RoPE, grouped
    output projection (spec §3.4.1, §3.4.5, §3.4.6 with stage weights `mtp.S.attn.*`)."""
    cfg, b = s.cfg, s.b
    pfx = f"mtp.{st}.attn"
    h, dd, g = cfg.num_heads, cfg.head_dim, cfg.o_groups
    pos, req, slots, cached = s.m("positions", "token_req", "seq_slots", "seq_cached")
    rope = rope_attrs(cfg, 0)
    q_lat = b.op("rms_norm", s.linear(x, s.w.fp8(f"{pfx}.wq_a", cfg.q_lora_rank, cfg.hidden_size),
                                      name="q_a"),
                 s.w.vector(f"{pfx}.q_norm.weight", cfg.q_lora_rank), eps=cfg.rms_norm_eps, name="q_lat")
    q = s.linear(q_lat, s.w.fp8(f"{pfx}.wq_b", h * dd, cfg.q_lora_rank), name="q_flat")
    q = b.op("split_heads", q, heads=h, name="q_heads")
    q = b.op("rope", q, pos, **rope, name="q")
    kv = context_kv(s, st, x, pos)
    sink = s.w.vector(f"{pfx}.attn_sink", h, dtype="f32")
    o = b.op("block_attn", q, kv, ring, sink, pos, req, slots, cached, window=cfg.sliding_window,
             scale=dd ** -0.5, name="o")
    o = b.op("rope", o, pos, inverse=True, **rope, name="o_unrot")
    o = b.op("merge_heads", o, name="o_flat")
    wo_a = s.w.fp8(f"{pfx}.wo_a", g * cfg.o_lora_rank, h * dd // g)
    z = b.op("grouped_linear", o, wo_a[0], wo_a[1], groups=g, fmt=wo_a[2], name="o_lora")
    return s.linear(z, s.w.fp8(f"{pfx}.wo_b", cfg.hidden_size, g * cfg.o_lora_rank), name="attn_out")
