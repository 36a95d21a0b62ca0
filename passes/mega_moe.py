"""Mega-mHC -> MegaMoE: rewrite each FFN site into a `mega_mhc` -> `mega_moe` pair.

At an FFN site the mHC mixer, the stream collapse, the FFN norm and the activation quantization
feed the MoE (router, top-k, dispatch, expert GEMMs, combine, shared expert) and the residual
expand. Unfused, every step between them round-trips activations through memory. Fused, only the
tensors in the two ops' signatures cross: x (for the router's bf16 gate GEMM), x_q/x_scale (the
experts' FP8 input), pre (to the next layer), post/comb (to the residual expand), and the new
streams. On Blackwell this is DeepGEMM's `mega_mhc` writing straight into `fp8_fp4_mega_moe`'s
symmetric buffer; on Hopper our Triton path (kernels/moe/triton.py, mhc.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megagraph.graph.ir import Graph, Node
from megagraph.graph.registry import get_op

from .base import FusionPass, PassResult, Rewrite, escapes, layer_of, register_pass


class NoMatch(Exception):
    """This FFN site does not have the expected shape; the message says what differs."""


@register_pass
@dataclass(frozen=True)
class MegaMoeFusion(FusionPass):
    """Fuse each FFN site (mHC front half + MoE + residual expand) into mega_mhc -> mega_moe.

    before (one FFN site, after quantize-epilogues):
      %L0.ffn.pre, %L0.ffn.post, %L0.ffn.comb = hc_mixer(%L0.attn.streams, @fn, @base, @scale)
      %L0.ffn.x = hc_collapse(%L0.attn.streams, %L0.attn.pre)
      %L0.ffn.xn = rms_norm(%L0.ffn.x, @layers.0.ffn_norm.weight)
      %L0.ffn.xn.q, %L0.ffn.xn.qscale = quantize_act(%L0.ffn.xn) {act_fmt="mxfp8"}
      %L0.ffn.ids, %L0.ffn.weights = route(%L0.ffn.xn, @gate.weight, @gate.bias) {topk=2, ...}
      %L0.ffn.routed = moe_experts_q(%L0.ffn.xn.q, %L0.ffn.xn.qscale, %L0.ffn.ids, ...)
      %L0.ffn.shared = swiglu_mlp_q(%L0.ffn.xn.q, %L0.ffn.xn.qscale, ...)
      %L0.ffn.ffn_out = add(%L0.ffn.routed, %L0.ffn.shared)
      %L0.ffn.streams = hc_expand(%L0.attn.streams, %L0.ffn.ffn_out, %L0.ffn.post, %L0.ffn.comb)
    after:
      %L0.ffn.xn, %L0.ffn.xn.q, %L0.ffn.xn.qscale, %L0.ffn.pre, %L0.ffn.post, %L0.ffn.comb =
          mega_mhc(%L0.attn.streams, @fn, @base, @scale, %L0.attn.pre, @ffn_norm) {act_fmt="mxfp8", ...}
      %L0.ffn.streams = mega_moe(%L0.ffn.xn, %L0.ffn.xn.q, %L0.ffn.xn.qscale, %L0.attn.streams,
          %L0.ffn.post, %L0.ffn.comb, @gate.weight, @gate.bias, <experts>, <shared>) {topk=2, ...}

    Requires the FFN input to be quantized already (quantize-epilogues runs first), and every
    intermediate to be read only inside the site. Fires where the profile lists `mega_moe`.
    """

    name: ClassVar[str] = "mega-moe-fusion"
    fusion: ClassVar[str] = "mega_moe"
    kernel: ClassVar[str] = "fused MoE kernel"

    def fuse(self, g: Graph, how) -> PassResult:
        expands = [n for n in g.nodes if n.op == "hc_expand"]
        rw = Rewrite(g, self.name)
        prod, users = g.producers(), g.users()
        fused, misses, sites = [], [], 0
        for e in expands:
            y = prod.get(e.inputs[1])
            if y is None or y.op not in ("add", "moe_experts", "moe_experts_q"):
                continue  # an attention site (or an expand fed by something else)
            sites += 1
            try:
                _fuse_site(rw, prod, users, e)
                fused.append(layer_of(e.outputs[0]))
            except NoMatch as err:
                misses.append(f"L{layer_of(e.outputs[0])}: {err}")
        if not fused:
            why = "; ".join(sorted(set(m.split(": ", 1)[1] for m in misses))) or "no FFN site found"
            return self.skip(g, f"no FFN site fused: {why}", sites=sites)
        note = f"fused {len(fused)}/{sites} FFN sites into mega_mhc -> mega_moe ({how})"
        if misses:
            note += "; left alone: " + "; ".join(misses)
        return PassResult(rw.apply(), note, {"sites": sites, "fused": len(fused)})


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise NoMatch(why)


def _resolved(n: Node) -> dict:
    return get_op(n.op).resolve_attrs(n.attr_dict, n.outputs[0])


def _fuse_site(rw: Rewrite, prod, users, expand: Node) -> None:
    streams, y, post, comb = expand.inputs
    add = prod[y] if prod[y].op == "add" else None
    routed = prod[add.inputs[0]] if add else prod[y]
    shared = prod.get(add.inputs[1]) if add else None
    _need(routed.op == "moe_experts_q", "the FFN input is not quantized (run quantize-epilogues first; "
          "the fused MoE takes FP8 activations)")
    _need(shared is None or shared.op == "swiglu_mlp_q", "the shared expert is not a quantized swiglu_mlp")
    xq, xs, ids, wts = routed.inputs[:4]
    _need(shared is None or tuple(shared.inputs[:2]) == (xq, xs), "experts read different inputs")
    router, quant = prod.get(ids), prod.get(xq)
    _need(router is not None and router.op in ("route", "hash_route") and router.outputs == (ids, wts),
          "the experts' ids/weights do not come from a `route` / `hash_route` router")
    _need(quant is not None and quant.op == "quantize_act", "x_q is not a quantize_act result")
    x = router.inputs[0]
    _need(quant.inputs[0] == x, "router and experts read different activations")
    norm = prod.get(x)
    _need(norm is not None and norm.op == "rms_norm", "the FFN input is not an rms_norm")
    collapse = prod.get(norm.inputs[0])
    _need(collapse is not None and collapse.op == "hc_collapse" and collapse.inputs[0] == streams,
          "the norm does not read a collapse of the site's streams")
    mixer = prod.get(post)
    _need(mixer is not None and mixer.op == "hc_mixer" and mixer.outputs[1:] == (post, comb)
          and mixer.inputs[0] == streams, "post/comb do not come from the site's hc_mixer")
    mix = collapse.inputs[1]
    mix_in = None if mix == mixer.outputs[0] else mix
    # every intermediate must stay inside the site
    inside = [expand, routed, router, quant, norm, collapse, mixer] + [n for n in (add, shared) if n]
    ids_in = {id(n) for n in inside}
    site_outputs = {x, *mixer.outputs, expand.outputs[0], xq, xs}
    for n in inside:
        for o in n.outputs:
            if o not in site_outputs or o in (xq, xs):
                _need(not escapes(rw.g, users, o, ids_in), f"%{o} is read outside the FFN site")
    ma, ra, ea = _resolved(mixer), _resolved(router), _resolved(routed)
    sa = _resolved(shared) if shared else {}
    _need(not shared or sa["swiglu_limit"] == ea["swiglu_limit"], "routed and shared SwiGLU limits differ")
    _need(ea["out_dtype"] == rw.g.types[streams].dtype, "expert output dtype differs from the streams")
    mhc = rw.node("mega_mhc", [streams, *mixer.inputs[1:4], mix_in, norm.inputs[1]],
                  [x, xq, xs, *mixer.outputs], eps=ma["eps"], hc_eps=ma["hc_eps"],
                  sinkhorn_iters=ma["sinkhorn_iters"], norm_eps=norm.attr("eps"),
                  act_fmt=quant.attr("act_fmt"))
    sh_in = list(shared.inputs[2:8]) if shared else [None] * 6
    if router.op == "route":
        gate, hashed = list(router.inputs[1:3]), [None, None]
    else:  # hash_route(x, gate_w, tid2eid, token_ids): experts from a table, no selection bias
        gate, hashed = [router.inputs[1], None], list(router.inputs[2:4])
    moe = rw.node("mega_moe", [x, xq, xs, streams, post, comb, *gate, *routed.inputs[4:10], *sh_in,
                               *hashed], [expand.outputs[0]],
                  topk=ra["topk"], route_scale=ra["route_scale"], norm_topk=ra["norm_topk"],
                  score_func=ra["score_func"], fmt=ea["fmt"], shared_fmt=sa.get("fmt", "dense"),
                  swiglu_limit=ea["swiglu_limit"], act_fmt=ea["act_fmt"])
    rw.remove(*inside)
    rw.insert_after(quant, mhc)
    rw.insert_after(expand, moe)

