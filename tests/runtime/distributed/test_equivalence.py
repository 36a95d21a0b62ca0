"""1 vs 2 vs 4 ranks (gloo, spawned processes): the same logits as one process, for both tiny
models, over the mixed prefill/decode SCHEDULE (tests/runtime/distributed/common.py) in which requests are
spread unevenly, some ranks have no request in some steps and the last of 4 ranks never has one.

Tolerance (fp32 weights dequantized, act f32): |logit difference| <= 1e-4 and <= 1e-5 of the
row's largest |logit|. Measured: about 8e-6 absolute, 2e-6 relative: the only differences are
fp32 summation order (k expert outputs summed per token in top-k order instead of expert order;
GEMMs over other batch compositions)."""

from __future__ import annotations

import pytest
from megagraph.runtime.distributed.launch import launch

from tests.runtime.distributed.common import (
    ASSIGN,
    SCHEDULE,
    compile_artifacts,
    equivalence_rank,
    save_baseline,
)

MODELS = ("v4.1-flash-tiny", "v4-flash-tiny")
ABS, REL = 1e-4, 1e-5


def check(results, world):
    for rank, per_model in enumerate(results):
        for key, d in per_model.items():
            assert d["max_abs"] <= ABS and d["max_rel"] <= REL, f"rank {rank} of {world}, {key}: {d}"
            assert d["ran"] + d["idle"] + d["skipped"] == len(SCHEDULE)
            busy = sum(any(ASSIGN[world][r] == rank for r, _ in step) for step in SCHEDULE)
            assert d["ran"] == busy and d["idle"] == len(SCHEDULE) - busy, (rank, key, d)
    rows = sum(d["rows"] for per_model in results for d in per_model.values())
    assert rows == len(MODELS) * sum(n for step in SCHEDULE for _, n in step)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    d = tmp_path_factory.mktemp("baselines")
    return {(m, hw): save_baseline(m, d / f"{m}-{hw}.pt", hw) for m in MODELS for hw in ("cpu", "h200")}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_give_the_logits_of_one_process(world, tmp_path, baselines):
    jobs = [(m, str(compile_artifacts(m, tmp_path / m, dp=world, ep=world)), baselines[m, "cpu"])
            for m in MODELS]
    if world == 1:  # the runner without torch.distributed, in this process
        results = [equivalence_rank(jobs, 1)]
    else:
        results = launch(equivalence_rank, world, jobs, world, timeout_s=150)
    check(results, world)
    if world == 4:  # rank 3 never had a request: it served its experts in every step
        assert all(d["idle"] == len(SCHEDULE) for d in results[3].values())


def test_gpu_profile_graph_with_redundant_experts(tmp_path, baselines):
    """h200 artifacts (mega_mhc fused, mega_moe split around the collectives, FP8 activations
    dispatched as bytes, redundant replicas) on 2 CPU ranks against the single-rank h200 graph
    (with mega_moe), both on reference kernels."""
    jobs = [(m, str(compile_artifacts(m, tmp_path / m, dp=2, ep=2, hw="h200", redundant=r)),
             baselines[m, "h200"]) for m, r in zip(MODELS, (4, 2))]
    check(launch(equivalence_rank, 2, jobs, 2, timeout_s=150), 2)
