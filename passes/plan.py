"""The execution plan written to plan.yaml: segments, breaks, buckets, static buffers, graph memory
per bucket, kernel choice per op, the memory plan (weights, state, graph pools) and the model's
index-key reading.

Everything is computed from types and the hardware profile, with no tensors. Bytes assume
R = T (every row its own request: an upper bound) and N = `context` tokens per slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagraph.graph.ir import Graph
from megagraph.graph.registry import get_op
from megagraph.graph.types import TensorType
from megagraph.kernels import kernel_config as kc
from megagraph.kernels.registry import choose_kernel, kernel_key
from megagraph.models.config import ModelConfig

from .base import layer_of
from .hw import HwProfile
from .partition import segments


@dataclass(frozen=True)
class Linear:
    """bytes = per_token * T + fixed, for a value or a sum of values."""

    per_token: int
    fixed: int

    def at(self, t: int) -> int:
        return self.per_token * t + self.fixed

    def __add__(self, o: "Linear") -> "Linear":
        return Linear(self.per_token + o.per_token, self.fixed + o.fixed)


ZERO = Linear(0, 0)


def value_bytes(t: TensorType, *, context: int) -> Linear:
    """Bytes of a value as a linear function of the step's rows (T, or K in suffix graphs)."""

    def at(rows: int) -> int:
        return t.nbytes({"T": rows, "K": rows, "R": rows, "N": context, "S": 1})

    one, two = at(1), at(2)
    return Linear(two - one, 2 * one - two)


def _aliases(g: Graph) -> set[str]:
    """Values that own no memory: views, and state updates written in place into their input."""
    state = {v for lab, v in g.outputs if lab in g.inputs}
    views = {o for n in g.nodes if get_op(n.op).cost == "view" for o in n.outputs}
    return state | views


def live_profile(g: Graph, *, context: int) -> list[Linear]:
    """Live intermediate bytes after each node (inputs, weights and state excluded)."""
    alias = _aliases(g)
    last: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            if v is not None:
                last[v] = i
    keep_to_end = {v for _, v in g.outputs}
    size = {o: (ZERO if o in alias else value_bytes(g.types[o], context=context))
            for n in g.nodes for o in n.outputs}
    live, out = ZERO, []
    frees: dict[int, list[str]] = {}
    for o, i in last.items():
        if o in size and o not in keep_to_end:
            frees.setdefault(i, []).append(o)
    for i, n in enumerate(g.nodes):
        for o in n.outputs:
            live = live + size[o]
        out.append(live)
        for o in frees.get(i, ()):
            live = live + Linear(-size[o].per_token, -size[o].fixed)
    return out


def peak_at(profile: list[Linear], rows: int) -> int:
    return max((p.at(rows) for p in profile), default=0)


def static_buffers(g: Graph, segs, *, context: int) -> list[dict]:
    """Values produced in one segment and read in a later one (they must live in fixed buffers)."""
    seg_of = {o: i for i, s in enumerate(segs) for n in s.nodes for o in n.outputs}
    readers: dict[str, set[int]] = {}
    for i, s in enumerate(segs):
        for n in s.nodes:
            for v in n.inputs:
                if v in seg_of and seg_of[v] != i:
                    readers.setdefault(v, set()).add(i)
    out = []
    for v in sorted(readers, key=lambda v: (seg_of[v], v)):
        b = value_bytes(g.types[v], context=context)
        out.append({"value": v, "type": str(g.types[v]), "from_segment": seg_of[v],
                    "to_segments": sorted(readers[v]), "bytes_per_token": b.per_token,
                    "fixed_bytes": b.fixed})
    return out


