"""Place activation-quantize epilogues where the next GEMM wants low-precision input.

A GEMM on FP8-block or MXFP4 weights runs on FP8 tensor cores when its activation is FP8 too. The
activation is quantized once, right where it is produced (an epilogue of the producing kernel), and
every low-precision GEMM reading it consumes the (values, scales) pair directly. The format follows
the hardware: MXFP8 (E4M3 + one E8M0 scale per 32) on Blackwell; on Hopper, which has no MX tensor
cores, FP8 E4M3 with one power-of-two f32 scale per 128 (per-token 1x128, DeepGEMM's sm90 recipe).
Where the profile's attention kernel can write its output quantized (FlashMLA MegaAttention), the
inverse RoPE, head merge and quantization fold into the attention op itself (`sparse_attn_q`).

This pass changes numerics (that is its point); the error bound is stated in
kernels/fused/reference.py and tested per quantized GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megagraph.graph.ir import Graph, Node

from .base import Pass, PassResult, Rewrite, escapes, register_pass
from .hw import HwProfile

# GEMM op -> its quantized-input twin; input 0 is the activation in both
QUANTIZED_TWIN = {"linear": "linear_q", "grouped_linear": "grouped_linear_q",
                  "moe_experts": "moe_experts_q", "swiglu_mlp": "swiglu_mlp_q"}
LOW_PRECISION_WEIGHTS = ("fp8_block", "mxfp4")


def act_format(hw: HwProfile) -> tuple[str | None, str]:
    """(activation format, why) for a profile."""
    if hw.has_format("mxfp8"):
        return "mxfp8", f"profile {hw.name} has MXFP8 tensor cores"
    if hw.has_format("fp8_e4m3"):
        return "fp8_1x128", (f"profile {hw.name} has no MXFP8 tensor cores: FP8 E4M3 with "
                             "per-token 1x128 power-of-two f32 scales instead")
    return None, f"profile {hw.name} has no FP8 tensor cores"


@register_pass
@dataclass(frozen=True)
class QuantizeEpilogues(Pass):
    """Quantize each low-precision GEMM's activation once, where it is produced.

    before:
      %L0.attn.o = sparse_attn(%L0.attn.q, %L0.attn.kv, %L0.ring, _, _, @sink, ...) : bf16[T, 4, 32]
      %L0.attn.o_unrot = rope(%L0.attn.o, %positions) {inverse=true, ...} : bf16[T, 4, 32]
      %L0.attn.o_flat = merge_heads(%L0.attn.o_unrot) : bf16[T, 128]
      %L0.attn.o_lora = grouped_linear(%L0.attn.o_flat, @wo_a.weight, @wo_a.scale) {groups=2, ...}
    after (gb300):
      %L0.attn.o_flat.q, %L0.attn.o_flat.qscale = sparse_attn_q(...) {act_fmt="mxfp8", ...}
          : fp8e4m3[T, 128], e8m0[T, 4]
      %L0.attn.o_lora = grouped_linear_q(%L0.attn.o_flat.q, %L0.attn.o_flat.qscale, @wo_a.weight,
          @wo_a.scale) {act_fmt="mxfp8", groups=2, out_dtype="bf16", ...}
    elsewhere (e.g. the attention norm feeding wq_a and wkv):
      %L0.attn.xn.q, %L0.attn.xn.qscale = quantize_act(%L0.attn.xn) {act_fmt="mxfp8"}
      %L0.attn.q_a = linear_q(%L0.attn.xn.q, %L0.attn.xn.qscale, @wq_a.weight, @wq_a.scale) {...}

    Consumers on dense (bf16/f32) weights keep reading the unquantized value.
    """

    name: ClassVar[str] = "quantize-epilogues"
    hw: HwProfile
    targets: tuple[str, ...] = tuple(QUANTIZED_TWIN)  # GEMM ops whose inputs may be quantized
    reference: bool = False  # compile --numerics reference: activations stay unquantized

    def run(self, g: Graph) -> PassResult:
        if self.reference:
            return self.skip(g, "reference numerics (compile --numerics reference): activations "
                                "stay unquantized")
        fmt, why = act_format(self.hw)
        if fmt is None:
            return self.skip(g, why)
        users, prod = g.users(), g.producers()
        sites: dict[str, list[Node]] = {}
        for n in g.nodes:
            if (n.op in self.targets and n.op in QUANTIZED_TWIN
                    and n.attr("fmt", "dense") in LOW_PRECISION_WEIGHTS):
                sites.setdefault(n.inputs[0], []).append(n)
        if not sites:
            return self.skip(g, "no GEMM on low-precision weights")
        rw = Rewrite(g, self.name)
        fold = self.hw.fusion("attn_epilogue")
        counts = {"sites": 0, "gemms": 0, "attn_epilogues": 0, "standalone": 0, "left_alone": 0}
        misses = []
        for v, gemms in sites.items():
            t = g.types[v]
            if fmt == "mxfp8" and (not isinstance(t.shape[-1], int) or t.shape[-1] % 32):
                misses.append(f"%{v} (K={t.shape[-1]} is not a multiple of 32)")
                counts["left_alone"] += 1
                continue
            q, qs = rw.fresh(f"{v}.q"), rw.fresh(f"{v}.qscale")
            chain = _attention_chain(g, v, prod, users) if fold else None
            if chain is not None and escapes(g, users, v, {id(x) for x in gemms}):
                chain = None  # the unquantized output is read elsewhere too
            if chain is not None:
                attn, rope_n, merge = chain
                ra = {k: x for k, x in rope_n.attr_dict.items() if k not in ("inverse", "offset")}
                node = rw.node("sparse_attn_q", attn.inputs, [q, qs], act_fmt=fmt,
                               **attn.attr_dict, **ra)
                rw.remove(attn, rope_n, merge)
                rw.insert_after(merge, node)
                counts["attn_epilogues"] += 1
            else:
                node = rw.node("quantize_act", [v], [q, qs], act_fmt=fmt)
                if v in prod:
                    rw.insert_after(prod[v], node)
                else:
                    rw.insert_before(gemms[0], node)
                counts["standalone"] += 1
            for gm in gemms:
                attrs = {k: x for k, x in gm.attr_dict.items()}
                new = rw.node(QUANTIZED_TWIN[gm.op], [q, qs, *gm.inputs[1:]], gm.outputs,
                              act_fmt=fmt, out_dtype=g.types[gm.outputs[0]].dtype, **attrs)
                rw.remove(gm)
                rw.insert_after(gm, new)
            counts["sites"] += 1
            counts["gemms"] += len(gemms)
        if not counts["sites"]:
            return self.skip(g, "no GEMM input can be quantized: " + "; ".join(misses), **counts)
        note = f"quantized {counts['sites']} GEMM inputs ({counts['gemms']} GEMMs) as {fmt} ({why})"
        if fold:
            note += f"; {counts['attn_epilogues']} in attention epilogues ({fold})"
        else:
            note += (f"; profile {self.hw.name} has no attention-epilogue kernel, so attention "
                     "outputs get a standalone quantize_act")
        note += f"; {counts['standalone']} standalone quantize_act"
        if misses:
            note += "; left alone: " + ", ".join(misses)
        return PassResult(rw.apply(), note, counts)


def _attention_chain(g: Graph, v: str, prod, users) -> tuple[Node, Node, Node] | None:
    """(sparse_attn, inverse rope, merge_heads) producing v, each read only by the next."""
    merge = prod.get(v)
    if merge is None or merge.op != "merge_heads":
        return None
    rope_n = prod.get(merge.inputs[0])
    if rope_n is None or rope_n.op != "rope" or not rope_n.attr("inverse", False):
        return None
    if rope_n.attr("offset", 0) != 0 or escapes(g, users, rope_n.outputs[0], {id(merge)}):
        return None
    attn = prod.get(rope_n.inputs[0])
    if attn is None or attn.op != "sparse_attn" or escapes(g, users, attn.outputs[0], {id(rope_n)}):
        return None
    if rope_n.inputs[1] != attn.inputs[6]:  # rotated back at the query positions
        return None
    return attn, rope_n, merge
