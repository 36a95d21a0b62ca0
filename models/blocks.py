"""Building blocks shared by the V4 and V4.1 descriptions: step inputs, projections, mHC sites,
the MoE, the attention core and the LM head.

# dims: T tokens in the step, R requests, S state slots, N context capacity per slot,
#       d hidden, n hc streams, H heads, D head dim (= latent), E experts, k top-k
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from megagraph.graph.builder import GraphBuilder
from megagraph.graph.types import T

from .config import ModelConfig
from .weights import Weights

STEP_DIMS = ("T", "R", "S", "N")
META_INPUTS = ("token_ids", "positions", "token_req", "seq_slots", "seq_cached", "seq_new")


@dataclass
class Step:
    """The builder plus the step's metadata value names and cross-layer published state."""

    b: GraphBuilder
    cfg: ModelConfig
    w: Weights
    meta: dict[str, str] = field(default_factory=dict)  # metadata input name -> value
    state_out: dict[str, str] = field(default_factory=dict)  # state label -> updated value

    @classmethod
    def start(cls, cfg: ModelConfig, graph_name: str, **meta) -> "Step":
        b = GraphBuilder(graph_name, STEP_DIMS, model=cfg.name, family=cfg.family, **meta)
        s = cls(b, cfg, Weights(b, cfg))
        s.meta["token_ids"] = b.input("token_ids", T("i64", "T"))
        s.meta["positions"] = b.input("positions", T("i64", "T"))
        s.meta["token_req"] = b.input("token_req", T("i64", "T"))
        s.meta["seq_slots"] = b.input("seq_slots", T("i64", "R"))
        s.meta["seq_cached"] = b.input("seq_cached", T("i64", "R"))
        s.meta["seq_new"] = b.input("seq_new", T("i64", "R"))
        return s

    @property
    def act(self) -> str:
        return self.cfg.act_dtype

    def state(self, name: str, *shape, dtype: str) -> str:
        """Declare a state input; `update(name, value)` records its next value."""
        return self.b.input(name, T(dtype, *shape))

    def update(self, name: str, value: str) -> None:
        self.state_out[name] = value

    def m(self, *names: str) -> tuple[str, ...]:
        return tuple(self.meta[n] for n in names)

    # -- projections ---------------------------------------------------------------------------
    def linear(self, x: str, proj: tuple[str, str | None, str], **kw) -> str:
        w, s, fmt = proj
        return self.b.op("linear", x, w, s, fmt=fmt, **kw)


def rope_attrs(cfg: ModelConfig, ratio: int) -> dict:
    """Window-only layers: plain RoPE at rope_theta; every ratio != 0 layer: compress theta + YaRN."""
    if ratio == 0:
        return {"rope_dim": cfg.rope_head_dim, "theta": cfg.rope_theta}
    return {"rope_dim": cfg.rope_head_dim, "theta": cfg.compress_rope_theta,
            "yarn_factor": cfg.yarn_factor, "yarn_original": cfg.yarn_original,
            "yarn_beta_fast": cfg.yarn_beta_fast, "yarn_beta_slow": cfg.yarn_beta_slow}


def hc_mixer(s: Step, streams: str, prefix: str) -> tuple[str, str, str]:
    """The mHC mixer of one site (`hc_attn` / `hc_ffn`): pre, post, comb for every token."""
    cfg, n, d = s.cfg, s.cfg.hc_mult, s.cfg.hidden_size
    fn = s.w.tensor(f"{prefix}_fn", (2 + n) * n, n * d, dtype="f32")
    base = s.w.tensor(f"{prefix}_base", (2 + n) * n, dtype="f32")
    scale = s.w.tensor(f"{prefix}_scale", 3, dtype="f32")
    return s.b.op("hc_mixer", streams, fn, base, scale, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                  sinkhorn_iters=cfg.hc_sinkhorn_iters, name=("pre", "post", "comb"))


def collapse_norm(s: Step, streams: str, mix: str, norm_weight: str) -> str:
    x = s.b.op("hc_collapse", streams, mix, name="x")
    w = s.w.vector(norm_weight, s.cfg.hidden_size)
    return s.b.op("rms_norm", x, w, eps=s.cfg.rms_norm_eps, name="xn")


def hc_sublayers(s: Step, streams: str, pre_mix: str, prefix: str, attend: Callable[[str], str],
                 layer: int, *, n_experts: int, topk: int) -> tuple[str, str]:
    """A V4.1 block's two mixed sublayers over `streams` (weights under `prefix`): attention, the
    caller's `attend(x)`, then the routed MoE; each collapses the streams by the previous mix,
    normalizes and expands its output back. Returns (streams, the FFN's pre-mix)."""
    b = s.b
    with b.scope("attn"):
        a_pre, a_post, a_comb = hc_mixer(s, streams, f"{prefix}.hc_attn")
        x = collapse_norm(s, streams, pre_mix, f"{prefix}.attn_norm.weight")
        streams = b.op("hc_expand", streams, attend(x), a_post, a_comb, name="streams")
    with b.scope("ffn"):
        f_pre, f_post, f_comb = hc_mixer(s, streams, f"{prefix}.hc_ffn")
        x = collapse_norm(s, streams, a_pre, f"{prefix}.ffn_norm.weight")
        y = moe(s, x, layer, n_experts=n_experts, topk=topk, prefix=f"{prefix}.ffn")
        streams = b.op("hc_expand", streams, y, f_post, f_comb, name="streams")
    return streams, f_pre


