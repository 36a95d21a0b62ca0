"""On 2 GPUs (NCCL; skipped without): dispatch -> experts -> combine captured in a CUDA graph on
each rank (one rank with no tokens: the collectives' sizes do not depend on the token count),
replayed with new data == eager; and the tiny model's DEP2 run on GPUs == one process."""

from __future__ import annotations

import pytest
import torch
from megagraph.runtime.distributed.launch import launch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
E, D, F, K = 6, 64, 32, 2
PLACEMENT = [[0, 1, 2, 3], [4, 5, 0, 2]]  # 6 experts + 2 redundant over 2 ranks


def _moe(x, ids, w, banks, rank, max_tokens):
    from megagraph.kernels.moe.capturable import moe_experts
    from megagraph.kernels.parallel.reference import ep_combine, ep_dispatch, ep_place

    L = 4
    slots = ep_place(ids, banks["map"], ep_size=2, slots_per_rank=L)
    rid, rw, handle, rx = ep_dispatch(slots, x, ep_size=2, slots_per_rank=L, max_tokens=max_tokens)
    ry = moe_experts(rx, rid, rw, banks["w1"], None, banks["w3"], None, banks["w2"], None,
                     fmt="dense", swiglu_limit=0.0)
    return ep_combine(ry, rw, handle, w, ep_size=2, slots_per_rank=L, max_tokens=max_tokens)


def _data(T, seed, dev):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    return x.to(dev), ids.to(dev), torch.rand(T, K, generator=g).to(dev)


def capture_rank(tokens) -> dict:
    from megagraph.kernels.moe.reference import moe_experts as ref_moe
    from megagraph.kernels.parallel.reference import set_ep_group, set_transfer
    from megagraph.runtime.distributed.eplb import expert_map
    from megagraph.runtime.distributed.group import init_from_env

    ctx = init_from_env(device="cuda", timeout_s=120)
    set_ep_group(ctx.data_group)
    r, dev, T = ctx.rank, ctx.device, tokens[ctx.rank]
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (F, D), "w3": (F, D), "w2": (D, F)}
    full = {n: torch.randn(E, *s, generator=g) * 0.3 for n, s in shapes.items()}
    banks = {n: full[n][torch.tensor(PLACEMENT[r])].to(dev) for n in full}
    banks["map"] = expert_map(PLACEMENT, E, 3).to(dev)
    x, ids, w = _data(T, 10 + r, dev)
    set_transfer("counts")
    eager_counts = _moe(x, ids, w, banks, r, 8)
    set_transfer("auto")  # static while capturing
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch.cuda.graph wants
        _moe(sx, sids, sw, banks, r, 8)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _moe(sx, sids, sw, banks, r, 8)
    x2, ids2, w2 = _data(T, 20 + r, dev)
    sx.copy_(x2), sids.copy_(ids2), sw.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    ref = ref_moe(x2.cpu(), ids2.cpu(), w2.cpu(), full["w1"], None, full["w3"], None, full["w2"], None,
                  fmt="dense", swiglu_limit=0.0)
    ref1 = ref_moe(x.cpu(), ids.cpu(), w.cpu(), full["w1"], None, full["w3"], None, full["w2"], None,
                   fmt="dense", swiglu_limit=0.0)
    return {"T": T, "replay": (out.cpu() - ref).abs().max().item() if T else 0.0,
            "eager": (eager_counts.cpu() - ref1).abs().max().item() if T else 0.0}


def test_collectives_inside_cuda_graphs():
    res = launch(capture_rank, 2, [5, 0], timeout_s=300)
    assert [d["T"] for d in res] == [5, 0]
    for d in res:
        assert d["replay"] < 1e-4 and d["eager"] < 1e-4, d


def test_tiny_model_dep2_on_gpus(tmp_path):
    from tests.runtime.distributed.common import compile_artifacts, equivalence_rank, save_baseline

    jobs = [(m, str(compile_artifacts(m, tmp_path / m, dp=2, ep=2)), save_baseline(m, tmp_path / f"{m}.pt"))
            for m in ("v4.1-flash-tiny", "v4-flash-tiny")]
    res = launch(equivalence_rank, 2, jobs, 2, "cuda", timeout_s=400)
    for per_model in res:
        for key, d in per_model.items():
            assert d["max_abs"] <= 1e-3 and d["max_rel"] <= 1e-4, (key, d)
