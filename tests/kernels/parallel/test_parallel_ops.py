"""ep_place / ep_dispatch / ep_combine: type rules, one-rank semantics, and the collectives on 3
gloo ranks (one of them with no tokens) against the local `moe_experts` over the full bank."""

from __future__ import annotations

import pytest
import torch
from megagraph.graph.errors import IRError
from megagraph.graph.registry import get_op
from megagraph.graph.types import T
from megagraph.kernels.moe.reference import moe_experts
from megagraph.kernels.parallel.reference import ep_combine, ep_dispatch, ep_place
from megagraph.runtime.distributed.eplb import expert_map
from megagraph.runtime.distributed.launch import launch

E, D, F, K = 6, 16, 8, 2


def bank(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(E, F, D, generator=g) * 0.3, torch.randn(E, F, D, generator=g) * 0.3,
            torch.randn(E, D, F, generator=g) * 0.3]


def ep_moe(x, ids, w, banks, placement, *, ep_size, max_tokens, rank=0):
    """dispatch -> local moe_experts -> combine, as the expert-parallel pass wires them."""
    L = len(placement[0])
    emap = expert_map(placement, E, 1 + ep_size * L - E)
    slots = ep_place(ids, emap, ep_size=ep_size, slots_per_rank=L)
    rid, rw, handle, rx = ep_dispatch(slots, x, ep_size=ep_size, slots_per_rank=L, max_tokens=max_tokens)
    local = [b[torch.tensor(placement[rank])] for b in banks]
    ry = moe_experts(rx, rid, rw, local[0], None, local[1], None, local[2], None, fmt="dense",
                     swiglu_limit=0.0)
    return ep_combine(ry, rw, handle, w, ep_size=ep_size, slots_per_rank=L, max_tokens=max_tokens), slots


def routed(T_, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T_, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T_)]) if T_ else \
        torch.zeros(0, K, dtype=torch.int64)
    w = torch.rand(T_, K, generator=g)
    return x, ids, w


def test_type_rules():
    d = get_op("ep_dispatch")
    outs = d.infer([T("i64", "T", 6), T("fp8e4m3", "T", 64), T("f32", "T", 2)],
                   {"ep_size": 4, "slots_per_rank": 3, "max_tokens": 16}, "test")
    rows = 4 * 16 * 3  # P * max_tokens * min(k=6, L=3)
    assert [str(t) for t in outs] == [f"i64[{rows}, 1]", f"f32[{rows}, 1]", "i64[T, 6]",
                                      f"fp8e4m3[{rows}, 64]", f"f32[{rows}, 2]"]
    c = get_op("ep_combine").infer([T("bf16", rows, 64), T("f32", rows, 1), T("i64", "T", 6),
                                    T("f32", "T", 6)],
                                   {"ep_size": 4, "slots_per_rank": 3, "max_tokens": 16}, "test")
    assert str(c[0]) == "bf16[T, 64]"
    with pytest.raises(IRError, match="one row per token"):
        d.infer([T("i64", "T", 6), T("f32", "R", 64)], {"ep_size": 4, "slots_per_rank": 3,
                                                        "max_tokens": 16}, "test")
    with pytest.raises(IRError, match="ep_dispatch's rows"):
        get_op("ep_combine").infer([T("f32", 100, 64), T("f32", 100, 1), T("i64", "T", 6), T("f32", "T", 6)],
                                   {"ep_size": 4, "slots_per_rank": 3, "max_tokens": 16}, "test")
    with pytest.raises(IRError, match="routing"):
        get_op("ep_place").infer([T("i64", "T", 6), T("i64", 8, 2)],
                                 {"ep_size": 4, "slots_per_rank": 3, "routing": "random"}, "test")
    assert not d.is_break and d.cost == "collective"


def test_one_rank_is_moe_experts():
    """ep_size 1, every expert in its slot: dispatch/experts/combine == moe_experts (same numbers)."""
    banks = bank()
    x, ids, w = routed(9, 1)
    y, slots = ep_moe(x, ids, w, banks, [list(range(E))], ep_size=1, max_tokens=9)
    ref = moe_experts(x, ids, w, banks[0], None, banks[1], None, banks[2], None, fmt="dense",
                      swiglu_limit=0.0)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(slots, ids)
    with pytest.raises(ValueError, match="exceed max_tokens=8"):
        ep_moe(x, ids, w, banks, [list(range(E))], ep_size=1, max_tokens=8)


def test_place_replicas_and_balanced_routing():
    # expert 0 has replicas in slots 0 and 5, the others one slot each
    emap = torch.tensor([[0, 5], [1, -1], [2, -1], [3, -1], [4, -1], [6, -1]])
    ids = torch.zeros(6, 1, dtype=torch.int64)
    got = ep_place(ids, emap, ep_size=1, slots_per_rank=7)
    assert got.flatten().tolist() == [0, 5, 0, 5, 0, 5]  # tokens alternate over the replicas
    ids = torch.randint(0, 6, (12, 2))
    bal = ep_place(ids, torch.arange(6)[:, None], ep_size=1, slots_per_rank=6, routing="balanced")
    assert torch.bincount(bal.flatten(), minlength=6).tolist() == [4] * 6
    assert (bal[:, 0] != bal[:, 1]).all()  # k distinct experts per token


def dispatch_rank(placement, tokens_per_rank, max_tokens, transfer):
    """One rank of test_collectives: its EP result and the local reference for its tokens."""
    from megagraph.kernels.parallel.reference import ep_group_and_rank, set_transfer
    from megagraph.runtime.distributed.group import init_from_env

    ctx = init_from_env(device="cpu", timeout_s=60)
    set_transfer(transfer)
    _, r = ep_group_and_rank(ctx.world)
    x, ids, w = routed(tokens_per_rank[r], 10 + r)
    banks = bank()
    y, slots = ep_moe(x, ids, w, banks, placement, ep_size=ctx.world, max_tokens=max_tokens, rank=r)
    ref = moe_experts(x, ids, w, banks[0], None, banks[1], None, banks[2], None, fmt="dense",
                      swiglu_limit=0.0)
    return y, ref, slots


@pytest.mark.parametrize("transfer", ["static", "counts"])
def test_collectives_three_ranks_one_without_tokens(transfer):
    """Whole static blocks or only the filled rows after a count exchange: the same values."""
    # 6 experts + 3 redundant over 3 ranks (L = 3); expert 0 has 2 replicas, experts 1 and 3 too
    placement = [[0, 1, 2], [3, 4, 0], [5, 1, 3]]
    res = launch(dispatch_rank, 3, placement, [5, 0, 8], 8, transfer, timeout_s=60)
    for r, (y, ref, slots) in enumerate(res):
        assert y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    # rank 2's tokens used both replicas of expert 0 (global slots 0 and 5)
    _, ids, _ = routed(8, 12)
    used = set(res[2][2][ids == 0].tolist())
    assert used == {0, 5}