def kernel_table(graphs: dict[str, Graph], hw: HwProfile, *,
                 allow_unvalidated: bool = False) -> dict:
    """Kernel choice per op variant (op[attr=value]) with the reason, its node count in the step
    graph, the graphs it appears in, and the kernel family whose config its fast kernel takes."""
    rows: dict[str, dict] = {}
    for name, g in graphs.items():
        for n in g.nodes:
            attrs = n.attr_dict
            key = kernel_key(n.op, attrs)
            if key not in rows:
                impl, why = choose_kernel(n.op, attrs, hw.capabilities, hw.arch,
                                          allow_unvalidated=allow_unvalidated)
                rows[key] = {"kernel": impl, "reason": why, "nodes": 0, "graphs": []}
                fam = kc.family_of(key)
                if fam is not None:
                    rows[key]["family"] = fam
            rows[key]["nodes"] += name == "step"
            if name not in rows[key]["graphs"]:
                rows[key]["graphs"].append(name)
    return dict(sorted(rows.items()))


def bucket_shapes(cfg: ModelConfig, buckets: list[int], *, decode: bool) -> list[dict[str, int]]:
    """The problem facts `KernelConfig.choose` receives per bucket (kernel_config.SHAPE_KEYS)."""
    fixed = {"decode": int(decode), "hidden": cfg.hidden_size,
             "intermediate": cfg.moe_intermediate_size, "experts": cfg.n_routed_experts,
             "topk": cfg.experts_per_token, "heads": cfg.num_heads, "head_dim": cfg.head_dim,
             "index_topk": cfg.index_topk, "vocab": cfg.vocab_size}
    return [{"tokens": b, **fixed} for b in buckets]


def kernel_configs_plan(kernels: dict, cfg: ModelConfig, hw: HwProfile, *, prefill: list[int],
                        decode: list[int], overrides: dict | None = None) -> dict:
    """Per family whose fast kernels the plan runs: its resolved fields (defaults <- configs/kernels/
    <profile>.yaml <- the compile's overrides), the kernel keys and step-graph node counts that
    use it, and its `choose()` per prefill and per decode bucket as runs of equal choices (none
    on a profile without captured buckets: its kernels call `choose` per launch)."""
    used: dict[str, dict[str, int]] = {}
    for key, row in kernels.items():  # only where a fast kernel runs (reference / capturable
        if "family" in row and row["kernel"] not in ("reference", "capturable"):  # take none)
            used.setdefault(row["family"], {})[key] = row["nodes"]
    configs = kc.compile_configs(hw.name, overrides)  # checks the layers even when none is used
    out = {}
    for fam, ops in sorted(used.items()):
        c = configs[fam]
        out[fam] = {
            "fields": c.to_dict(),
            "ops": dict(sorted(ops.items())),
            "choose": {"prefill": kc.choice_runs(c, bucket_shapes(cfg, prefill, decode=False)),
                       "decode": kc.choice_runs(c, bucket_shapes(cfg, decode, decode=True))}}
    return out


STATE_KINDS = ((".ring", "rings"), (".ckv", "compressed_kv"), (".ikey", "index_keys"),
               (".pend_", "pending_rows"), ("engram_hist", "engram_history"))


def state_plan(g: Graph, *, context: int) -> dict:
    """State bytes per token of context and per slot, by kind."""
    per_token: dict[str, int] = {}
    per_slot: dict[str, int] = {}
    for s in g.state_labels:
        kind = next((k for pat, k in STATE_KINDS if pat in s), "other")
        t = g.types[s]
        a = t.nbytes({"S": 1, "N": 1024})
        b = t.nbytes({"S": 1, "N": 2048})
        per_token[kind] = per_token.get(kind, 0) + (b - a) // 1024
        per_slot[kind] = per_slot.get(kind, 0) + (2 * a - b)
    return {"per_token_bytes": dict(sorted(per_token.items())),
            "per_slot_fixed_bytes": dict(sorted(per_slot.items())),
            "total_per_token_bytes": sum(per_token.values()),
            "total_per_slot_fixed_bytes": sum(per_slot.values()),
            "per_slot_bytes_at_context": sum(per_token.values()) * context + sum(per_slot.values())}


def weights_plan(g: Graph) -> dict:
    """Weight bytes by dtype; weights read only by eager host ops (Engram tables) stay on the host."""
    users = g.users()
    by: dict[str, int] = {}
    host = 0
    for w in g.weights:
        t = g.types[w]
        b = t.nbytes({})
        by[t.dtype] = by.get(t.dtype, 0) + b
        if users.get(w) and all(get_op(u.op).is_break for u in users[w]):
            host += b
    total = sum(by.values())
    return {"by_dtype_bytes": dict(sorted(by.items())), "total_bytes": total,
            "host_resident_bytes": host, "device_bytes": total - host, "tensors": len(g.weights)}


