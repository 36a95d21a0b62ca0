"""Name mapping between transformers' ``DeepseekV4ForCausalLM`` and the official DeepSeek-V4 checkpoint.

Derived from transformers' ``conversion_mapping.py`` entry ``"deepseek_v4"`` (transformers 5.x) and
checked against a real model's ``state_dict()``.  Official names are checkpoint-root relative
(``layers.3.attn.wq_a.weight``); HF names are ``DeepseekV4ForCausalLM.state_dict()`` keys
(``model.layers.3.self_attn.q_a_proj.weight``).

=============================================  =====================================================
official (``layers.L.`` prefix inside layers)  transformers
=============================================  =====================================================
``embed.weight`` / ``head.weight``             ``model.embed_tokens.weight`` / ``lm_head.weight``
``norm.weight``                                ``model.norm.weight``
``hc_head_{fn,base,scale}``                    ``model.hc_head.hc_{fn,base,scale}``
``attn_norm`` / ``ffn_norm``                   ``input_layernorm`` / ``post_attention_layernorm``
``hc_{attn,ffn}_{fn,base,scale}``              ``{attn,ffn}_hc.{fn,base,scale}``
``attn.{wq_a,wq_b,wkv,wo_a,wo_b}``             ``self_attn.{q_a_proj,q_b_proj,kv_proj,o_a_proj,o_b_proj}``
``attn.{q_norm,norm}`` / ``attn.attn_sink``    ``self_attn.{q_a_norm,kv_norm}`` / ``self_attn.sinks``
``attn.compressor.{wkv,wgate,norm,ape}``       ``self_attn.compressor.{kv_proj,gate_proj,kv_norm,position_bias}``
``attn.indexer.compressor.*`` (same leaves)    ``self_attn.compressor.indexer.*``
``attn.indexer.{wq_b,weights_proj}``           ``self_attn.compressor.indexer.{q_b_proj,scorer.weights_proj}``
``ffn.gate.{weight,bias,tid2eid}``             ``mlp.gate.{weight,e_score_correction_bias,tid2eid}``
``ffn.shared_experts.{w1,w3,w2}``              ``mlp.shared_experts.{gate_proj,up_proj,down_proj}``
``ffn.experts.E.{w1,w3}.weight``               ``mlp.experts.gate_up_proj[E, :I]`` / ``[E, I:]`` (fused)
``ffn.experts.E.w2.weight``                    ``mlp.experts.down_proj[E]`` (fused)
``X.scale`` of a linear ``X``                  ``X_hf.weight_scale_inv`` (fused experts: ``..._proj_scale_inv``)
=============================================  =====================================================

V4.1-only tensors (Engram, ``indexer.wk``/``k_norm``, DSpark ``mtp.*``) have no transformers
counterpart: :func:`official_to_hf` raises ``KeyError`` for them.

Note: ``save_pretrained`` of transformers 5.x already reverse-converts to official names but keeps the
``model.`` prefix on some (``model.layers.0.attn.wq_a.weight``, ``model.embed_tokens.weight``);
:func:`load_hf_layout` accepts such hybrid files as well as plain HF ``state_dict`` names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from megagraph.kernels.formats import DTYPES, infer_block_size, quantize_fp8_block, quantize_mxfp4

from .errors import CheckpointError
from .reader import open_checkpoint
from .spec import WeightSpec, expand_spec, scale_name, validate_specs, weight_name_for_scale

__all__ = [
    "official_to_hf",
    "hf_to_official",
    "hf_state_dict_to_official",
    "official_to_hf_state_dict",
    "load_hf_layout",
]

_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_LEAF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",  # as in V4.1 headers (spec §2.3)
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}
_LAYER_LINEAR = {
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
_LAYER_LEAF_INV = {v: k for k, v in _LAYER_LEAF.items()}
_LAYER_LINEAR_INV = {v: k for k, v in _LAYER_LINEAR.items()}
_GLOBAL_INV = {v: k for k, v in _GLOBAL.items()}
# fused experts: official member w -> (hf param, part of the concat along dim 1 (0/1) or None)
_EXPERT_PARTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}

_OFF_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_OFF_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+|\*)\.(w[123])\.(weight|scale)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")


def official_to_hf(name: str) -> str:
    """Official checkpoint name -> transformers ``state_dict`` key.

    Many-to-one for routed experts: ``layers.L.ffn.experts.E.w1.weight`` and ``...w3.weight`` (and the
    stacked ``experts.*`` forms) map to ``model.layers.L.mlp.experts.gate_up_proj`` (w1 = first half of
    dim 1, w3 = second half, expert E = index E of dim 0); ``w2`` to ``...experts.down_proj``.
    Raises ``KeyError`` for names without a transformers counterpart.
    """
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _OFF_EXPERT.match(name)
    if m:
        layer, _, w, kind = m.groups()
        param = _EXPERT_PARTS[w][0]
        return f"model.layers.{layer}.mlp.experts.{param}" + ("_scale_inv" if kind == "scale" else "")
    m = _OFF_LAYER.match(name)
    if m:
        layer, rest = m.groups()
        if rest in _LAYER_LEAF:
            return f"model.layers.{layer}.{_LAYER_LEAF[rest]}"
        mod, _, leaf = rest.rpartition(".")
        if mod in _LAYER_LINEAR and leaf in ("weight", "scale"):
            return f"model.layers.{layer}.{_LAYER_LINEAR[mod]}." + ("weight" if leaf == "weight" else "weight_scale_inv")
    raise KeyError(f"{name!r} has no DeepseekV4ForCausalLM counterpart")


def hf_to_official(name: str) -> tuple[str, ...]:
    """transformers ``state_dict`` key -> the official name(s) it holds.

    One name for every 1:1 tensor.  The fused expert parameters give stacked official names:
    ``...mlp.experts.gate_up_proj`` -> ``(layers.L.ffn.experts.*.w1.weight, layers.L.ffn.experts.*.w3.weight)``
    (halves of dim 1), ``...down_proj`` -> ``(layers.L.ffn.experts.*.w2.weight,)``; ``*_scale_inv`` give
    the ``.scale`` names.  Raises ``KeyError`` for an unknown key.
    """
    if name in _GLOBAL_INV:
        return (_GLOBAL_INV[name],)
    m = _HF_EXPERT.match(name)
    if m:
        layer, param, sc = m.groups()
        kind = "scale" if sc else "weight"
        ws = [w for w, (p, _) in _EXPERT_PARTS.items() if p == param]
        return tuple(f"layers.{layer}.ffn.experts.*.{w}.{kind}" for w in sorted(ws, key=lambda w: _EXPERT_PARTS[w][1] or 0))
    m = _HF_LAYER.match(name)
    if m:
        layer, rest = m.groups()
        if rest in _LAYER_LEAF_INV:
            return (f"layers.{layer}.{_LAYER_LEAF_INV[rest]}",)
        mod, _, leaf = rest.rpartition(".")
        if mod in _LAYER_LINEAR_INV and leaf in ("weight", "weight_scale_inv"):
            return (f"layers.{layer}.{_LAYER_LINEAR_INV[mod]}." + ("weight" if leaf == "weight" else "scale"),)
    raise KeyError(f"{name!r} is not a DeepseekV4ForCausalLM parameter name")


def _split_fused(name: str, t: torch.Tensor, *, stacked: bool) -> dict[str, torch.Tensor]:
    offs = hf_to_official(name)
    out: dict[str, torch.Tensor] = {}
    parts = t.chunk(len(offs), dim=1) if len(offs) > 1 else (t,)
    if len(offs) > 1 and t.shape[1] % len(offs):
        raise ValueError(f"{name}: dim 1 ({t.shape[1]}) does not split into {len(offs)} halves")
    for off, part in zip(offs, parts):
        if stacked:
            out[off] = part.contiguous()
        else:
            for e in range(part.shape[0]):
                out[off.replace("*", str(e))] = part[e].clone()
    return out


def hf_state_dict_to_official(sd: Mapping[str, torch.Tensor], *, stacked: bool = False) -> dict[str, torch.Tensor]:
    """Rename (and split fused experts of) a ``DeepseekV4ForCausalLM`` state dict to official names.

    ``stacked=False``: per-expert tensors ``layers.L.ffn.experts.E.w1.weight``; ``stacked=True``:
    ``layers.L.ffn.experts.*.w1.weight`` ``[E, I, H]``.  Raises ``KeyError`` listing unknown keys.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for k, t in sd.items():
        try:
            offs = hf_to_official(k)
        except KeyError:
            unknown.append(k)
            continue
        if "*" in offs[0]:
            out.update(_split_fused(k, t, stacked=stacked))
        else:
            out[offs[0]] = t
    if unknown:
        raise KeyError(f"{len(unknown)} unknown transformers key(s): {', '.join(unknown[:5])}")
    return out


