"""Fuse each KV-source layer's compressor chain (projections, softmax pooling, norm, RoPE, cache
quantization, cache writes) into one `compressor` op: one kernel instead of ~15 launches, and the
pooled latent never leaves the kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megagraph.graph.ir import Graph, Node

from .base import FusionPass, PassResult, Rewrite, escapes, layer_of, only_user, register_pass

ROPE_KEYS = ("rope_dim", "theta", "yarn_factor", "yarn_original", "yarn_beta_fast",
             "yarn_beta_slow", "offset")


class NoMatch(Exception):
    """The chain differs from the pattern; the message says where."""


@register_pass
@dataclass(frozen=True)
class FuseCompressor(FusionPass):
    """Replace the compressor chain of every KV-source layer by one `compressor` op.

    before (V4.1 layer 2, ratio 2):
      %x32 = cast(%L2.attn.xn) {dtype="f32"} : f32[T, 64]
      %kv_proj = linear(%x32, @...compressor.wkv.weight, _) : f32[T, 32]
      %gate_proj = linear(%x32, @...compressor.wgate.weight, _) : f32[T, 32]
      %latent_raw, %pend_kv.next, %pend_gate.next = compress_pool(...) {ratio=2}
      %latent = rms_norm(%latent_raw, @...compressor.norm.weight)
      %ik_proj = linear(%latent, @...indexer.wk.weight, _) ; rms_norm ; rope ; fake_quant {mxfp4}
      %ikey.next = cache_write(%L2.ikey, %ik, ...) {ratio=2}
      %ckv_rot = rope(%latent, ...) ; fake_quant {nvfp4} ; cast {bf16}
      %ckv.next = cache_write(%L2.ckv, %ckv_row_act, ...) {ratio=2}
    after:
      %ikey.next, %ckv.next, %pend_kv.next, %pend_gate.next = compressor(%L2.attn.xn, @wkv,
          @wgate, %L2.pend_kv, %L2.pend_gate, @norm, @wk, @k_norm, %L2.ikey, %L2.ckv, %positions,
          %token_req, %seq_slots) {ckv_fmt="nvfp4", ikey_fmt="mxfp4", ratio=2, ...}

    Fires where the profile lists the `compressor` fusion; a layer whose chain differs from the
    pattern is left alone and named in the note.
    """

    name: ClassVar[str] = "fuse-compressor"
    fusion: ClassVar[str] = "compressor"
    kernel: ClassVar[str] = "fused compressor kernel"

    def fuse(self, g: Graph, how) -> PassResult:
        writes = [n for n in g.nodes if n.op == "cache_write"]
        if not writes:
            return self.skip(g, "no compressor (cache_write) in this graph")
        rw = Rewrite(g, self.name)
        prod, users = g.producers(), g.users()
        by_layer: dict[int | None, list[Node]] = {}
        for w in writes:
            by_layer.setdefault(layer_of(w.outputs[0]), []).append(w)
        fused, misses = [], []
        for layer, ws in by_layer.items():
            try:
                if all(_v4_chain(w, prod) for w in ws):
                    for w in ws:
                        _fuse_v4(rw, users, w, _v4_chain(w, prod))
                else:
                    _fuse_one(rw, prod, users, ws)
                fused.append(layer)
            except NoMatch as e:
                misses.append(f"L{layer}: {e}")
        if not fused:
            return self.skip(g, "no compressor chain matched: " + "; ".join(misses))
        note = f"fused the compressor of layers {_ranges(fused)} ({how})"
        if misses:
            note += "; left alone: " + "; ".join(misses)
        return PassResult(rw.apply(), note, {"fused": len(fused), "left_alone": len(misses)})


CHAIN_OPS = ("cast", "fake_quant", "rope", "rms_norm", "linear")


def _path(write: Node, prod: dict[str, Node]) -> list[Node]:
    """Nodes from a cache_write's rows back through the compressor chain (input 0 each)."""
    out, n = [], prod.get(write.inputs[1])
    while n is not None and n.op in CHAIN_OPS:
        out.append(n)
        n = prod.get(n.inputs[0])
    return out


