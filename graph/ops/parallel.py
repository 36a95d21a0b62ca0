"""Expert parallelism (DP attention + EP): placement, dispatch and combine.

Only the `expert-parallel` pass creates these ops. A MoE site

    ids, weights = route(x, ...)                       # every rank routes its own tokens
    y = moe_experts(x, ids, weights, <all E experts>)

becomes, on every rank of an EP group of P ranks holding L expert slots each,

    slots = ep_place(ids, expert_map)                  # logical expert -> physical slot (replicas)
    rids, rw, handle, rx = ep_dispatch(slots, x)       # all-to-all: each pair to its slot's rank
    ry = moe_experts(rx, rids, rw, <this rank's L slots>)
    y = ep_combine(ry, rw, handle, weights)            # all-to-all back, weighted sum over k

Buffers are static: every rank has a block of C = max_tokens * min(k, L) rows per peer (a
token's k experts are distinct, so at most min(k, L) of its pairs go to one rank), filled from
the front, so shapes depend only on attributes, never on data or on the rank's own token count:
a rank with no tokens sends and receives empty blocks through the same collective, and the
collective can be captured in a CUDA graph. (How many bytes actually move is the kernel's
business: whole blocks, or only the filled rows after exchanging counts; the values are equal.)
Received rows carry the local slot of their expert (`rids`; 0 with `rw` = 0 for empty rows), so
the local expert GEMM is the ordinary `moe_experts` with k = 1.
The routing weights never travel: `ep_combine` applies them where the token lives.

The expert map is a graph *input* (data, not attributes), so a new placement (EPLB) changes no
graph: the runtime rewrites the map and the local slots' weights between steps.
"""

from ..registry import REQUIRED, expect, op
from ..types import TensorType

ROUTING_MODES = ("model", "balanced")
EP_ATTRS = {"ep_size": REQUIRED, "slots_per_rank": REQUIRED, "max_tokens": REQUIRED}


def rows_per_peer(max_tokens: int, topk: int, slots_per_rank: int) -> int:
    """Static rows one rank sends to (and receives from) each peer: max_tokens * min(k, L)."""
    return max_tokens * min(topk, slots_per_rank)


def _expect_layout(ep_size, slots_per_rank, max_tokens) -> None:
    for name, v in (("ep_size", ep_size), ("slots_per_rank", slots_per_rank), ("max_tokens", max_tokens)):
        expect(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
               f"{name} must be an int >= 1, got {v!r}")


def _expect_slots(slots: TensorType) -> None:
    expect(slots.dtype == "i64" and slots.rank == 2 and isinstance(slots.shape[1], int),
           f"slots must be i64[T, k] (k constant), got {slots}")


@op("ep_place", ("ids", "expert_map"), ("slots",),
    attrs={"ep_size": REQUIRED, "slots_per_rank": REQUIRED, "routing": "model"}, cost="memory")
def ep_place(ids, expert_map, *, ep_size, slots_per_rank, routing):
    """Logical experts -> physical slots. expert_map[e] lists the global slots (rank * L + local
    slot) holding a replica of logical expert e, padded with -1 (every expert has >= 1 replica).
    Pair (t, j) on EP rank r takes replica (t + r) mod (replicas of e): each expert's tokens split
    evenly over its replicas. routing="balanced" (benchmarks only) first replaces the router's
    experts by ((t + r) * k + j) mod E, so every expert gets the same share of tokens; the router's
    weights are kept. Returns i64[T, k] global slots."""
    _expect_layout(ep_size, slots_per_rank, 1)
    expect(routing in ROUTING_MODES, f"routing must be one of {ROUTING_MODES}, got {routing!r}")
    expect(ids.dtype == "i64" and ids.rank == 2, f"ids must be i64[T, k], got {ids}")
    expect(expert_map.dtype == "i64" and expert_map.rank == 2
           and all(isinstance(d, int) for d in expert_map.shape),
           f"expert_map must be i64[E, R] (constant), got {expert_map}")
    return TensorType("i64", ids.shape)


@op("ep_dispatch", ("slots", "payload*"), ("recv*",), attrs=dict(EP_ATTRS), cost="collective")
def ep_dispatch(slots, payload, *, ep_size, slots_per_rank, max_tokens):
    """Send every (token, j) pair to the rank owning its slot: one all_to_all_single per tensor over
    static blocks of C = max_tokens * min(k, L) rows per peer (pairs in (t, j) order, packed at the
    front of each block). Returns (recv_ids i64[P*C, 1]: local slot of each received row, 0 for
    empty rows; recv_w f32[P*C, 1]: 1 for received rows, 0 for empty ones; handle i64[T, k]: the
    send-block row of each pair, for ep_combine; then each payload received, [P*C, ...]).
    A rank with no tokens (T = 0) still takes part. T must not exceed max_tokens."""
    _expect_layout(ep_size, slots_per_rank, max_tokens)
    _expect_slots(slots)
    expect(len(payload) >= 1, "ep_dispatch needs at least one payload (the activations)")
    rows = ep_size * rows_per_peer(max_tokens, slots.shape[1], slots_per_rank)
    outs = [TensorType("i64", (rows, 1)), TensorType("f32", (rows, 1)), slots]
    for i, p in enumerate(payload):
        expect(p.rank >= 1 and p.shape[0] == slots.shape[0],
               f"payload[{i}] must have one row per token ({slots.shape[0]}), got {p}")
        outs.append(TensorType(p.dtype, (rows, *p.shape[1:])))
    return tuple(outs)


@op("ep_combine", ("y", "recv_w", "handle", "weights"), ("out",), attrs=dict(EP_ATTRS),
    cost="collective")
def ep_combine(y, recv_w, handle, weights, *, ep_size, slots_per_rank, max_tokens):
    """Return each received row's expert output to the rank its token lives on (the reverse
    all-to-all over the same blocks; recv_w, ep_dispatch's, marks the filled rows), then
    out[t] = sum_j weights[t, j] * y_back[handle[t, j]] in fp32, cast to y's dtype. Returns [T, d]."""
    _expect_layout(ep_size, slots_per_rank, max_tokens)
    _expect_slots(handle)
    rows = ep_size * rows_per_peer(max_tokens, handle.shape[1], slots_per_rank)
    expect(y.rank == 2 and y.shape[0] == rows, f"y must be [{rows}, d] (ep_dispatch's rows), got {y}")
    expect(recv_w.shape == (rows, 1), f"recv_w must be f32[{rows}, 1] (ep_dispatch's), got {recv_w}")
    expect(weights.shape == handle.shape and weights.dtype in ("f32", "bf16", "f16"),
           f"weights must be float{list(handle.shape)}, got {weights}")
    return TensorType(y.dtype, (handle.shape[0], y.shape[1]))