def official_to_hf_state_dict(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_state_dict_to_official`: per-expert or stacked official names -> HF keys,
    fusing experts (all experts ``0..E-1`` must be present)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, dict[int | str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _OFF_EXPERT.match(name)
        if m:
            layer, e, w, kind = m.groups()
            hf = official_to_hf(name)
            fused.setdefault(hf, {}).setdefault(w, {})["*" if e == "*" else int(e)] = t
            continue
        out[official_to_hf(name)] = t
    for hf, by_w in fused.items():
        stacks = []
        for w in sorted(by_w, key=lambda w: _EXPERT_PARTS[w][1] or 0):
            members = by_w[w]
            if "*" in members:
                if len(members) > 1:
                    raise ValueError(f"{hf}: both stacked and per-expert {w} tensors given")
                stacks.append(members["*"])
            else:
                n = len(members)
                if sorted(members) != list(range(n)):
                    raise ValueError(f"{hf}: experts of {w} are not 0..{n - 1}: {sorted(members)[:8]}")
                stacks.append(torch.stack([members[e] for e in range(n)]))
        want = 2 if hf.split(".")[-1].startswith("gate_up_proj") else 1
        if len(stacks) != want:
            raise ValueError(f"{hf}: needs {'w1 and w3' if want == 2 else 'w2'}, got {sorted(by_w)}")
        out[hf] = torch.cat(stacks, dim=1) if want == 2 else stacks[0]
    return out


# ---------------------------------------------------------------------------------------------------
# load a transformers-saved checkpoint under official names
# ---------------------------------------------------------------------------------------------------


_SAVED_ALIASES = re.compile(r"^(layers\.\d+)\.attn\.norm\.weight$")


def _sources(ck) -> dict[str, tuple[str, int | None, int | None, int]]:
    """official per-tensor name -> (checkpoint tensor, expert index or None, concat part or None, n parts)."""
    src: dict[str, tuple[str, int | None, int | None, int]] = {}

    def add(off, entry, k):
        if off in src:
            raise CheckpointError(ck.info(k).file, f"maps to {off!r}, which {src[off][0]!r} provides too", tensor=k)
        src[off] = entry

    for k in ck.keys():
        try:
            offs = hf_to_official(k)
        except KeyError:
            off = k[len("model."):] if k.startswith("model.") else k
            # save_pretrained reverses transformers' `.norm.` -> `.kv_norm.` rename, so the main
            # attention's kv_norm comes back spelled `attn.norm`
            off = _SAVED_ALIASES.sub(r"\1.attn.kv_norm.weight", off)
            add(off, (k, None, None, 1), k)
            continue
        if "*" not in offs[0]:
            add(offs[0], (k, None, None, 1), k)
            continue
        E = ck.info(k).shape[0]
        for p, off in enumerate(offs):
            for e in range(E):
                add(off.replace("*", str(e)), (k, e, p if len(offs) > 1 else None, len(offs)), k)
    return src


def load_hf_layout(
    path: str | os.PathLike,
    specs: Sequence[WeightSpec] | None = None,
    *,
    quantize: bool = False,
) -> dict[str, torch.Tensor]:
    """Load a transformers-saved V4 checkpoint (``save_pretrained`` or a raw ``state_dict`` in
    safetensors, HF or official or hybrid names, fused or per-expert experts) under official names.

    ``specs=None``: every tensor, per-tensor official names, stored dtypes.  With ``specs``: exactly
    those (stacked ``*`` specs stacked), shapes checked (``CheckpointError`` naming file and tensor),
    float tensors cast to the spec's float dtype, integer tensors to its integer dtype.  A float tensor
    whose spec is ``fp8e4m3``/``fp4x2`` is quantized (block taken from the paired ``X.scale`` spec)
    when ``quantize=True`` - lossy; parity tests should use float specs - and is an error otherwise.
    """
    ck = open_checkpoint(path)
    src = _sources(ck)
    cache: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(off: str) -> torch.Tensor:
            k, e, p, n = src[off]
            if k not in cache:
                f = ck.info(k).file
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                cache[k] = handles[f].get_tensor(k)
            t = cache[k]
            if e is not None:
                t = t[e]
                if p is not None:
                    t = t.chunk(n, dim=0)[p]
            return t.clone() if e is not None else t

        if specs is None:
            return {off: read(off) for off in src}
        specs = list(specs)
        pairs = validate_specs(specs)
        flat = expand_spec(specs)
        scale_members = {m for sc in pairs.values() for m in sc.member_names()}
        # a paired scale need not be in the file when its weight is stored as float (quantize=True)
        missing = [s.name for s in flat if s.name not in src
                   and not (s.name in scale_members and weight_name_for_scale(s.name) in src)]
        if missing:
            raise CheckpointError(ck._where(), f"{len(missing)} expected tensor(s) missing: "
                                  + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""), tensor=missing[0])
        scales: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        by_name = {s.name: s for s in specs}
        paired_scale_names = {sc.name for sc in pairs.values()}
        for s in specs:
            if s.name in paired_scale_names:
                continue
            vals, scs = [], []
            for m in s.member_names():
                t = read(m)
                file = ck.info(src[m][0]).file
                t, sc = _convert(t, s, m, pairs.get(s.name), file, quantize, src, read)
                vals.append(t)
                scs.append(sc)
            out[s.name] = torch.stack(vals) if s.stacked else vals[0]
            if s.name in pairs:
                scales[pairs[s.name].name] = torch.stack(scs) if s.stacked else scs[0]
        for name, sc in scales.items():
            spec = by_name[name]
            if tuple(sc.shape) != spec.shape:
                raise CheckpointError(ck._where(), f"scale shape {list(sc.shape)} != expected {list(spec.shape)}",
                                      tensor=name)
            out[name] = sc
        return {s.name: out[s.name] for s in specs}


def _convert(t, spec: WeightSpec, member: str, scale_spec: WeightSpec | None, file, quantize, src, read):
    shape = spec.member_shape
    if spec.dtype in ("fp8e4m3", "fp4x2") and scale_spec is not None and t.dtype.is_floating_point and \
            t.dtype not in (torch.float8_e4m3fn,):
        if not quantize:
            raise CheckpointError(file, f"stored as {t.dtype} but the spec wants {spec.dtype}; pass quantize=True "
                                  "to quantize (lossy) or use float specs", tensor=member)
        if spec.dtype == "fp8e4m3":
            if tuple(t.shape) != shape:
                raise CheckpointError(file, f"shape mismatch: expected {list(shape)}, found {list(t.shape)}",
                                      tensor=member)
            return quantize_fp8_block(t.float(), infer_block_size(shape, scale_spec.member_shape))
        want = (shape[0], 2 * shape[1])
        if tuple(t.shape) != want:
            raise CheckpointError(file, f"shape mismatch: expected {list(want)} (unpacked), found {list(t.shape)}",
                                  tensor=member)
        return quantize_mxfp4(t.float(), block=want[1] // scale_spec.member_shape[1])
    if tuple(t.shape) != shape:
        raise CheckpointError(file, f"shape mismatch: expected {list(shape)}, found {list(t.shape)}", tensor=member)
    want = DTYPES[spec.dtype].torch
    if t.dtype != want:
        both_float = t.dtype.is_floating_point and want.is_floating_point and spec.dtype in ("bf16", "f16", "f32", "f64")
        both_int = not t.dtype.is_floating_point and not want.is_floating_point and spec.dtype in ("i8", "u8", "i32", "i64")
        if not (both_float or both_int):
            raise CheckpointError(file, f"dtype mismatch: expected {spec.dtype}, found {t.dtype}", tensor=member)
        if both_int and t.numel():
            info = torch.iinfo(want)
            if int(t.min()) < info.min or int(t.max()) > info.max:
                raise CheckpointError(file, f"integer values do not fit {spec.dtype}", tensor=member)
        t = t.to(want)
    sc = None
    if scale_spec is not None:
        sname = scale_name(member)
        if sname not in src:
            raise CheckpointError(file, f"quantized weight stored without its scale {sname!r}", tensor=member)
        sc = read(sname)
    return t, sc
