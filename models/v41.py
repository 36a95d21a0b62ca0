"""DeepSeek-V4.1-Flash as a step graph (spec: shared/reference/v41-flash-architecture.md §3).

Per block: (Engram) -> mHC attention site -> CSA2 attention -> mHC FFN site -> MoE, with the
single-pass hand-off (a site's `pre` collapses the *next* sub-layer's input). CSA2 sharing: KV
sources run the compressor and publish compressed KV + index keys; index sources run the
lightning indexer and publish a top-k list; reuse layers read the latest published list.

# dims: T tokens, R requests, S slots, N context capacity; d hidden, n=4 streams, H heads,
#       D=head_dim latent (K = V), Di index head dim, r compress ratio
"""

from __future__ import annotations

from dataclasses import dataclass

from megagraph.graph.ir import Graph

from .blocks import Step, attention_core, finish, hc_sublayers, lm_head, rope_attrs
from .config import ModelConfig


@dataclass(frozen=True)
class LayerRole:
    """What one V4.1 layer owns and reads (spec §1.2)."""

    layer: int
    ratio: int  # 0 = window only
    kv_owner: int | None  # layer whose compressed KV / index keys this layer reads
    index_owner: int | None  # layer whose published top-k this layer uses
    is_kv_source: bool
    is_index_source: bool
    makes_candidates: bool  # the candidate-source layer (V4.1: 20)
    uses_candidates: bool  # reindex layers after the candidate source
    engram_table: int | None  # index into engram_layers
    # vendor index-key reading (models/index_keys.py): the KV source whose index-key pool, as the
    # step found it, this index source scores against on decode rows its owner's group leaves open
    published_source: int | None = None

    @property
    def kind(self) -> str:
        if self.ratio == 0:
            return "swa"
        if self.is_kv_source:
            return "full"
        return "reindex" if self.is_index_source else "reuse"


def layer_roles(cfg: ModelConfig) -> list[LayerRole]:
    reads = {}
    if cfg.index_key_reading == "vendor":
        from .index_keys import vendor_reads

        reads = vendor_reads(cfg)
    roles = []
    for i, r in enumerate(cfg.compress_ratios):
        kv_owner = max((s for s in cfg.kv_source_layers if s <= i and cfg.compress_ratios[s] == r),
                       default=None) if r else None
        idx_owner = max((s for s in cfg.index_source_layers if s <= i and cfg.compress_ratios[s] == r),
                        default=None) if r else None
        cand = cfg.candidate_source_layer
        roles.append(LayerRole(
            i, r, kv_owner, idx_owner, i in cfg.kv_source_layers, i in cfg.index_source_layers,
            cand == i, cand is not None and i in cfg.index_source_layers and i > cand
            and cfg.compress_ratios[cand] == r,
            cfg.engram_layers.index(i) if i in cfg.engram_layers else None, reads.get(i)))
    return roles


def build_v41_step(cfg: ModelConfig, *, logits: str = "all") -> Graph:
    """The graph of one engine step (prefill chunks, decode rows, or a mix)."""
    s = Step.start(cfg, f"{cfg.name}/step", logits=logits)
    b = s.b
    published: dict[str, str] = {}  # "ckv.<owner>", "ikey.<owner>", "topk.<owner>", "cand"
    emb = b.op("embed", s.meta["token_ids"], s.w.tensor("embed.weight", cfg.vocab_size, cfg.hidden_size),
               name="emb")
    if b.type_of(emb).dtype != s.act:
        emb = b.op("cast", emb, dtype=s.act, name="emb_act")
    streams, pre_mix = b.op("hc_embed", emb, n_hc=cfg.hc_mult, name=("streams", "pre_mix"))
    cids = None
    if cfg.engram_layers:
        from .engram import engram_prologue

        cids = engram_prologue(s)
    for role in layer_roles(cfg):
        with b.scope(f"L{role.layer}"):
            streams, pre_mix = block(s, role, streams, pre_mix, published, cids)
    if cfg.num_mtp_layers > 0:  # DSpark draft context rings (models/dspark.py)
        from .dspark import draft_context

        draft_context(s, published)
    lm_head(s, streams, pre_mix, logits)
    return finish(s)


