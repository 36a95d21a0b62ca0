"""DeepSeek-V4-Flash as a step graph (spec §3.11; the parity target's math: docs/transformers-v4.md).

Per block: standard mHC (each site's own `pre` collapses its input) around attention and MoE.
Attention types by compress ratio: 0 = sliding window only; 4 = CSA (overlapping compressor with
APE + its own lightning indexer with its own compressor, top-k); 128 = HCA (non-overlapping
compressor with APE, attends every visible compressed entry). Layers below num_hash_layers route by
a token-id table (tid2eid). The final collapse uses hc_head weights.

# dims: T tokens, R requests, S slots, N context capacity; d hidden, n=4 streams, H heads,
#       D=head_dim latent (K = V), Di index head dim, r compress ratio, c = 2 if overlapping
"""

from __future__ import annotations

from megagraph.graph.ir import Graph

from .blocks import Step, attention_core, collapse_norm, experts_and_shared, finish, hc_mixer, moe, rope_attrs
from .config import ModelConfig

CSA_RATIO = 4  # the overlapping, indexed type; every other nonzero ratio is HCA


def build_v4_step(cfg: ModelConfig, *, logits: str = "all") -> Graph:
    s = Step.start(cfg, f"{cfg.name}/step", logits=logits)
    b = s.b
    emb = b.op("embed", s.meta["token_ids"], s.w.tensor("embed.weight", cfg.vocab_size, cfg.hidden_size),
               name="emb")
    if b.type_of(emb).dtype != s.act:
        emb = b.op("cast", emb, dtype=s.act, name="emb_act")
    streams, _ = b.op("hc_embed", emb, n_hc=cfg.hc_mult, name=("streams", "initial_mix"))
    for i, r in enumerate(cfg.compress_ratios):
        with b.scope(f"L{i}"):
            for site in ("attn", "ffn"):
                with b.scope(site):
                    pre, post, comb = hc_mixer(s, streams, f"layers.{i}.hc_{site}")
                    x = collapse_norm(s, streams, pre, f"layers.{i}.{site}_norm.weight")
                    y = attention(s, i, r, x) if site == "attn" else ffn(s, i, x)
                    streams = b.op("hc_expand", streams, y, post, comb, name="streams")
    n, d = cfg.hc_mult, cfg.hidden_size
    with b.scope("final"):
        mix = b.op("hc_head_mix", streams, s.w.tensor("hc_head_fn", n, n * d, dtype="f32"),
                   s.w.tensor("hc_head_base", n, dtype="f32"), s.w.tensor("hc_head_scale", 1, dtype="f32"),
                   eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, name="mix")
    from .blocks import lm_head

    lm_head(s, streams, mix, logits)
    return finish(s)


def ffn(s: Step, i: int, x: str) -> str:
    cfg, b = s.cfg, s.b
    if i >= cfg.num_hash_layers:
        return moe(s, x, i, n_experts=cfg.n_routed_experts, topk=cfg.experts_per_token,
                   prefix=f"layers.{i}.ffn")
    gate = s.w.tensor(f"layers.{i}.ffn.gate.weight", cfg.n_routed_experts, cfg.hidden_size)
    table = s.w.tensor(f"layers.{i}.ffn.gate.tid2eid", cfg.vocab_size, cfg.experts_per_token, dtype="i64")
    ids, weights = b.op("hash_route", x, gate, table, s.meta["token_ids"], topk=cfg.experts_per_token,
                        route_scale=cfg.route_scale, score_func=cfg.score_func, name=("ids", "weights"))
    return experts_and_shared(s, x, ids, weights, n_experts=cfg.n_routed_experts, prefix=f"layers.{i}.ffn")