def index_keys_plan(g: Graph, cfg: ModelConfig) -> dict:
    """The decode index-key reading (models/index_keys.py) and, read off the graph, which index
    sources score against another layer's published pool on the decode rows their owner's group
    leaves open: {layer: pool's layer} (empty under `owner`)."""
    prod = g.producers()
    reads = {}
    for n in g.nodes:
        if n.op == "published_scores":
            pool = prod[n.inputs[1]].inputs[2]  # index_scores(qi, w, the published pool, ...)
            reads[f"L{layer_of(n.outputs[0])}"] = f"L{layer_of(pool)}"
    return {"reading": cfg.index_key_reading, "published_reads": reads}


def prefix_cache_plan(g: Graph, cfg: ModelConfig) -> dict:
    """How a prefix-cache hit resumes (runtime/prefix_cache.py): which state a cached node keeps
    by position, which it keeps as a snapshot of its end, and the ring-rebuild graph."""
    by_position, at_end, window = [], [], []
    for name in g.state_labels:
        dims = g.types[name].shape[1:]
        if dims and isinstance(dims[0], str) and dims[0].startswith("N"):
            by_position.append(name)
        elif name.endswith(".ring"):
            window.append(name)
        else:
            at_end.append(name)
    return {"encoder_replay": "encoder-replay", "replay_tokens": cfg.sliding_window,
            "kept_by_position": by_position, "kept_at_node_end": at_end,
            "window_tail": window,
            "resume": "at a cached node's end: rows by position and the end snapshot restored; "
                      "the window tail restored when kept, else rebuilt by encoder-replay over "
                      "the last replay_tokens cached tokens (approximate; mode exact re-prefills)"}


def speculative_plan(extra: dict[str, Graph], cfg: ModelConfig) -> dict:
    """The plan's `speculative` section: which graphs draft and verify, and how a step ends."""
    B = cfg.dspark_block_size
    return {"method": "dspark", "draft_graph": "dspark-draft",
            "verify_graph": "dspark-verify" if "dspark-verify" in extra else None,
            **({} if "dspark-verify" in extra else {
                "verify_missing": "the fused compressor does not expose its per-row pending rows "
                                  "(see the dspark-draft note in manifest.yaml)"}),
            "block_size": B,
            "max_tokens_per_target_forward": B + 1,
            "proposal": "argmax of the Markov chain (one-hot q)",
            "verify": "the step graph over [anchor, d_1 .. d_k] (k <= block_size), plus each "
                      "compressor's per-row pending inputs",
            "rollback": "explicit restore of the rows the verify step can touch "
                        "(runtime/speculative/rollback.py, docs/speculative.md)"}