def block(s: Step, role: LayerRole, streams: str, pre_mix: str, published: dict, cids):
    cfg, b, i = s.cfg, s.b, role.layer
    if role.engram_table is not None:
        from .engram import engram_block

        with b.scope("engram"):
            streams = engram_block(s, role.layer, role.engram_table, streams, cids)
    if cfg.num_mtp_layers > 0 and i in cfg.dspark_target_layers:  # DSpark target feature (§3.9)
        published[f"dspark_feat.{i}"] = b.op("stream_mean", streams, name="dspark_feat")
    return hc_sublayers(s, streams, pre_mix, f"layers.{i}",
                        lambda x: attention(s, role, x, published), i,
                        n_experts=cfg.n_routed_experts, topk=cfg.experts_per_token)


def attention(s: Step, role: LayerRole, x: str, published: dict) -> str:
    """CSA2 attention of one layer: q/kv projections, compressor + indexer by role, sparse attention."""
    cfg, b, i, r = s.cfg, s.b, role.layer, role.ratio
    pfx = f"layers.{i}.attn"
    pos = s.meta["positions"]
    rope = rope_attrs(cfg, r)
    q_lat = b.op("rms_norm", s.linear(x, s.w.fp8(f"{pfx}.wq_a", cfg.q_lora_rank, cfg.hidden_size),
                                      name="q_a"),
                 s.w.vector(f"{pfx}.q_norm.weight", cfg.q_lora_rank), eps=cfg.rms_norm_eps, name="q_lat")
    q = s.linear(q_lat, s.w.fp8(f"{pfx}.wq_b", cfg.num_heads * cfg.head_dim, cfg.q_lora_rank), name="q_flat")
    q = b.op("split_heads", q, heads=cfg.num_heads, name="q_heads")
    q = b.op("rope", q, pos, **rope, name="q")
    kv = b.op("rms_norm", s.linear(x, s.w.fp8(f"{pfx}.wkv", cfg.head_dim, cfg.hidden_size), name="kv_a"),
              s.w.vector(f"{pfx}.kv_norm.weight", cfg.head_dim), eps=cfg.rms_norm_eps, name="kv_norm")
    kv = b.op("rope", kv, pos, **rope, name="kv_rot")
    if cfg.quantize_kv:
        kv = b.op("fake_quant", kv, fmt="fp8_e4m3", block=32, name="kv")
    ckv = topk = None
    if r:
        if role.is_kv_source:
            with b.scope("compressor"):
                compressor(s, role, x, published)
        if role.is_index_source:
            with b.scope("indexer"):
                indexer(s, role, x, q_lat, published)
        ckv = published[f"ckv.{role.kv_owner}"]
        topk = published[f"topk.{role.index_owner}"]
    return attention_core(s, i, q, kv, ratio=r, ckv=ckv, topk=topk)


def compressor(s: Step, role: LayerRole, x: str, published: dict) -> None:
    """KV source (spec §3.4.3): pool `ratio` tokens (softmax-gated; ratio 1 = projection only),
    norm, then index key (pre-RoPE latent -> wk -> k_norm -> RoPE -> MXFP4, stored bf16; f32
    without quantize_kv) and compressed KV (RoPE -> NVFP4), both written into this owner's caches
    at the group's entry."""
    cfg, b, i, r = s.cfg, s.b, role.layer, role.ratio
    pfx = f"layers.{i}.attn"
    dd, di = cfg.head_dim, cfg.index_head_dim
    pos, req, slots = s.m("positions", "token_req", "seq_slots")
    x32 = b.op("cast", x, dtype="f32", name="x32")
    kv_proj = s.linear(x32, s.w.bf16(f"{pfx}.compressor.wkv", dd, cfg.hidden_size), name="kv_proj")
    if r > 1:
        gate_proj = s.linear(x32, s.w.bf16(f"{pfx}.compressor.wgate", dd, cfg.hidden_size),
                             name="gate_proj")
        pk = s.state(f"L{i}.pend_kv", "S", r, dd, dtype="f32")
        pg = s.state(f"L{i}.pend_gate", "S", r, dd, dtype="f32")
        latent, pk2, pg2 = b.op("compress_pool", kv_proj, gate_proj, pk, pg, pos, req, slots, ratio=r,
                                name=("latent_raw", "pend_kv.next", "pend_gate.next"))
        s.update(f"L{i}.pend_kv", pk2)
        s.update(f"L{i}.pend_gate", pg2)
    else:
        latent = kv_proj
    latent = b.op("rms_norm", latent, s.w.vector(f"{pfx}.compressor.norm.weight", dd),
                  eps=cfg.rms_norm_eps, name="latent")
    rope = dict(rope_attrs(cfg, r), offset=1 - r)  # a group is rotated at its first token's position
    cap = _capacity(r)
    ik = s.linear(latent, s.w.bf16(f"{pfx}.indexer.wk", di, dd), name="ik_proj")
    ik = b.op("rms_norm", ik, s.w.vector(f"{pfx}.indexer.k_norm.weight", di), eps=cfg.rms_norm_eps,
              name="ik_norm")
    ik = b.op("rope", ik, pos, **rope, name="ik_rot")
    if cfg.quantize_kv:
        ik = b.op("fake_quant", ik, fmt="mxfp4", block=32, name="ik")
    ikey = b.op("cache_write", ikey_pool(s, i), ik, pos, req, slots, ratio=r, name="ikey.next")
    s.update(f"L{i}.ikey", ikey)
    c = b.op("rope", latent, pos, **rope, name="ckv_rot")
    if cfg.quantize_kv:
        c = b.op("fake_quant", c, fmt="nvfp4", block=16, name="ckv_row")
    c = b.op("cast", c, dtype=s.act, name="ckv_row_act")
    ckv = s.state(f"L{i}.ckv", "S", cap, dd, dtype=s.act)
    ckv = b.op("cache_write", ckv, c, pos, req, slots, ratio=r, name="ckv.next")
    s.update(f"L{i}.ckv", ckv)
    published[f"ckv.{i}"] = ckv
    published[f"ikey.{i}"] = ikey


