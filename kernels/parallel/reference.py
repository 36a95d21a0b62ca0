"""Expert parallelism over torch.distributed: placement, dispatch, combine (graph/ops/parallel.py).

The collectives are `all_to_all_single` with equal splits over static blocks of
C = max_tokens * min(k, L) rows per peer, so every call has the same size on every rank whatever
its token count: a rank with no tokens sends empty blocks and receives its peers' tokens through
the same call (no hang when DP ranks diverge). Everything else is sync-free tensor code (no
`.item()`, no data-dependent shapes, no host-built constants), so the same kernels run eagerly
with gloo on CPU and inside CUDA graphs with NCCL (the communicator must exist before capture:
run one eager step first).

Which process group: `set_ep_group(group)` (runtime/distributed does it), else the default
group. `ep_size == 1` needs no group: the all-to-all is the identity (single-process tests).
Dtypes the backends may not carry (fp8, e8m0, bool) travel as uint8 views of the same bytes.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

_EP_GROUP = None  # torch.distributed ProcessGroup of the EP ranks; None = the default group
I64 = torch.int64


def rows_per_peer(max_tokens: int, topk: int, slots_per_rank: int) -> int:
    """Static rows sent to (and received from) each peer (same rule as the type rules)."""
    return max_tokens * min(topk, slots_per_rank)


def set_ep_group(group) -> None:
    """Use `group` for every EP collective from now on (None: the default group)."""
    global _EP_GROUP
    _EP_GROUP = group


@contextmanager
def ep_group(group):
    """Run EP kernels on `group` inside the block."""
    global _EP_GROUP
    old, _EP_GROUP = _EP_GROUP, group
    try:
        yield
    finally:
        _EP_GROUP = old


def ep_group_and_rank(ep_size: int):
    """(process group, rank in it) for an EP op compiled for `ep_size` ranks; (None, 0) for 1."""
    if ep_size == 1:
        return None, 0
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"this graph was compiled for expert parallelism over {ep_size} ranks, but "
            "torch.distributed is not initialized in this process: run it with "
            f"`python -m megagraph.runtime.distributed generate ARTIFACTS --nproc {ep_size}` "
            "(or torchrun), which sets up the process group")
    group = _EP_GROUP if _EP_GROUP is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    if n != ep_size:
        raise RuntimeError(f"this graph was compiled for ep_size={ep_size}, but the EP process "
                           f"group has {n} ranks; recompile with --ep {n} or launch {ep_size} ranks")
    return group, dist.get_rank(group)


_WIRE_AS_BYTES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.bool)
TRANSFERS = ("auto", "static", "counts")
_TRANSFER = "auto"


def set_transfer(mode: str) -> None:
    """How the all-to-alls move the static blocks (the results are identical):

    * "static": whole blocks, equal splits; no host sync, capturable; moves ep_size x C rows per
      tensor whatever the load (ep_size times the useful bytes when every pair is local to one
      peer's block, far more in the usual case).
    * "counts": first an all-to-all of the per-peer row counts (read on the host), then only the
      filled rows (uneven splits), scattered into the same static layout on arrival. One host
      sync per collective: for eager steps (prefill), never inside a CUDA graph.
    * "auto" (default): "static" while a CUDA graph is being captured, "counts" otherwise.
    """
    global _TRANSFER
    if mode not in TRANSFERS:
        raise ValueError(f"EP transfer must be one of {TRANSFERS}, got {mode!r}")
    _TRANSFER = mode


def transfer_mode(x: Tensor) -> str:
    if _TRANSFER != "auto":
        return _TRANSFER
    if x.device.type == "meta" or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return "static"
    return "counts"


def _wire(x: Tensor) -> Tensor:
    x = x.contiguous()
    return x.view(torch.uint8) if x.dtype in _WIRE_AS_BYTES else x


def all_to_all_equal(x: Tensor, group) -> Tensor:
    """all_to_all_single with equal splits along dim 0 (identity without a group)."""
    if group is None:
        return x
    import torch.distributed as dist

    send = _wire(x)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(x.dtype)


def all_to_all_rows(x: Tensor, send_counts: list[int], recv_counts: list[int], group) -> Tensor:
    """all_to_all_single of `sum(send_counts)` rows (peer p's rows contiguous, in peer order);
    returns the `sum(recv_counts)` rows received, in peer order."""
    import torch.distributed as dist

    send = _wire(x)
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return recv.view(x.dtype)


def _block_rows(counts: list[int], block: int, device) -> Tensor:
    """Static-layout rows of the filled rows, peer by peer: p*block + 0..counts[p]-1."""
    return torch.cat([torch.arange(n, dtype=I64, device=device) + p * block
                      for p, n in enumerate(counts)]) if counts else torch.zeros(0, dtype=I64)


# -- the three ops -------------------------------------------------------------------------------
def ep_place(ids: Tensor, expert_map: Tensor, *, ep_size: int, slots_per_rank: int,
             routing: str = "model") -> Tensor:
    """ids i64[T, k] logical experts -> i64[T, k] global physical slots (see graph/ops/parallel.py).

    expert_map i64[E, R]: replica slots of each logical expert, -1 padded. Pair (t, j) on rank r
    takes replica (t + r) mod count. routing="balanced": ids := ((t + r) * k + j) mod E first.
    """
    _, r = ep_group_and_rank(ep_size)
    T, k = ids.shape
    E = expert_map.shape[0]
    dev = ids.device
    t = torch.arange(T, dtype=I64, device=dev)[:, None]
    if routing == "balanced":
        ids = ((t + r) * k + torch.arange(k, dtype=I64, device=dev)[None, :]) % E
    elif routing != "model":
        raise ValueError(f"unknown routing {routing!r}")
    count = (expert_map >= 0).sum(dim=1).clamp(min=1)  # [E]; a valid map has >= 1 everywhere
    choice = (t + r) % count[ids]
    return expert_map[ids, choice]


def ep_dispatch(slots: Tensor, *payload: Tensor, ep_size: int, slots_per_rank: int,
                max_tokens: int) -> tuple[Tensor, ...]:
    """Pairs -> their slot's rank over static blocks; returns (recv_ids [P*C, 1], recv_w [P*C, 1],
    handle [T, k], *received payloads [P*C, ...])."""
    group, _ = ep_group_and_rank(ep_size)
    T, k = slots.shape
    if T > max_tokens:
        raise ValueError(f"ep_dispatch: {T} tokens on this rank exceed max_tokens={max_tokens}, "
                         "the size of the static dispatch buffers: schedule at most that many "
                         "tokens per rank per step, or compile with a larger --ep-max-tokens")
    P, L = ep_size, slots_per_rank
    C = rows_per_peer(max_tokens, k, L)
    dev = slots.device
    flat = slots.reshape(-1)
    N = flat.shape[0]
    dest = torch.div(flat, L, rounding_mode="floor")
    # position of each pair inside its destination block: rank among the pairs with the same
    # destination, in (t, j) order (stable sort; no host sync, no one-hot of size N x P)
    order = torch.sort(dest, stable=True).indices
    counts = torch.zeros(P, dtype=I64, device=dev).scatter_add_(0, dest, torch.ones_like(dest))
    starts = torch.cumsum(counts, 0) - counts
    sorted_pos = torch.arange(N, dtype=I64, device=dev) - starts[dest[order]]
    pos = torch.empty_like(sorted_pos).scatter_(0, order, sorted_pos)
    row = dest * C + pos  # < P*C: at most T * min(k, L) <= C pairs go to one rank
    tok = torch.div(torch.arange(N, dtype=I64, device=dev), k, rounding_mode="floor")
    local = flat - dest * L
    received = []
    if group is not None and transfer_mode(slots) == "counts":
        # pairs in destination order are exactly the filled rows of the blocks, front first
        sent = counts.tolist()
        got = all_to_all_equal(counts, group).tolist()
        place = _block_rows(got, C, dev)
        recv_slot = torch.full((P * C,), -1, dtype=I64, device=dev)
        recv_slot[place] = all_to_all_rows(local[order], sent, got, group)
        src = tok[order]
        for p in payload:
            raw = _wire(p)  # fp8 / e8m0 as bytes
            out = raw.new_zeros((P * C, *raw.shape[1:]))
            out[place] = all_to_all_rows(raw.index_select(0, src), sent, got, group)
            received.append(out.view(p.dtype))
    else:
        send_ids = torch.full((P * C,), -1, dtype=I64, device=dev).scatter_(0, row, local)
        recv_slot = all_to_all_equal(send_ids, group)
        for p in payload:
            raw = p.view(torch.uint8) if p.dtype in _WIRE_AS_BYTES else p  # fp8 / e8m0 as bytes
            send = raw.new_zeros((P * C, *raw.shape[1:]))
            send.index_copy_(0, row, raw.index_select(0, tok))
            received.append(all_to_all_equal(send, group).view(p.dtype))
    valid = recv_slot >= 0
    return (recv_slot.clamp(min=0)[:, None], valid.to(torch.float32)[:, None], row.view(T, k),
            *received)


def ep_combine(y: Tensor, recv_w: Tensor, handle: Tensor, weights: Tensor, *, ep_size: int,
               slots_per_rank: int, max_tokens: int) -> Tensor:
    """Expert outputs back to their tokens' rank; out[t] = sum_j weights[t, j] * y[handle[t, j]]
    (fp32), in y's dtype. recv_w [P*C, 1] marks the rows ep_dispatch filled."""
    group, _ = ep_group_and_rank(ep_size)
    T, k = handle.shape
    if group is not None and transfer_mode(y) == "counts":
        P, C = ep_size, y.shape[0] // ep_size
        sent = (recv_w.view(P, C) > 0).sum(dim=1).tolist()  # filled rows are at each block's front
        mine = torch.div(handle.reshape(-1), C, rounding_mode="floor")
        got = torch.zeros(P, dtype=I64, device=y.device).scatter_add_(
            0, mine, torch.ones_like(mine)).tolist()
        back = y.new_zeros(y.shape)
        rows = all_to_all_rows(y[_block_rows(sent, C, y.device)], sent, got, group)
        back[_block_rows(got, C, y.device)] = rows
    else:
        back = all_to_all_equal(y, group)
    rows = back.index_select(0, handle.reshape(-1)).view(T, k, back.shape[1]).float()
    return (rows * weights.float()[:, :, None]).sum(dim=1).to(y.dtype)


PARALLEL = {"ep_place": ep_place, "ep_dispatch": ep_dispatch, "ep_combine": ep_combine}
for _fn in PARALLEL.values():
    _fn.capturable = True  # sync-free, static shapes (kernels.registry / runtime.kernels read it)

__all__ = ["PARALLEL", "TRANSFERS", "all_to_all_equal", "all_to_all_rows", "ep_combine",
           "ep_dispatch", "ep_group", "ep_group_and_rank", "ep_place", "rows_per_peer",
           "set_ep_group", "set_transfer", "transfer_mode"]
