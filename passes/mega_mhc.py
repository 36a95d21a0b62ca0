"""Mega-mHC at every remaining site: hc_mixer + hc_collapse + rms_norm + quantize_act -> mega_mhc.

mega-moe-fusion folds the FFN sites' mHC front half into `mega_mhc`, because there the MoE reads
its output. The attention sites have the same front half: the mixer (24-way projection with RMS
statistics, Sinkhorn on 4 x 4) gives this site's post / comb and the pre the next site collapses
with, the collapse of the streams with the previous site's pre, the attention norm, and the
quantization for the q / kv projections. Unfused they are four ops (on the H200 the mixer alone
is ~60 small torch kernels: sigmoids, softmax, 20 Sinkhorn iterations); fused, one kernel
(kernels/mhc/triton.py: one launch at decode sizes) writes the norm output (read by the compressor
and the indexer's head weights as well), its quantized copy and the coefficients.

Runs after mega-moe-fusion (its FFN sites are already fused; what is left are the attention
sites, or every site where the profile has no fused MoE). Needs the site's norm output quantized
(quantize-epilogues) and the collapse output read only by the norm. Fires where the profile
lists the `mega_mhc` fusion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megagraph.graph.ir import Graph, Node
from megagraph.graph.registry import get_op

from .base import FusionPass, PassResult, Rewrite, layer_of, only_user, register_pass


class NoMatch(Exception):
    """This site does not have the expected shape; the message says what differs."""


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise NoMatch(why)


@register_pass
@dataclass(frozen=True)
class MegaMhcFusion(FusionPass):
    """Fuse each remaining mHC front half (mixer, collapse, norm, quantize) into one mega_mhc.

    before (one attention site, after quantize-epilogues and mega-moe-fusion):
      %L1.attn.pre, %L1.attn.post, %L1.attn.comb = hc_mixer(%L0.ffn.streams, @fn, @base, @scale)
      %L1.attn.x = hc_collapse(%L0.ffn.streams, %L0.ffn.pre)
      %L1.attn.xn = rms_norm(%L1.attn.x, @layers.1.attn_norm.weight)
      %L1.attn.xn.q, %L1.attn.xn.qscale = quantize_act(%L1.attn.xn) {act_fmt="fp8_1x128"}
    after:
      %L1.attn.xn, %L1.attn.xn.q, %L1.attn.xn.qscale, %L1.attn.pre, %L1.attn.post, %L1.attn.comb
          = mega_mhc(%L0.ffn.streams, @fn, @base, @scale, %L0.ffn.pre, @attn_norm) {...}
    """

    name: ClassVar[str] = "mega-mhc-fusion"
    fusion: ClassVar[str] = "mega_mhc"
    kernel: ClassVar[str] = "fused mHC kernel"

    def fuse(self, g: Graph, how) -> PassResult:
        mixers = [n for n in g.nodes if n.op == "hc_mixer"]
        if not mixers:
            return self.skip(g, "no unfused mHC site left")
        rw = Rewrite(g, self.name)
        order = {n.outputs[0]: i for i, n in enumerate(g.nodes)}
        prod, users = g.producers(), g.users()
        fused, misses = 0, []
        for m in mixers:
            try:
                _fuse_site(rw, prod, users, order, m)
                fused += 1
            except NoMatch as err:
                misses.append(f"L{layer_of(m.outputs[0])}: {err}")
        if not fused:
            return self.skip(g, "no site fused: " + "; ".join(misses), sites=len(mixers))
        note = f"fused {fused}/{len(mixers)} mHC sites into mega_mhc ({how})"
        if misses:
            note += "; left alone: " + "; ".join(misses)
        return PassResult(rw.apply(), note, {"sites": len(mixers), "fused": fused})


def _fuse_site(rw: Rewrite, prod, users, order: dict[str, int], mixer: Node) -> None:
    streams = mixer.inputs[0]
    pre = mixer.outputs[0]
    collapses = [u for u in users.get(streams, []) if u.op == "hc_collapse" and u.inputs[0] == streams]
    _need(len(collapses) == 1, f"{len(collapses)} collapses of the mixer's streams (want 1)")
    collapse = collapses[0]
    x = collapse.outputs[0]
    norm = only_user(users, x)
    _need(norm is not None and norm.op == "rms_norm" and norm.inputs[0] == x
          and not any(v == x for _, v in rw.g.outputs),
          "the collapse is not read by exactly one rms_norm")
    xn = norm.outputs[0]
    quants = [u for u in users.get(xn, []) if u.op == "quantize_act"]
    _need(len(quants) == 1, "the norm output is not quantized exactly once (run quantize-epilogues)")
    quant = quants[0]
    mix = collapse.inputs[1]
    _need(mix == pre or mix not in prod or order[prod[mix].outputs[0]] < order[mixer.outputs[0]],
          "the collapse's mix is produced after the mixer")
    # the fused node takes the quantizer's place: every reader of the site's values must follow it
    outs = (xn, *quant.outputs, *mixer.outputs)
    inside = {id(n) for n in (mixer, collapse, norm, quant)}
    early = [u for o in outs for u in users.get(o, [])
             if id(u) not in inside and order[u.outputs[0]] < order[quant.outputs[0]]]
    _need(not early, f"%{early[0].outputs[0] if early else ''} reads the site before its quantizer")
    ma = get_op("hc_mixer").resolve_attrs(mixer.attr_dict, pre)
    fused = rw.node("mega_mhc", [streams, *mixer.inputs[1:4], None if mix == pre else mix,
                                 norm.inputs[1]],
                    [xn, *quant.outputs, *mixer.outputs], eps=ma["eps"], hc_eps=ma["hc_eps"],
                    sinkhorn_iters=ma["sinkhorn_iters"], norm_eps=norm.attr("eps"),
                    act_fmt=quant.attr("act_fmt"))
    rw.remove(mixer, collapse, norm, quant)
    rw.insert_after(quant, fused)