def build_plan(g: Graph, hw: HwProfile, *, context: int, extra: dict[str, Graph],
               cfg: ModelConfig, kernel_overrides: dict | None = None,
               allow_unvalidated: bool = False) -> dict:
    """The plan of a compiled step graph (+ bounded-replay graphs, if any) of model `cfg`;
    `kernel_overrides` ({family: {field: value}}) are the compile's kernel-config layers above
    the profile's, `allow_unvalidated` lets kernels not yet run on their device be chosen."""
    segs = segments(g)
    captured = hw.cuda_graphs
    prefill = hw.prefill_token_buckets() if captured else []
    decode = list(hw.decode_buckets) if captured else []
    prof = live_profile(g, context=context)
    seg_rows, start = [], 0
    for i, s in enumerate(segs):
        kind = s.kind if captured else "eager"
        row = {"index": i, "kind": kind, "first": s.first, "last": s.last, "nodes": len(s.nodes)}
        if s.reasons:
            row["breaks"] = list(s.reasons)
        elif not captured:
            row["why_eager"] = f"profile {hw.name} has no CUDA graphs"
        else:  # captured once per prefill bucket and per decode bucket
            row["captures"] = len(set(prefill) | set(decode))
            if prefill:
                row["peak_bytes_at_limit"] = peak_at(prof[start:start + len(s.nodes)], prefill[-1])
        seg_rows.append(row)
        start += len(s.nodes)
    bufs = static_buffers(g, segs, context=context) if len(segs) > 1 else []
    buf_total = sum((Linear(b["bytes_per_token"], b["fixed_bytes"]) for b in bufs), ZERO)
    graph_mem = {"prefill": {b: peak_at(prof, b) for b in prefill},
                 "decode": {b: peak_at(prof, b) for b in decode}}
    pools = {"prefill": max(graph_mem["prefill"].values(), default=0),
             "decode": max(graph_mem["decode"].values(), default=0)}
    buckets = {"prefill_tokens": prefill, "decode_rows": decode,
               "graph_token_limit": hw.graph_token_limit,
               "above_limit": "eager" if captured else "eager (no CUDA graphs on this profile)"}
    replay_plan = None
    if "prefill-suffix" in extra:
        replay = hw.replay_buckets()
        suffix = extra["prefill-suffix"]
        limit = hw.graph_token_limit if captured else 0
        replay_plan = {
            "keep": suffix.meta_value("keep"), "boundary_layer": suffix.meta_value("boundary_layer"),
            "graphs": {"prefix": "prefill-prefix", "suffix": "prefill-suffix"},
            "suffix_row_buckets": replay,
            "default": "on" if hw.bounded_replay_default else "off",
            "step_tokens_above": limit,
            "use_for": (f"steps of more than {limit} tokens (above the captured step graphs) "
                        if limit else "steps ") + "with a chunk longer than `keep`: the prefix "
                       "on every row, eagerly; the suffix on each request's last `keep` rows",
            "never_for": "steps with a request that wants prompt logprobs (every row): the "
                         "step graph",
            "captured": "the suffix after its row selection, per suffix row bucket (kept rows "
                        "padded to the smallest that holds them)" if replay
                        else "nothing (no CUDA graphs on this profile)",
            "above_largest_bucket": "the suffix runs eagerly",
            "exact_path": "the step graph; replay is approximate, see "
                          "benchmarks/results/cpu/bounded-replay.md"}
        sprof = live_profile(extra["prefill-suffix"], context=context)
        buckets["suffix_rows"] = replay
        graph_mem["suffix"] = {b: peak_at(sprof, b) for b in replay}
        pools["suffix"] = max(graph_mem["suffix"].values(), default=0)
    weights, state = weights_plan(g), state_plan(g, context=context)
    device = int(hw.memory_gib * 2**30)
    need = weights["device_bytes"] + state["per_slot_bytes_at_context"] + max(pools.values(), default=0)
    memory = {"weights": weights, "state": state, "graph_pools_bytes": pools,
              "device_memory_bytes": device,
              "one_slot_at_context_bytes": need,
              "fits_one_device": (need <= device) if device else None}
    kernels = kernel_table({"step": g, **extra}, hw, allow_unvalidated=allow_unvalidated)
    return {
        "assumptions": {"context_tokens": context, "requests": "R = T (upper bound)",
                        "bytes": "intermediates only; views and in-place state updates own none"},
        "segments": seg_rows,
        "buckets": buckets,
        "static_buffers": bufs,
        "static_buffer_bytes": {b: buf_total.at(b) for b in prefill} if bufs else {},
        "graph_memory_bytes": graph_mem,
        "kernels": kernels,
        "kernel_options": {"allow_unvalidated": allow_unvalidated},
        "kernel_configs": kernel_configs_plan(kernels, cfg, hw, prefill=prefill, decode=decode,
                                              overrides=kernel_overrides),
        **({"bounded_replay": replay_plan} if replay_plan else {}),
        **({"prefix_cache": prefix_cache_plan(g, cfg)} if "encoder-replay" in extra else {}),
        **({"speculative": speculative_plan(extra, cfg)} if "dspark-draft" in extra else {}),
        "memory": memory,
        "index_keys": index_keys_plan(g, cfg),
    }

