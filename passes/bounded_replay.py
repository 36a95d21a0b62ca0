"""Bounded-suffix decoder replay: approximate prefill graphs, emitted next to the exact step graph.

Emitted when the hardware profile's `bounded_replay_default` says so (the GPU profiles: the
runtime then uses them for prefill steps above the captured graphs' token limit) or when
`--bounded-replay` asks; `--no-bounded-replay` leaves them out.

Decoder replay. Layers after the last KV-source layer (V4.1: 21-39) own nothing but their sliding
windows, so in prefill only each request's last `keep` rows (window + draft backtracking) need them
for the next decode. The step splits into a prefix graph (every layer up to the boundary, all rows)
and a suffix graph that selects the kept rows (`select_rows`, new dim K) and runs the late layers
and the LM head on them only. Rows before the kept suffix lose their late-layer keys, so the first
kept rows see truncated windows: an approximation (measured in benchmarks/probes/bounded_replay.py),
never used for requests that want prompt logprobs. (Encoder replay, the prefix cache's ring
rebuild, is its own pass: passes/encoder_replay.py.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from megagraph.graph.errors import IRError
from megagraph.graph.ir import Graph, Node, freeze_attrs
from megagraph.graph.registry import get_op
from megagraph.graph.types import TensorType
from megagraph.graph.verify import verify_graph

from .base import Pass, PassResult, dead_code, layer_of, register_pass
from .hw import HwProfile

KV_SOURCE_OPS = ("cache_write", "compressor", "compress_pool", "v4_compressor", "v4_compress_pool")
NOT_IN_SUFFIX = KV_SOURCE_OPS + ("engram_hash", "engram_lookup", "engram_gate", "token_map",
                                 "engram_hist_update")
PREFIX, SUFFIX = "prefill-prefix", "prefill-suffix"


@register_pass
@dataclass(frozen=True)
class BoundedReplay(Pass):
    """Emit the bounded-suffix prefill graphs (the step is unchanged).

    prefill-prefix: the step up to and including the last KV-source layer; the values later layers
    read are returned as `bridge.<value>` outputs.
    prefill-suffix (new dim K = kept rows, bucketed by the runtime):
      %positions.k, %token_req.k, %seq_new.k = suffix_meta(%keep_rows, %positions, %token_req,
          %seq_new) {keep=14}
      %L5.ffn.streams.k = select_rows(%L5.ffn.streams, %keep_rows) : bf16[K, 4, 64]
      ... layers 6-8 and the LM head on K rows ...
    """

    name: ClassVar[str] = "bounded-replay"
    hw: HwProfile
    enabled: bool = False  # resolved by CompileOptions.replay_enabled (flag, else profile)
    keep: int = 0  # rows kept per request (0 = window of the graph's attention)
    explicit: bool = True  # whether `enabled` came from the flag (only changes the note)

    def run(self, g: Graph) -> PassResult:
        if not self.enabled:
            if self.explicit:
                return self.skip(g, "off (approximate; enable with --bounded-replay)")
            return self.skip(g, f"off (profile {self.hw.name}: bounded_replay_default false; "
                                "enable with --bounded-replay)")
        try:
            prefix, suffix, boundary, late = split_bounded(g, self._keep(g))
        except IRError as e:
            return self.skip(g, str(e))
        note = (f"emitted {PREFIX} (layers 0-{boundary}, all rows), {SUFFIX} (layers "
                f"{late[0]}-{late[-1]} + head on each request's last {self._keep(g)} rows; buckets "
                f"of {self.hw.replay_row_bucket} rows up to {self.hw.replay_max_rows})")
        return PassResult(g, note, {"boundary": boundary, "keep": self._keep(g)},
                          {PREFIX: prefix, SUFFIX: suffix})

    def _keep(self, g: Graph) -> int:
        if self.keep:
            return self.keep
        windows = [n.attr("window") for n in g.nodes if n.op in ("sparse_attn", "sparse_attn_q")]
        return max(windows, default=128)


def _layers(g: Graph) -> dict[str, int | None]:
    """First output name -> layer (None for step-level nodes, -1 for the LM head)."""
    out = {}
    for n in g.nodes:
        name = n.outputs[0]
        out[name] = -1 if name.startswith("final.") else layer_of(name)
    return out


def split_bounded(g: Graph, keep: int) -> tuple[Graph, Graph, int, list[int]]:
    """(prefix graph, suffix graph, boundary layer, late layers) of a step graph."""
    layer = _layers(g)
    sources = [layer[n.outputs[0]] for n in g.nodes if n.op in KV_SOURCE_OPS]
    if not sources or None in sources:
        raise IRError("no per-layer KV source in this graph, nothing to bound")
    boundary = max(sources)
    late = sorted({v for v in layer.values() if v is not None and v > boundary})
    if not late:
        raise IRError(f"no layers after the last KV-source layer {boundary}")
    pre_nodes, suf_nodes = [], []
    late_values: set[str] = set()
    for n in g.nodes:
        if n.op == "ring_update_batched":
            a, b = _split_batched(n, late_values)
            pre_nodes += a
            suf_nodes += b
            late_values.update(o for x in b for o in x.outputs)
            continue
        lay = layer[n.outputs[0]]
        is_late = (lay is not None and (lay > boundary or lay == -1)
                   or any(i in late_values for i in n.inputs))
        if is_late:
            suf_nodes.append(n)
            late_values.update(n.outputs)
        else:
            pre_nodes.append(n)
    bad = sorted({n.op for n in suf_nodes if n.op in NOT_IN_SUFFIX})
    if bad:
        raise IRError(f"late layers run {', '.join(bad)}, which need every row")
    return _prefix(g, pre_nodes, suf_nodes), _suffix(g, suf_nodes, keep, boundary), boundary, late


def _split_batched(n: Node, late_values: set[str]) -> tuple[list[Node], list[Node]]:
    """A batched ring copy split into its early part (prefix) and late part (suffix)."""
    meta, ops = n.inputs[:3], n.inputs[3:]
    parts: tuple[list, list] = ([], [])
    for i in range(len(ops) // 2):
        parts[ops[2 * i + 1] in late_values].append((ops[2 * i], ops[2 * i + 1], n.outputs[i]))
    out = []
    for part in parts:
        out.append([Node(n.op, (*meta, *(v for r, k, _ in part for v in (r, k))),
                         tuple(o for *_, o in part), n.attrs)] if part else [])
    return out[0], out[1]


def _prefix(g: Graph, pre: list[Node], suf: list[Node]) -> Graph:
    defined = {o for n in pre for o in n.outputs}
    suf_defined = {o for n in suf for o in n.outputs}
    for n in pre:
        if any(i in suf_defined for i in n.inputs):
            raise IRError(f"{n.op} -> %{n.outputs[0]} (before the boundary) reads a late-layer value")
    bridges = sorted({i for n in suf for i in n.inputs if i in defined})
    outputs = tuple((lab, v) for lab, v in g.outputs if v in defined or v in g.inputs)
    outputs += tuple((f"bridge.{v}", v) for v in bridges)
    p = dead_code(g.with_nodes(pre, outputs=outputs))
    used = {i for n in p.nodes for i in n.inputs} | {v for _, v in p.outputs}
    p = replace(p, name=g.name.replace("/step", "") + f"/{PREFIX}",
                inputs=tuple(i for i in g.inputs if i in used),
                outputs=tuple(o for o in p.outputs if o[0] not in g.inputs or o[0] in used))
    p = p.with_nodes(p.nodes).with_meta(step=PREFIX)
    return verify_graph(p)


def _suffix(g: Graph, suf: list[Node], keep: int, boundary: int) -> Graph:
    suf_defined = {o for n in suf for o in n.outputs}
    weights = set(g.weights)
    crossing = sorted({i for n in suf for i in n.inputs
                       if i is not None and i not in suf_defined and i not in weights})
    need = set(crossing) | {"positions", "token_req", "seq_new"}
    bridges = sorted(v for v in crossing if v not in g.inputs)
    inputs = [i for i in g.inputs if i in need] + ["keep_rows"] + bridges
    types: dict[str, TensorType] = {w: g.types[w] for w in weights}
    types.update({v: g.types[v] for v in inputs if v != "keep_rows"})
    types["keep_rows"] = TensorType("i64", ("K",))
    renames = {"positions": "positions.k", "token_req": "token_req.k", "seq_new": "seq_new.k"}
    nodes = [Node("suffix_meta", ("keep_rows", "positions", "token_req", "seq_new"),
                  ("positions.k", "token_req.k", "seq_new.k"), freeze_attrs({"keep": keep}))]
    for v in crossing:
        if types[v].shape[:1] == ("T",) and v not in renames:
            renames[v] = f"{v}.k"
            nodes.append(Node("select_rows", (v, "keep_rows"), (f"{v}.k",)))
    for n in suf:
        nodes.append(replace(n, inputs=tuple(renames.get(i, i) for i in n.inputs)))
    for n in nodes:  # re-derive every type: T-shaped values become K-shaped
        d = get_op(n.op)
        where = f"{SUFFIX}: %{n.outputs[0]}"
        tys = d.infer([None if i is None else types[i] for i in n.inputs], n.attr_dict, where)
        types.update(zip(n.outputs, tys))
    state_in = [v for v in inputs if v in g.inputs and v in {lab for lab, _ in g.outputs}]
    outputs = tuple((lab, v) for lab, v in g.outputs if v in suf_defined)
    missing = [lab for lab, v in outputs if lab in g.inputs and lab not in state_in]
    if missing:
        raise IRError(f"late-layer state {missing} is not an input of the suffix")
    s = Graph(g.name.replace("/step", "") + f"/{SUFFIX}", (*g.dims, "K"), tuple(inputs), (),
              tuple(nodes), outputs, types, g.meta)
    used = {i for n in nodes for i in n.inputs}
    weights = tuple(w for w in g.weights if w in used)
    s = replace(s, weights=weights, types={k: t for k, t in types.items() if k not in g.weights
                                           or k in used})
    s = s.with_meta(step=SUFFIX, keep=keep, boundary_layer=boundary)
    return verify_graph(s)
