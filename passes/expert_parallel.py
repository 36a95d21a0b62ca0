"""expert-parallel: DP attention + expert parallelism (DEP) for a layout `--dp P --ep P`.

Every rank runs the whole step graph for *its own* requests (attention, state, the dense layers
and the shared expert are replicated; nothing about them changes) and holds L = (E + K) / P expert
*slots* (K = `--redundant-experts` extra replicas over the group). Each MoE site becomes

    route -> ep_place -> ep_dispatch -> moe_experts (local slots) -> ep_combine

(graph/ops/parallel.py). One graph serves every rank: the rank enters only through the process
group the kernels run on, the expert map (a per-layer graph *input* `L<i>.ffn.ep_map`) and the
tensors bound to the local slot weights (`layers.<i>.ffn.experts.local.*`, [L, ...]). So EPLB
changes data, never the graph, and all ranks issue the same collectives in the same order by
construction. The layout and the initial placement (which logical expert each slot holds, per
rank) are written into the graph's meta; the pass's stats (manifest) repeat them.

Side graph `ep-idle`: what a rank with no tokens runs in a step - every site's dispatch, local
experts and combine, in layer order, at T = 0 - so ranks without requests still serve their
experts to the others and join every collective (no hang when DP ranks diverge).

Per step graph output `L<i>.expert_slots` (i64[T, k], the physical slot of every pair) feeds
EPLB's load recording (runtime/distributed/eplb.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from megagraph.graph.errors import IRError
from megagraph.graph.ir import Graph, Node
from megagraph.graph.registry import get_op
from megagraph.graph.types import TensorType
from megagraph.graph.verify import verify_graph

from .base import Pass, PassResult, Rewrite, layer_of, register_pass
from .hw import HwProfile

EXPERT_OPS = ("moe_experts", "moe_experts_q", "mega_moe")
BANK_INDEX = {"moe_experts": 3, "moe_experts_q": 4, "mega_moe": 8}  # input index of w1 (weights: -1)
IDLE_GRAPH = "ep-idle"
LOCAL = "local"  # slot weights: layers.<i>.ffn.experts.local.w1.weight <- layers.<i>.ffn.experts.*.w1.weight
DEFAULT_MAX_TOKENS = 256  # per rank per step when the profile has no graph token limit (cpu)


class LayoutError(IRError):
    """A parallel layout that cannot work; the message names the flag and the fix."""


# -- the layout ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelLayout:
    """What `--dp/--ep/--redundant-experts/--ep-max-tokens/--balanced-routing` ask for, resolved
    against a graph (experts E, top-k k)."""

    dp: int
    ep: int
    experts: int  # E logical experts per MoE layer
    topk: int  # k
    redundant: int = 0  # K extra replicas over the whole EP group
    max_tokens: int = DEFAULT_MAX_TOKENS  # per rank per step: sizes the static dispatch buffers
    routing: str = "model"  # "balanced": benchmarks only (graph/ops/parallel.py ep_place)

    @property
    def slots_per_rank(self) -> int:
        return (self.experts + self.redundant) // self.ep

    @property
    def rows_per_peer(self) -> int:
        from megagraph.graph.ops.parallel import rows_per_peer

        return rows_per_peer(self.max_tokens, self.topk, self.slots_per_rank)

    @property
    def max_replicas(self) -> int:
        """Columns of the expert map: 1 + K (no expert needs more replicas than that)."""
        return 1 + self.redundant

    def check_ranks(self) -> None:
        """The checks that do not need the model."""
        for flag, v in (("--dp", self.dp), ("--ep", self.ep), ("--ep-max-tokens", self.max_tokens)):
            if not isinstance(v, int) or v < 1:
                raise LayoutError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.redundant < 0:
            raise LayoutError(f"--redundant-experts must be >= 0, got {self.redundant}")
        if self.ep not in (1, self.dp):
            raise LayoutError(
                f"--ep {self.ep} with --dp {self.dp}: supported layouts are DEP (--ep equal to --dp: "
                "every rank runs attention for its own requests and holds 1/ep of the experts) and "
                "plain data parallel (--ep 1: every rank holds every expert)")
        if self.ep == 1 and self.redundant:
            raise LayoutError("--redundant-experts needs expert parallelism (--ep > 1)")
        if self.routing not in ("model", "balanced"):
            raise LayoutError(f"routing must be 'model' or 'balanced', got {self.routing!r}")
        if self.ep == 1 and self.routing == "balanced":
            raise LayoutError("--balanced-routing needs expert parallelism (--ep > 1)")

    def check(self) -> None:
        self.check_ranks()
        if (self.experts + self.redundant) % self.ep:
            lo = self.redundant - (self.experts + self.redundant) % self.ep
            hi = lo + self.ep
            fits = f"{lo} or {hi}" if lo >= 0 else str(hi)
            raise LayoutError(
                f"--redundant-experts {self.redundant}: {self.experts} experts + {self.redundant} "
                f"redundant = {self.experts + self.redundant} slots do not split evenly over "
                f"--ep {self.ep} ranks; use --redundant-experts {fits}")

    def initial_placement(self) -> list[list[int]]:
        """Logical expert of every slot, per rank: [ep][L]. Experts split into contiguous chunks
        (sizes differ by at most one); the K replicas copy experts round-robin over the chunks
        and go to the rank with the most free slots that lacks that expert (ties: the next rank
        after the expert's own). With uniform load and E, K divisible by ep this is balanced;
        EPLB replaces it from measured load at run time."""
        P, L, E = self.ep, self.slots_per_rank, self.experts
        base, extra = divmod(E, P)
        chunks, start = [], 0
        for r in range(P):
            n = base + (r < extra)
            chunks.append(list(range(start, start + n)))
            start += n
        slots = [list(c) for c in chunks]
        order = [chunks[r][i] for i in range(max(map(len, chunks), default=0)) for r in range(P)
                 if i < len(chunks[r])]
        owner = {e: r for r, c in enumerate(chunks) for e in c}
        for i in range(self.redundant):
            e = order[i % len(order)]
            src = owner[e]
            cands = [r for r in range(P) if len(slots[r]) < L and e not in slots[r]] or \
                    [r for r in range(P) if len(slots[r]) < L]
            dst = min(cands, key=lambda r: (-(L - len(slots[r])), (r - src - 1) % P))
            slots[dst].append(e)
        return slots

    def to_meta(self, placement: list[list[int]], layers: list[int], dispatch: str) -> dict:
        return {"dp": self.dp, "ep": self.ep, "ep_experts": self.experts, "ep_topk": self.topk,
                "ep_redundant": self.redundant, "ep_slots_per_rank": self.slots_per_rank,
                "ep_max_tokens": self.max_tokens, "ep_rows_per_peer": self.rows_per_peer,
                "ep_routing": self.routing, "ep_layers": layers, "ep_placement": placement,
                "ep_dispatch": dispatch}

    @classmethod
    def from_graph(cls, g: Graph) -> ParallelLayout | None:
        """The layout a compiled graph records (None: a single-rank graph)."""
        dp = g.meta_value("dp")
        if dp is None:
            return None
        if g.meta_value("ep", 1) == 1:
            return cls(dp, 1, 0, 0)
        return cls(dp, g.meta_value("ep"), g.meta_value("ep_experts"), g.meta_value("ep_topk"),
                   g.meta_value("ep_redundant"), g.meta_value("ep_max_tokens"),
                   g.meta_value("ep_routing"))


def graph_placement(g: Graph) -> list[list[int]]:
    """The initial placement recorded in a compiled graph's meta ([ep][L] logical experts)."""
    return [list(r) for r in g.meta_value("ep_placement")]


def dispatch_choice(hw: HwProfile) -> str:
    """Which dispatch/combine implementation the profile gets (also in plan.yaml's kernel table)."""
    if "deepep" in hw.kernel_libraries and hw.cuda_graphs:
        return ("deepep if `deep_ep` imports on CUDA (low-latency mode for captured decode steps, "
                "normal mode for eager prefill), else nccl all_to_all_single over static buffers")
    if hw.is_gpu:
        return "nccl all_to_all_single over static buffers (capturable)"
    return "gloo all_to_all_single over static buffers"


def local_weight_name(name: str) -> str:
    """layers.3.ffn.experts.*.w1.weight -> layers.3.ffn.experts.local.w1.weight"""
    if ".*." not in name:
        raise IRError(f"expert weight @{name} is not a stacked ('*') expert bank")
    return name.replace(".*.", f".{LOCAL}.")


def source_weight_name(name: str) -> str:
    """The inverse of local_weight_name: the stacked checkpoint bank a slot weight gathers from."""
    return name.replace(f".{LOCAL}.", ".*.")


# -- what the runtime reads back -----------------------------------------------------------------
@dataclass(frozen=True)
class EpSite:
    """One expert-parallel MoE site of a compiled graph."""

    layer: int
    map_input: str  # graph input i64[E, 1 + K]
    local_weights: tuple[str, ...]  # slot weights [L, ...] (w1, [scale], w3, [scale], w2, [scale])
    slots_output: str  # graph output label of the pairs' physical slots (EPLB load)


def ep_sites(g: Graph) -> list[EpSite]:
    """The EP sites of a compiled step graph, in execution (= collective) order."""
    prod = g.producers()
    out_label = {v: lab for lab, v in g.outputs}
    sites = []
    for n in g.nodes:
        if n.op != "ep_combine":
            continue
        experts = prod[n.inputs[0]]
        disp = prod[n.inputs[2]]
        place = prod[disp.inputs[0]]
        ws = tuple(w for w in experts.inputs if w is not None and w in g.weights)
        sites.append(EpSite(layer_of(n.outputs[0]), place.inputs[1], ws,
                            out_label.get(place.outputs[0], "")))
    return sites


def all_to_all_bytes(g: Graph) -> int:
    """Bytes one rank receives per step through the EP collectives (= bytes it sends): the static
    blocks of every dispatch output and combine input, whatever the step's token count. (An
    implementation that moves only filled rows, DeepEP's, moves at most 1/ep of this.)"""
    from megagraph.graph.types import DTYPES

    total = 0
    for n in g.nodes:
        vals = [o for i, o in enumerate(n.outputs) if i != 2] if n.op == "ep_dispatch" else \
            [n.inputs[0]] if n.op == "ep_combine" else []
        for v in vals:
            t = g.types[v]
            elems = 1
            for d in t.shape:
                elems *= d
            total += elems * DTYPES[t.dtype][0] // 8
    return total


def collective_signature(g: Graph) -> list[str]:
    """The collectives a graph issues, in order, with everything that sizes them: two graphs with
    equal signatures can run on different ranks in the same step without deadlock."""
    from megagraph.graph.text import format_attrs

    return [f"{n.op} {format_attrs(n.attrs)} ({', '.join(str(g.types[v]) for v in n.inputs if v)})"
            for n in g.nodes if get_op(n.op).cost == "collective"]


# -- the pass ------------------------------------------------------------------------------------
class NoSite(Exception):
    pass


@register_pass
@dataclass(frozen=True)
class ExpertParallel(Pass):
    """Turn every MoE site into route -> ep_place -> ep_dispatch -> local experts -> ep_combine.

    before (one site, unfused; moe_experts_q / a fused mega_moe are handled the same way, the
    latter split back into route + experts + shared + hc_expand around the collectives):
      %L0.ffn.ids, %L0.ffn.weights = route(%L0.ffn.xn, @gate.weight, @gate.bias) {topk=2, ...}
      %L0.ffn.routed = moe_experts(%L0.ffn.xn, %L0.ffn.ids, %L0.ffn.weights, @experts.*.w1, ...)
    after (--dp 4 --ep 4, E = 8: L = 2 slots per rank):
      input %L0.ffn.ep_map : i64[8, 1]
      %L0.ffn.ep_slots = ep_place(%L0.ffn.ids, %L0.ffn.ep_map) {ep_size=4, slots_per_rank=2}
      %L0.ffn.ep_recv_ids, %L0.ffn.ep_recv_w, %L0.ffn.ep_handle, %L0.ffn.ep_recv_x =
          ep_dispatch(%L0.ffn.ep_slots, %L0.ffn.xn) {ep_size=4, max_tokens=256, slots_per_rank=2}
      %L0.ffn.ep_y = moe_experts(%L0.ffn.ep_recv_x, %L0.ffn.ep_recv_ids, %L0.ffn.ep_recv_w,
          @experts.local.w1, ...)
      %L0.ffn.routed = ep_combine(%L0.ffn.ep_y, %L0.ffn.ep_recv_w, %L0.ffn.ep_handle,
          %L0.ffn.weights) {...}
      return ..., L0.expert_slots=%L0.ffn.ep_slots

    Runs after mega-moe-fusion (it splits mega_moe: DeepGEMM's EP MegaMoE over symmetric memory
    is an sm_100 kernel we do not have; the front half mega_mhc stays fused) and before
    partition-prefill (the collectives are capturable: they sit inside captured segments).
    Skipped (and left out of the pipeline's records) for a single-rank layout.
    """

    name: ClassVar[str] = "expert-parallel"
    hw: HwProfile
    dp: int = 1
    ep: int = 1
    redundant_experts: int = 0
    max_tokens: int = 0  # 0: the profile's graph token limit, else DEFAULT_MAX_TOKENS
    routing: str = "model"

    def layout(self, g: Graph) -> ParallelLayout:
        sites = [n for n in g.nodes if n.op in EXPERT_OPS]
        experts = topk = 0
        if sites:
            n = sites[0]
            first = BANK_INDEX[n.op]
            experts = g.types[n.inputs[first]].shape[0]
            topk = n.attr("topk") if n.op == "mega_moe" else g.types[n.inputs[first - 1]].shape[1]
        mt = self.max_tokens or self.hw.graph_token_limit or DEFAULT_MAX_TOKENS
        lay = ParallelLayout(self.dp, self.ep, experts, topk, self.redundant_experts, mt, self.routing)
        lay.check()
        return lay

    def run(self, g: Graph) -> PassResult:
        if self.dp == 1 and self.ep == 1:
            return self.skip(g, "single rank (--dp 1 --ep 1)")
        lay = self.layout(g)
        if lay.ep == 1:
            return PassResult(g.with_meta(dp=lay.dp, ep=1),
                              f"data parallel x{lay.dp}, experts replicated: every rank runs this "
                              "graph for its own requests, no collectives", {"dp": lay.dp, "ep": 1})
        sites = [n for n in g.nodes if n.op in EXPERT_OPS]
        if not sites:
            raise LayoutError(f"--ep {lay.ep}: graph {g.name} has no MoE site to parallelize")
        placement = lay.initial_placement()
        g2, idle_nodes, layers = _rewrite(g, sites, lay)
        dispatch = dispatch_choice(self.hw)
        g2 = g2.with_meta(**lay.to_meta(placement, layers, dispatch))
        idle = _idle_graph(g2, idle_nodes)
        n_sites = len(layers)
        note = (f"DEP x{lay.ep}: {n_sites} MoE sites -> ep_place -> ep_dispatch -> "
                f"{lay.slots_per_rank} local expert slots -> ep_combine; {lay.rows_per_peer} rows per peer "
                f"(max_tokens {lay.max_tokens} x min(k={lay.topk}, L)), "
                f"{all_to_all_bytes(g2) / 2**30:.3g} GiB all-to-all per rank per step; dispatch: {dispatch}; "
                f"side graph {IDLE_GRAPH} for ranks without tokens")
        stats = {"dp": lay.dp, "ep": lay.ep, "sites": n_sites, "experts": lay.experts,
                 "redundant_experts": lay.redundant, "slots_per_rank": lay.slots_per_rank,
                 "max_tokens_per_rank": lay.max_tokens, "rows_per_peer": lay.rows_per_peer,
                 "routing": lay.routing, "dispatch": dispatch,
                 "collectives_per_step": sum(1 for _ in collective_signature(g2)),
                 "all_to_all_bytes_per_step": all_to_all_bytes(g2),
                 "placement": {f"rank{r}": s for r, s in enumerate(placement)}}
        return PassResult(g2, note, stats, {IDLE_GRAPH: idle})


def _rewrite(g: Graph, sites: list[Node], lay: ParallelLayout):
    """Add the map inputs and local slot weights, rewrite every site; returns (graph, idle nodes
    per site, layers)."""
    new_inputs, new_types, renamed_w = [], {}, {}
    for n in sites:
        pfx = n.outputs[0].rsplit(".", 1)[0]
        name = f"{pfx}.ep_map"
        new_inputs.append(name)
        new_types[name] = TensorType("i64", (lay.experts, lay.max_replicas))
        first = BANK_INDEX[n.op]
        for w in n.inputs[first:first + 6]:
            if w is not None:
                t = g.types[w]
                if t.shape[0] != lay.experts:
                    raise LayoutError(f"site %{n.outputs[0]}: expert bank @{w} has {t.shape[0]} "
                                      f"experts, the first site {lay.experts}")
                renamed_w[w] = local_weight_name(w)
                new_types[renamed_w[w]] = TensorType(t.dtype, (lay.slots_per_rank, *t.shape[1:]))
    weights = []
    for w in g.weights:
        weights.append(w)
        if w in renamed_w:
            weights.append(renamed_w[w])
    g = replace(g, inputs=g.inputs + tuple(new_inputs), weights=tuple(weights),
                types={**g.types, **new_types})
    rw = Rewrite(g, ExpertParallel.name)
    ep = {"ep_size": lay.ep, "slots_per_rank": lay.slots_per_rank}
    epm = {**ep, "max_tokens": lay.max_tokens}
    idle, layers, extra_out = [], [], []
    prod = g.producers()
    for n in sites:
        pfx = n.outputs[0].rsplit(".", 1)[0]
        a = get_op(n.op).resolve_attrs(n.attr_dict, n.outputs[0])
        new: list[Node] = []
        if n.op == "mega_moe":
            x, xq, xs, streams, post, comb, gate_w, gate_b = n.inputs[:8]
            banks = n.inputs[8:14]
            shared, (tid2eid, token_ids) = n.inputs[14:20], n.inputs[20:22]
            ids, wts = rw.fresh(f"{pfx}.ids"), rw.fresh(f"{pfx}.weights")
            if tid2eid is not None:
                new.append(rw.node("hash_route", [x, gate_w, tid2eid, token_ids], [ids, wts],
                                   topk=a["topk"], route_scale=a["route_scale"],
                                   score_func=a["score_func"], norm_topk=a["norm_topk"]))
            else:
                new.append(rw.node("route", [x, gate_w, gate_b], [ids, wts], topk=a["topk"],
                                   route_scale=a["route_scale"], norm_topk=a["norm_topk"],
                                   score_func=a["score_func"]))
            payload = [xq, xs]
            expert_op = "moe_experts_q"
            out_dtype = g.types[x].dtype
            expert_attrs = {"fmt": a["fmt"], "swiglu_limit": a["swiglu_limit"],
                            "act_fmt": a["act_fmt"], "out_dtype": out_dtype}
            routed_name = rw.fresh(f"{pfx}.routed")
        else:
            k0 = 2 if n.op == "moe_experts" else 3
            payload = list(n.inputs[:k0 - 1])
            ids, wts = n.inputs[k0 - 1], n.inputs[k0]
            banks = n.inputs[k0 + 1:k0 + 7]
            expert_op, expert_attrs, routed_name = n.op, a, n.outputs[0]
            router = prod.get(ids)
            if router is None or router.op not in ("route", "hash_route"):
                raise LayoutError(f"site %{n.outputs[0]}: expert ids %{ids} do not come from a router")
        slots = rw.fresh(f"{pfx}.ep_slots")
        new.append(rw.node("ep_place", [ids, f"{pfx}.ep_map"], [slots], routing=lay.routing, **ep))
        recv = [rw.fresh(f"{pfx}.ep_recv_{s}") for s in ("ids", "w")]
        handle = rw.fresh(f"{pfx}.ep_handle")
        recv_p = [rw.fresh(f"{pfx}.ep_recv_{'x' if i == 0 else 'x_scale'}") for i in range(len(payload))]
        disp = rw.node("ep_dispatch", [slots, *payload], [*recv, handle, *recv_p], **epm)
        local_banks = [None if w is None else renamed_w[w] for w in banks]
        ey = rw.fresh(f"{pfx}.ep_y")
        experts = rw.node(expert_op, [*recv_p, *recv, *local_banks], [ey], **expert_attrs)
        combine = rw.node("ep_combine", [ey, recv[1], handle, wts], [routed_name], **epm)
        new += [disp, experts, combine]
        if n.op == "mega_moe":
            y = routed_name
            if shared[0] is not None:
                sh = rw.fresh(f"{pfx}.shared")
                new.append(rw.node("swiglu_mlp_q", [xq, xs, *shared], [sh], fmt=a["shared_fmt"],
                                   swiglu_limit=a["swiglu_limit"], act_fmt=a["act_fmt"],
                                   out_dtype=out_dtype))
                y = rw.fresh(f"{pfx}.ffn_out")
                new.append(rw.node("add", [routed_name, sh], [y]))
            new.append(rw.node("hc_expand", [streams, y, post, comb], [n.outputs[0]]))
        rw.remove(n)
        rw.insert_after(n, *new)
        idle.append((disp, experts, combine))
        layer = layer_of(n.outputs[0])
        layers.append(layer)
        extra_out.append((f"L{layer}.expert_slots", slots))
    g2 = rw.apply()
    g2 = g2.with_nodes(g2.nodes, outputs=g2.outputs + tuple(extra_out))
    return g2, idle, layers


def _idle_graph(g: Graph, idle_nodes) -> Graph:
    """Every site's dispatch -> local experts -> combine, standalone, for a rank with T = 0."""
    inputs, weights, nodes, outputs, types = [], [], [], [], {}
    for disp, experts, combine in idle_nodes:
        for v in (*disp.inputs, combine.inputs[3]):
            if v not in inputs:
                inputs.append(v)
        for w in experts.inputs:
            if w is not None and w in g.weights and w not in weights:
                weights.append(w)
        nodes += [disp, experts, combine]
        outputs.append((combine.outputs[0], combine.outputs[0]))
    for v in (*inputs, *weights, *(o for n in nodes for o in n.outputs)):
        types[v] = g.types[v]
    meta = {k: v for k, v in g.meta if k in ("model", "family", "dp", "ep")}
    meta["role"] = ("a rank with no tokens in a step: every MoE site's dispatch, local experts "
                    "and combine at T = 0, in the step graph's order")
    from megagraph.graph.ir import freeze_attrs

    idle = Graph(f"{g.name.split('/')[0]}/{IDLE_GRAPH}", ("T",), tuple(inputs), tuple(weights),
                 tuple(nodes), tuple(outputs), types, freeze_attrs(meta))
    return verify_graph(idle)


def check_options(opt) -> None:
    """Option combinations `compile` refuses before building anything (opt: CompileOptions).
    What needs the model (experts vs ranks) is checked by the pass."""
    if opt.dp == 1 and opt.ep == 1 and not opt.redundant_experts and not opt.balanced_routing:
        return
    if opt.ep_max_tokens < 0:
        raise LayoutError(f"--ep-max-tokens must be >= 0 (0 = auto), got {opt.ep_max_tokens}")
    ParallelLayout(opt.dp, opt.ep, 0, 0, opt.redundant_experts, opt.ep_max_tokens or 1,
                   "balanced" if opt.balanced_routing else "model").check_ranks()
    if opt.bounded_replay and opt.ep > 1:
        raise LayoutError("--bounded-replay with --ep > 1 is not supported yet: a rank would run "
                          "the prefix/suffix graphs while others run the step graph, and every "
                          "MoE layer's collectives must be joined once per step by every rank")
    if opt.passes is not None and ExpertParallel.name not in opt.passes:
        raise LayoutError(f"--dp/--ep need the {ExpertParallel.name} pass; add it to -p "
                          "(after mega-moe-fusion, before partition-prefill)")


__all__ = [
    "IDLE_GRAPH",
    "EpSite",
    "ExpertParallel",
    "LayoutError",
    "ParallelLayout",
    "check_options",
    "collective_signature",
    "dispatch_choice",
    "ep_sites",
    "graph_placement",
    "local_weight_name",
    "source_weight_name",
]