def attention(s: Step, i: int, r: int, x: str) -> str:
    cfg, b = s.cfg, s.b
    pfx = f"layers.{i}.attn"
    pos = s.meta["positions"]
    rope = rope_attrs(cfg, r)
    q_lat = b.op("rms_norm", s.linear(x, s.w.fp8(f"{pfx}.wq_a", cfg.q_lora_rank, cfg.hidden_size), name="q_a"),
                 s.w.vector(f"{pfx}.q_norm.weight", cfg.q_lora_rank), eps=cfg.rms_norm_eps, name="q_lat")
    q = s.linear(q_lat, s.w.fp8(f"{pfx}.wq_b", cfg.num_heads * cfg.head_dim, cfg.q_lora_rank), name="q_flat")
    q = b.op("split_heads", q, heads=cfg.num_heads, name="q_heads")
    q = b.op("rms_norm", q, None, eps=cfg.rms_norm_eps, name="q_headnorm")  # weightless, per head
    q = b.op("rope", q, pos, **rope, name="q")
    kv = b.op("rms_norm", s.linear(x, s.w.fp8(f"{pfx}.wkv", cfg.head_dim, cfg.hidden_size), name="kv_a"),
              s.w.vector(f"{pfx}.kv_norm.weight", cfg.head_dim), eps=cfg.rms_norm_eps, name="kv_norm")
    kv = b.op("rope", kv, pos, **rope, name="kv")
    if r == 0:
        return attention_core(s, i, q, kv, ratio=0, ckv=None, topk=None)
    csa = r == CSA_RATIO
    with b.scope("compressor"):
        ckv = compressor(s, i, r, x, f"{pfx}.compressor", cfg.head_dim, overlap=csa, cache="ckv")
    topk = None
    if csa:
        with b.scope("indexer"):
            topk = indexer(s, i, r, x, q_lat)
    return attention_core(s, i, q, kv, ratio=r, ckv=ckv, topk=topk, attend_all=not csa)


def compressor(s: Step, i: int, r: int, x: str, pfx: str, width: int, *, overlap: bool, cache: str) -> str:
    """Project (2D wide when overlapping), pool with APE, norm, RoPE at the group's first position,
    write the entry into this layer's cache `cache` (ckv or ikey)."""
    cfg, b = s.cfg, s.b
    c = 2 if overlap else 1
    pos, req, slots = s.m("positions", "token_req", "seq_slots")
    x32 = b.op("cast", x, dtype="f32", name="x32")
    kv_proj = s.linear(x32, s.w.bf16(f"{pfx}.wkv", c * width, cfg.hidden_size), name="kv_proj")
    gate_proj = s.linear(x32, s.w.bf16(f"{pfx}.wgate", c * width, cfg.hidden_size), name="gate_proj")
    ape = s.w.tensor(f"{pfx}.ape", r, c * width, dtype="f32")
    tag = f"L{i}.{cache}"
    pk = s.state(f"{tag}.pend_kv", "S", c * r, c * width, dtype="f32")
    pg = s.state(f"{tag}.pend_gate", "S", c * r, c * width, dtype="f32")
    latent, pk2, pg2 = b.op("v4_compress_pool", kv_proj, gate_proj, ape, pk, pg, pos, req, slots,
                            ratio=r, overlap=overlap, name=("latent_raw", "pend_kv.next", "pend_gate.next"))
    s.update(f"{tag}.pend_kv", pk2)
    s.update(f"{tag}.pend_gate", pg2)
    latent = b.op("rms_norm", latent, s.w.vector(f"{pfx}.norm.weight", width), eps=cfg.rms_norm_eps,
                  name="latent")
    rows = b.op("rope", latent, pos, offset=1 - r, **rope_attrs(cfg, r), name="rows")
    dtype = s.act if cache == "ckv" else "f32"
    if dtype != "f32":
        rows = b.op("cast", rows, dtype=dtype, name="rows_act")
    state = s.state(tag, "S", f"N/{r}", width, dtype=dtype)
    out = b.op("cache_write", state, rows, pos, req, slots, ratio=r, name=f"{cache}.next")
    s.update(tag, out)
    return out


def indexer(s: Step, i: int, r: int, x: str, q_lat: str) -> str:
    cfg, b = s.cfg, s.b
    pfx = f"layers.{i}.attn.indexer"
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    pos, req, slots = s.m("positions", "token_req", "seq_slots")
    with b.scope("keys"):
        ikey = compressor(s, i, r, x, f"{pfx}.compressor", di, overlap=True, cache="ikey")
    qi = s.linear(q_lat, s.w.fp8(f"{pfx}.wq_b", hi * di, cfg.q_lora_rank), name="qi_flat")
    qi = b.op("split_heads", qi, heads=hi, name="qi_heads")
    qi = b.op("rope", qi, pos, **rope_attrs(cfg, r), name="qi")
    w = s.linear(x, s.w.bf16(f"{pfx}.weights_proj", hi, cfg.hidden_size), name="head_weights")
    scores = b.op("index_scores", qi, w, ikey, pos, req, slots, ratio=r,
                  weight_scale=(di ** -0.5) * (hi ** -0.5), name="scores")
    return b.op("topk_select", scores, None, k=cfg.index_topk, name="topk")