def _capacity(ratio: int) -> str:
    return "N" if ratio == 1 else f"N/{ratio}"


def ikey_pool(s: Step, layer: int) -> str:
    """The state input holding KV source `layer`'s index keys, declared at its first use (its own
    compressor, or an earlier indexer reading it under the vendor reading).

    MXFP4 keys (E2M1 x a power-of-two scale: at most 2 significant bits, within fp32's exponent
    range) are exact in bf16: the cache holds them in half the bytes, and cache_write's cast after
    the fake-quant is exact. Unquantized keys are not, so they stay f32."""
    cfg, name = s.cfg, f"L{layer}.ikey"
    if name in s.b.types:
        return name
    return s.state(name, "S", _capacity(cfg.compress_ratios[layer]), cfg.index_head_dim,
                   dtype="bf16" if cfg.quantize_kv else "f32")


def indexer(s: Step, role: LayerRole, x: str, q_lat: str, published: dict) -> None:
    """Index source (spec §3.4.4): ReLU-weighted scores of index queries against the owner's index
    keys, candidate blocks (made at the candidate source, consumed by later reindex layers), top-k
    sorted ascending, published for the reuse layers that follow. Under the vendor index-key
    reading (models/index_keys.py) the decode rows whose owner leaves a group open score against
    the published source's pool instead (`published_scores` picks per row)."""
    cfg, b, i, r = s.cfg, s.b, role.layer, role.ratio
    pfx = f"layers.{i}.attn.indexer"
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    pos, req, slots = s.m("positions", "token_req", "seq_slots")
    qi = s.linear(q_lat, s.w.fp8(f"{pfx}.wq_b", hi * di, cfg.q_lora_rank), name="qi_flat")
    qi = b.op("split_heads", qi, heads=hi, name="qi_heads")
    qi = b.op("rope", qi, pos, **rope_attrs(cfg, r), name="qi_rot")
    if cfg.quantize_kv:
        qi = b.op("fake_quant", qi, fmt="mxfp4", block=32, name="qi")
    wts = s.linear(x, s.w.bf16(f"{pfx}.weights_proj", hi, cfg.hidden_size), name="head_weights")
    scale = (di ** -0.5) * (hi ** -0.5)
    scores = b.op("index_scores", qi, wts, published[f"ikey.{role.kv_owner}"], pos, req, slots,
                  ratio=r, weight_scale=scale, name="scores")
    if role.published_source is not None:
        src = role.published_source
        pub = b.op("index_scores", qi, wts, ikey_pool(s, src), pos, req, slots, ratio=r,
                   weight_scale=scale, name="scores_published")
        scores = b.op("published_scores", scores, pub, pos, req, s.meta["seq_cached"], ratio=r,
                      published_ratio=cfg.compress_ratios[src], name="scores_read")
    mask = None
    if role.makes_candidates:
        published["cand"] = b.op("candidate_mask", scores, block=cfg.candidate_block_size,
                                 topk_blocks=cfg.candidate_topk_blocks, name="candidates")
    elif role.uses_candidates:
        mask = published["cand"]
    published[f"topk.{i}"] = b.op("topk_select", scores, mask, k=cfg.index_topk, name="topk")