def _split(writes: list[Node], prod) -> tuple[Node, Node, Node]:
    """(index-key write, compressed-KV write, latent norm): the latent is the first rms_norm both
    paths share; the index-key path reaches it through the wk projection."""
    if len(writes) != 2:
        raise NoMatch(f"expected 2 cache writes (index key, compressed KV), found {len(writes)}")
    a, b = (_path(w, prod) for w in writes)
    common = [n for n in a if n in b and n.op == "rms_norm"]
    if not common:
        raise NoMatch("the two cache writes share no normalized latent")
    latent = common[0]
    ia, ib = a.index(latent), b.index(latent)
    if ia > 0 and a[ia - 1].op == "linear":
        return writes[0], writes[1], latent
    if ib > 0 and b[ib - 1].op == "linear":
        return writes[1], writes[0], latent
    raise NoMatch("neither cache write is fed through an index-key projection")


def _chain(start: str, users, ops: tuple[str, ...]) -> list[Node]:
    """Follow single users through `ops` (each optional) in order; returns the nodes found."""
    found, v = [], start
    for opname in ops:
        u = only_user(users, v)
        if u is not None and u.op == opname:
            found.append(u)
            v = u.outputs[0]
    return found


def _fuse_one(rw: Rewrite, prod, users, writes: list[Node]) -> None:
    g = rw.g
    ikey_write, ckv_write, norm = _split(writes, prod)
    src = prod.get(norm.inputs[0])
    if src is None or src.op not in ("compress_pool", "linear"):
        raise NoMatch("the latent norm does not read a projection or a pooling")
    pool = src if src.op == "compress_pool" else None
    kv_lin = prod[pool.inputs[0]] if pool else src
    gate_lin = prod[pool.inputs[1]] if pool else None
    x = kv_lin.inputs[0]
    region = [kv_lin, norm] + ([pool, gate_lin] if pool else [])
    if x in prod and prod[x].op == "cast" and prod[x].attr("dtype") == "f32":
        region.append(prod[x])
        x = prod[x].inputs[0]
    lat_users = users.get(norm.outputs[0], [])
    ik_lin = next((u for u in lat_users if u.op == "linear"), None)
    ck_rope = next((u for u in lat_users if u.op == "rope"), None)
    if ik_lin is None or ck_rope is None or len(lat_users) != 2:
        raise NoMatch("the latent must feed exactly the index-key projection and the KV RoPE")
    ik = [ik_lin] + _chain(ik_lin.outputs[0], users, ("rms_norm", "rope", "fake_quant", "cache_write"))
    ck = [ck_rope] + _chain(ck_rope.outputs[0], users, ("fake_quant", "cast", "cache_write"))
    if ik[-1] != ikey_write or ck[-1] != ckv_write or ik[1].op != "rms_norm":
        raise NoMatch("index-key / compressed-KV chains do not end in cache writes")
    ik_rope = next(n for n in ik if n.op == "rope")
    attrs_r = ik_rope.attr_dict
    if {k: v for k, v in ck_rope.attr_dict.items()} != attrs_r:
        raise NoMatch("index-key and KV RoPE differ")
    ik_fq = next((n for n in ik if n.op == "fake_quant"), None)
    ck_fq = next((n for n in ck if n.op == "fake_quant"), None)
    cast = next((n for n in ck if n.op == "cast"), None)
    ikey_w, ckv_w = ik[-1], ck[-1]
    if cast is not None and cast.attr("dtype") != g.types[ckv_w.inputs[0]].dtype:
        raise NoMatch("compressed-KV row cast differs from the cache dtype")
    ratio = ikey_w.attr("ratio")
    if ckv_w.attr("ratio") != ratio or (pool and pool.attr("ratio") != ratio):
        raise NoMatch("ratios differ along the chain")
    for n in (ik_fq, ck_fq):
        if n is not None and n.attr("block") != {"mxfp4": 32, "nvfp4": 16, "fp8_e4m3": 32}[n.attr("fmt")]:
            raise NoMatch(f"fake_quant block {n.attr('block')} is not the {n.attr('fmt')} default")
    if ik[1].attr("eps") != norm.attr("eps") or attrs_r.get("inverse"):
        raise NoMatch("index-key norm eps differs from the latent norm eps, or RoPE is inverse")
    if any(n.attr("fmt", "dense") != "dense" for n in (kv_lin, gate_lin, ik_lin) if n is not None):
        raise NoMatch("compressor projections are not dense (bf16/f32) weights")
    if pool is not None and gate_lin.inputs[0] != kv_lin.inputs[0]:
        raise NoMatch("kv and gate projections read different inputs")
    chain = region + ik + ck
    outs = [ikey_w.outputs[0], ckv_w.outputs[0]] + ([pool.outputs[1], pool.outputs[2]] if pool else [])
    inside = {id(n) for n in chain}
    for n in chain:
        for o in n.outputs:
            if o not in outs and escapes(g, users, o, inside):
                raise NoMatch(f"%{o} is also read outside the compressor")
    meta = ikey_w.inputs[2:5]
    ins = [x, kv_lin.inputs[1], gate_lin.inputs[1] if pool else None,
           pool.inputs[2] if pool else None, pool.inputs[3] if pool else None, norm.inputs[1],
           ik_lin.inputs[1], ik[1].inputs[1], ikey_w.inputs[0], ckv_w.inputs[0], *meta]
    attrs = {k: attrs_r.get(k) for k in ROPE_KEYS}
    fused = rw.node("compressor", ins, outs, ratio=ratio, eps=norm.attr("eps"),
                    ikey_fmt=ik_fq.attr("fmt") if ik_fq else "none",
                    ckv_fmt=ck_fq.attr("fmt") if ck_fq else "none", **attrs)
    rw.remove(*chain)
    rw.insert_after(max(chain, key=lambda n: g.nodes.index(n)), fused)