def moe(s: Step, x: str, layer: int, *, n_experts: int, topk: int, prefix: str) -> str:
    """Routed experts (sqrtsoftplus router with selection bias) + shared expert, SwiGLU clamped."""
    cfg, d, f = s.cfg, s.cfg.hidden_size, s.cfg.moe_intermediate_size
    gate = s.w.tensor(f"{prefix}.gate.weight", n_experts, d)
    bias = s.w.vector(f"{prefix}.gate.bias", n_experts, dtype="f32")
    ids, weights = s.b.op("route", x, gate, bias, topk=topk, route_scale=cfg.route_scale,
                          norm_topk=cfg.norm_topk, score_func=cfg.score_func, name=("ids", "weights"))
    return experts_and_shared(s, x, ids, weights, n_experts=n_experts, prefix=prefix)


def experts_and_shared(s: Step, x: str, ids: str, weights: str, *, n_experts: int, prefix: str) -> str:
    cfg, d, f = s.cfg, s.cfg.hidden_size, s.cfg.moe_intermediate_size
    w1, s1 = s.w.experts(f"{prefix}.experts.*.w1", n_experts, f, d)
    w3, s3 = s.w.experts(f"{prefix}.experts.*.w3", n_experts, f, d)
    w2, s2 = s.w.experts(f"{prefix}.experts.*.w2", n_experts, d, f)
    routed = s.b.op("moe_experts", x, ids, weights, w1, s1, w3, s3, w2, s2, fmt=s.w.expert_fmt,
                    swiglu_limit=cfg.swiglu_limit, name="routed")
    if not cfg.n_shared_experts:
        return routed
    fs = f * cfg.n_shared_experts
    sh1 = s.w.fp8(f"{prefix}.shared_experts.w1", fs, d)
    sh3 = s.w.fp8(f"{prefix}.shared_experts.w3", fs, d)
    sh2 = s.w.fp8(f"{prefix}.shared_experts.w2", d, fs)
    shared = s.b.op("swiglu_mlp", x, sh1[0], sh1[1], sh3[0], sh3[1], sh2[0], sh2[1], fmt=sh1[2],
                    swiglu_limit=cfg.swiglu_limit, name="shared")
    return s.b.op("add", routed, shared, name="ffn_out")


def attention_core(s: Step, layer: int, q: str, kv: str, *, ratio: int, ckv: str | None,
                   topk: str | None, attend_all: bool = False) -> str:
    """Window + compressed sparse attention with sink, ring update, inverse RoPE, grouped output
    projection. q: [T, H, D] (rotated), kv: [T, D] (rotated, quantized) -> [T, d]."""
    cfg, b = s.cfg, s.b
    h, dd, g = cfg.num_heads, cfg.head_dim, cfg.o_groups
    ring_name = f"L{layer}.ring"
    ring = s.state(ring_name, "S", cfg.sliding_window, dd, dtype=s.act)
    sink = s.w.vector(f"layers.{layer}.attn.attn_sink", h, dtype="f32")
    pos, req, slots, cached = s.m("positions", "token_req", "seq_slots", "seq_cached")
    o = b.op("sparse_attn", q, kv, ring, ckv, topk, sink, pos, req, slots, cached,
             window=cfg.sliding_window, scale=dd ** -0.5, ratio=ratio,
             attend_all_compressed=attend_all or None, name="o")
    s.update(ring_name, b.op("ring_update", ring, kv, pos, req, slots, window=cfg.sliding_window,
                             name="ring.next"))
    o = b.op("rope", o, pos, inverse=True, **rope_attrs(cfg, ratio), name="o_unrot")
    o = b.op("merge_heads", o, name="o_flat")
    wo_a = s.w.fp8(f"layers.{layer}.attn.wo_a", g * cfg.o_lora_rank, h * dd // g)
    z = b.op("grouped_linear", o, wo_a[0], wo_a[1], groups=g, fmt=wo_a[2], name="o_lora")
    return s.linear(z, s.w.fp8(f"layers.{layer}.attn.wo_b", cfg.hidden_size, g * cfg.o_lora_rank),
                    name="attn_out")


def lm_head(s: Step, streams: str, mix: str, logits: str) -> None:
    """Final collapse with the carried mix, norm, fp32 LM head; logits for all rows or the last."""
    cfg, b = s.cfg, s.b
    with b.scope("final"):
        h = collapse_norm(s, streams, mix, "norm.weight")
        if logits == "last":
            h = b.op("select_last", h, s.meta["seq_new"], name="h_last")
        h32 = b.op("cast", h, dtype="f32", name="h32")
        head = s.w.tensor("head.weight", cfg.vocab_size, cfg.hidden_size)
        b.output("logits", b.op("linear", h32, head, None, name="logits"))


def finish(s: Step):
    """Emit the state outputs in declaration order and build (verified) the graph."""
    for name in s.b.inputs:
        if name in s.state_out:
            s.b.output(name, s.state_out[name])
    return s.b.build()
