"""No hangs when DP ranks diverge: a rank without requests for many steps, ranks that finish at
different times (uneven generate), a step only one rank finds invalid, steps nobody has tokens
for, a rank that crashes and one that stops answering. Every run is bounded by a timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from megagraph.models.session import SeqChunk
from megagraph.runtime.distributed.launch import launch

from tests.runtime.distributed.common import compile_artifacts, rank_engine, tokens_for

MODEL = "v4-flash-tiny"


def diverging_rank(art: str) -> dict:
    from megagraph.runtime.distributed.group import init_from_env
    from megagraph.runtime.distributed.runner import StepError
    from megagraph.runtime.sampling import SamplingParams

    ctx = init_from_env(device="cpu", timeout_s=60)
    eng = rank_engine(Path(art), ctx, MODEL)
    r, out = ctx.rank, {}
    # 1. rank 1 has nothing for 6 steps, then one request for 2 steps, then nothing again
    s = eng.slots.allocate()
    rows = []
    for i in range(10):
        mine = r == 0 or i in (6, 7)
        logits = eng.step([SeqChunk(s, tokens_for(r, i, 3 if i == 0 or (r == 1 and i == 6) else 1))]
                          if mine else [])
        rows.append(logits.shape[0])
    out["rows"] = rows
    # 2. nobody has tokens: skipped everywhere, no graph runs
    before = eng.stats.skipped
    eng.step([])
    out["skipped"] = eng.stats.skipped - before
    # 3. only rank 1 schedules too many tokens: every rank raises, nobody waits in a dispatch
    try:
        eng.step([SeqChunk(s, tuple(range(3, 3 + eng.layout.max_tokens + 1)))] if r == 1 else
                 [SeqChunk(s, (5,))])
        out["error"] = None
    except StepError as e:
        out["error"] = str(e)
    eng.step([SeqChunk(s, (7,))])  # and the job goes on
    eng.release(s)
    # 4. uneven generation: rank 0 has 3 prompts, rank 1 none; rank 1 serves experts until done
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] if r == 0 else []
    res = eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    out["generated"] = [o.token_ids for o in res]
    out["stats"] = (eng.stats.ran, eng.stats.idle, eng.stats.skipped, eng.stats.steps)
    return out


def test_diverging_ranks_never_hang(tmp_path):
    art = compile_artifacts(MODEL, tmp_path / "a", dp=2, ep=2, max_tokens=8)
    t0 = time.monotonic()
    r0, r1 = launch(diverging_rank, 2, str(art), timeout_s=120)
    assert time.monotonic() - t0 < 120
    assert r0["rows"] == [3] + [1] * 9
    assert r1["rows"] == [0] * 6 + [3, 1, 0, 0]
    assert r0["skipped"] == r1["skipped"] == 1
    assert r1["error"].startswith("rank 1: step") and "dispatch buffers hold 8" in r1["error"]
    assert r0["error"].startswith("rank 0: step") and "another rank" in r0["error"]
    assert [len(t) for t in r0["generated"]] == [3, 3, 3] and r1["generated"] == []
    ran1, idle1, _, steps1 = r1["stats"]
    assert ran1 == 3 and idle1 >= 8 + 3 and steps1 == r0["stats"][3]  # lockstep to the end


def crashing_rank(mode: str) -> None:
    from megagraph.runtime.distributed.group import init_from_env

    ctx = init_from_env(device="cpu", timeout_s=5)
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        if mode == "crash":
            raise ValueError("rank 1 broke before the step")
        time.sleep(60)  # "hangs": never joins
    dist.all_reduce(torch.zeros(3), group=ctx.control_group)


@pytest.mark.parametrize("mode, match", [("crash", "rank 1 of 2 failed"), ("silent", "rank 0 of 2 failed")])
def test_a_dead_rank_fails_the_job_quickly(mode, match):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=match):
        launch(crashing_rank, 2, mode, timeout_s=60)
    assert time.monotonic() - t0 < 45  # the failure (or the 5 s collective timeout) ends the job