def _v4_chain(write: Node, prod) -> list[Node] | None:
    """[cast?, rope, rms_norm, v4_compress_pool, kv linear, gate linear] feeding a V4 cache write."""
    chain, n = [], prod.get(write.inputs[1])
    if n is not None and n.op == "cast":
        chain.append(n)
        n = prod.get(n.inputs[0])
    for opname in ("rope", "rms_norm", "v4_compress_pool"):
        if n is None or n.op != opname:
            return None
        chain.append(n)
        n = prod.get(n.inputs[0])
    pool = chain[-1]
    kv, gate = prod.get(pool.inputs[0]), prod.get(pool.inputs[1])
    if kv is None or gate is None or kv.op != "linear" or gate.op != "linear":
        return None
    return chain + [kv, gate]


def _fuse_v4(rw: Rewrite, users, write: Node, chain: list[Node]) -> None:
    *head, rope_n, norm, pool, kv, gate = ([None] if chain[0].op != "cast" else []) + chain
    if kv.inputs[0] != gate.inputs[0] or any(n.attr("fmt", "dense") != "dense" for n in (kv, gate)):
        raise NoMatch("V4 compressor projections differ in input or are not dense")
    x = kv.inputs[0]
    src = rw.producer.get(x)
    if src is not None and src.op == "cast" and src.attr("dtype") == "f32":
        x = src.inputs[0]  # the (possibly shared) f32 cast dies once every chain is fused
    inside = {id(n) for n in chain} | {id(write)}
    for n in chain:
        for o in n.outputs:
            if o not in pool.outputs[1:] and escapes(rw.g, users, o, inside):
                raise NoMatch(f"%{o} is also read outside the compressor")
    ra = rope_n.attr_dict
    if ra.get("inverse"):
        raise NoMatch("inverse RoPE in a compressor chain")
    fused = rw.node("v4_compressor", [x, kv.inputs[1], gate.inputs[1], *pool.inputs[2:5],
                                      norm.inputs[1], write.inputs[0], *write.inputs[2:5]],
                    [write.outputs[0], *pool.outputs[1:]], ratio=pool.attr("ratio"),
                    overlap=pool.attr("overlap"), eps=norm.attr("eps"),
                    **{k: ra.get(k) for k in ROPE_KEYS})
    rw.remove(write, *chain)
    rw.insert_after(write, fused)


def _ranges(layers: list[int | None]) -> str:
    """[2, 3, 4, 8] -> "2-4, 8"."""
    xs, runs = sorted(x for x in layers if x is not None), []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
