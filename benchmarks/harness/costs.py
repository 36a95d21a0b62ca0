"""The FLOP and byte model of a step (from the compiled graph's weight shapes and the model
config) and the extrapolation of a layer slice to the 40 layers of V4.1-Flash: the roofline and
MFU figures of prefill.py and decode.py."""
from __future__ import annotations

import math

import torch

from .optime import node_scope

GATHER_OPS = {"embed", "engram_lookup", "token_map"}


def _elems(t) -> int:
    n = math.prod(int(d) for d in t.shape)
    return 2 * n if t.dtype == "fp4x2" else n


def _positions(reqs) -> torch.Tensor:
    """Positions of every new token of requests given as (cached, new)."""
    return torch.cat([torch.arange(c, c + n, dtype=torch.int64) for c, n in reqs]) if reqs \
        else torch.zeros(0, dtype=torch.int64)


def touched_experts(E: int, k: int, tokens: int, routing: str) -> float:
    """Experts a step's routing touches: k distinct of E per token; uniform random (model routing
    of random weights) -> E * (1 - (1 - k/E)^T); balanced -> min(E, T*k)."""
    if routing == "balanced":
        return float(min(E, tokens * k))
    return E * (1.0 - (1.0 - k / E) ** tokens)


def step_costs(g, cfg, reqs: list[tuple[int, int]], *, routing: str = "model",
               host: set[str] = frozenset()) -> dict:
    """FLOPs (2 per multiply-add) and minimum bytes of one step of the compiled graph `g` over
    requests given as (cached tokens, new tokens), per node scope (see node_scope).

    FLOPs: every weight of rank >= 2 a node reads is a GEMM over its rows (token or request rows;
    compressor index keys once per group of `ratio`), stacked routed experts x top-k / E; sparse
    attention 2 * H * D per key (scores and values, K = V) over min(window, p+1) window keys plus
    min(top-k, (p+1)//ratio) compressed keys; indexer Hi * Di per visible index key (p+1)//ratio.
    Bytes (what a decode step must read at least): every device-resident weight once (routed
    experts: the fraction the routing touches), per request the window ring and the selected
    compressed rows of each attention layer and every visible index key of each indexer, in the
    state's storage dtypes. Elementwise work and activations are left out."""
    from megagraph.graph.types import eval_dim

    pos = _positions(reqs)
    T, R = int(pos.numel()), len(reqs)
    env = {"T": T, "R": R, "S": 1, "N": 1}  # row counts; S, N only bind state-first ops
    first_row = (torch.cat([torch.full((n,), i, dtype=torch.int64)
                            for i, (_, n) in enumerate(reqs)])
                 if reqs else torch.zeros(0, dtype=torch.int64))
    is_last = torch.ones(T, dtype=torch.bool)
    if T:
        is_last[:-1] = first_row[1:] != first_row[:-1]
    E, k = cfg.n_routed_experts, cfg.experts_per_token
    frac = touched_experts(E, k, T, routing) / E
    flops: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    seen: set[str] = set()
    weights = set(g.weights)

    def add(d, scope, v):
        d[scope] = d.get(scope, 0.0) + float(v)

    for n in g.nodes:
        scope = node_scope(n.op, n.outputs[0])
        x = n.inputs[0]
        rows = eval_dim(g.types[x].shape[0], env) if x is not None and g.types[x].rank else 0
        for w in n.inputs:
            if w is None or w not in weights:
                continue
            t = g.types[w]
            stacked = ".experts.*." in w
            if w not in seen and w not in host:
                seen.add(w)
                if n.op in GATHER_OPS:  # a lookup reads one row per token
                    add(nbytes, scope, rows * t.nbytes({}) / max(1, int(t.shape[0])))
                else:
                    add(nbytes, scope, t.nbytes({}) * (frac if stacked else 1.0))
            if n.op in GATHER_OPS or t.rank < 2 or t.dtype in ("e8m0", "i64", "i32"):
                continue
            per_row = _elems(t) * (k / int(t.shape[0]) if stacked else 1)
            r = rows
            if n.op == "compressor" and w.endswith("indexer.wk.weight"):
                r = rows / max(1, int(n.attr_dict.get("ratio", 1)))
            add(flops, scope, 2 * r * per_row)
        if n.op in ("sparse_attn", "sparse_attn_q"):
            a = n.attr_dict
            _, H, D = (int(d) if not isinstance(d, str) else T for d in g.types[n.inputs[0]].shape)
            W, ratio = int(a["window"]), int(a.get("ratio", 0))
            keys = torch.clamp(pos + 1, max=W).sum().item()
            K = 0
            if ratio and n.inputs[4] is not None:
                K = int(g.types[n.inputs[4]].shape[1])
                keys += torch.clamp((pos + 1) // ratio, max=K).sum().item()
            add(flops, scope, 2 * 2 * H * D * keys)
            add(nbytes, scope, R * g.types[n.inputs[2]].nbytes({"S": 1}))  # window rings
            if K:  # one compressed row: N = ratio gives N/ratio = 1 (and N = 1 for ratio 1)
                row_b = g.types[n.inputs[3]].nbytes({"S": 1, "N": ratio})
                sel = torch.clamp((pos + 1) // ratio, max=K)
                add(nbytes, scope, row_b * sel[is_last].sum().item())
        elif n.op == "index_scores":
            ratio = int(n.attr_dict["ratio"])
            Hi, Di = (int(d) for d in g.types[n.inputs[0]].shape[1:])
            vis = (pos + 1) // ratio
            add(flops, scope, 2 * Hi * Di * vis.sum().item())
            ik = g.types[n.inputs[2]]
            row_b = ik.nbytes({"S": 1, "N": ratio})  # one entry
            add(nbytes, scope, row_b * vis[is_last].sum().item())
    return {"tokens": T, "requests": R, "flops": sum(flops.values()), "bytes": sum(nbytes.values()),
            "flops_by_scope": flops, "bytes_by_scope": nbytes, "touched_experts": frac * E}


# ---------------------------------------------------------------------------------------------
# extrapolation to the 40 layers of V4.1-Flash
# ---------------------------------------------------------------------------------------------


def layer_mapping(cfg, full=None) -> dict:
    """Which layer of `cfg` stands for each layer of the full V4.1-Flash schedule: same role
    (swa / full = KV + index source / reindex / reuse) and compression ratio where the slice has
    one, else the same role, else (reindex) a KV source of that ratio. Returns
    {"counts": {layer: n}, "how": {"role rX": "L<i> x n"}, "layers": (full, slice),
    "engram": (full, slice)}."""
    from megagraph.models.config import load_model_config
    from megagraph.models.v41 import layer_roles

    full = full or load_model_config("v4.1-flash")
    mine = layer_roles(cfg)
    by_key: dict = {}
    for r in mine:
        by_key.setdefault((r.kind, r.ratio), r.layer)
        by_key.setdefault(r.kind, r.layer)
        by_key.setdefault(("ratio", r.ratio), r.layer)
    counts: dict[int, int] = {}
    how: dict[str, list] = {}
    for r in layer_roles(full):
        rep = by_key.get((r.kind, r.ratio), by_key.get(r.kind))
        if rep is None and r.kind == "reindex":
            rep = by_key.get(("full", r.ratio))
        if rep is None:
            rep = by_key.get(("ratio", r.ratio), 0)
        counts[rep] = counts.get(rep, 0) + 1
        key = f"{r.kind}" + (f" r{r.ratio}" if r.ratio else "")
        how.setdefault(key, [rep, 0])[1] += 1
    return {"counts": counts, "how": {k: f"L{v[0]} x {v[1]}" for k, v in how.items()},
            "layers": (full.num_layers, cfg.num_layers),
            "engram": (len(full.engram_layers), len(cfg.engram_layers))}


def extrapolate(by_scope: dict[str, float], mapping: dict, extra: float = 0.0) -> float:
    """A per-scope quantity of the slice (time, FLOPs, bytes) for the full model: each full layer
    takes its representative slice layer's value (without Engram), Engram layers the slice's
    mean Engram value, ops over all layers scale with the layer count, step-level values (and
    `extra`, e.g. host time) stay."""
    full_layers, slice_layers = mapping["layers"]
    full_eng, slice_eng = mapping["engram"]
    total = (extra + by_scope.get("step", 0.0)
             + by_scope.get("all layers", 0.0) * full_layers / slice_layers)
    for layer, n in mapping["counts"].items():
        total += n * by_scope.get(f"L{layer}", 0.0)
    eng = sum(v for s, v in by_scope.items() if s.endswith(".engram"))
    if slice_eng:
        total += full_eng * eng / slice_eng
    return total


def scope_ms(ops: list[dict], scale: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for o in ops:
        out[o["scope"]] = out.get(o["scope"], 0.0) + o["ms"] * scale
    return out
