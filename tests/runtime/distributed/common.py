"""Helpers for the multi-process tests: compiled tiny artifacts, step schedules, and the functions
each spawned rank runs (module level, so torch.multiprocessing's spawn can import them).

A schedule is a list of global steps; a step lists (request, new tokens). Requests are placed on
ranks by `assign` (request -> rank); a rank with no request in a step joins it with the ep-idle
graph. Every rank also runs the whole schedule on one process (ReferenceSession over the
single-rank graph: the 1-rank baseline) and returns per-request differences, so no logits cross
process boundaries.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from megagraph.models.session import SeqChunk
from megagraph.passes.artifacts import write_artifacts
from megagraph.passes.hw import load_hw_profile
from megagraph.passes.pipeline import CompileOptions, compile_model

# (request, tokens this step): prefill chunks and decode rows mixed, requests arriving late,
# steps where only one rank has work, one request that never shares a step with rank 3
SCHEDULE = [
    [(0, 5), (1, 3)],
    [(0, 1), (2, 6), (3, 2), (4, 4)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
    [(5, 7)],
    [(1, 2), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)],
    [(2, 3)],
    [(0, 1), (5, 1)],
]
# request -> rank for each world size: uneven (rank 0 busy, the last rank of 4 never has work)
ASSIGN = {1: [0] * 6, 2: [0, 1, 0, 0, 1, 0], 4: [0, 1, 2, 0, 2, 1]}
MAX_TOKENS = 16  # per rank per step (the dispatch buffers)


def tokens_for(req: int, step: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(1000 * req + step)
    return tuple(torch.randint(3, 500, (n,), generator=g).tolist())


def compile_artifacts(model: str, out: Path, *, dp: int, ep: int, hw: str = "cpu",
                      redundant: int = 0, max_tokens: int = MAX_TOKENS, balanced: bool = False) -> Path:
    from tests.tiny import tiny

    cfg = tiny(model, act_dtype="f32")[0]
    c = compile_model(cfg, load_hw_profile(hw), CompileOptions(
        dp=dp, ep=ep, redundant_experts=redundant, ep_max_tokens=max_tokens,
        balanced_routing=balanced))
    return write_artifacts(c, out, force=True)


def baseline(model: str, schedule, hw: str = "cpu") -> list[dict[int, torch.Tensor]]:
    """Logits per step per request of the single-rank graph (one process, every request in one
    batch per step)."""
    from megagraph.passes.pipeline import compile_graph

    from tests.tiny import session, tiny

    cfg, g, w, consts = tiny(model, act_dtype="f32")
    if hw != "cpu":
        g, _ = compile_graph(g, load_hw_profile(hw))
    s = session(cfg, g, w, consts, slots=8, capacity=128)
    out = []
    for i, step in enumerate(schedule):
        chunks = [SeqChunk(r, tokens_for(r, i, n)) for r, n in step]
        logits = s.step(chunks)
        rows, start = {}, 0
        for r, n in step:
            rows[r] = logits[start:start + n]
            start += n
        out.append(rows)
    return out


def rank_engine(art: Path, ctx, model: str, device: str = "cpu", **kw):
    from megagraph.runtime.distributed.runner import RankEngine
    from megagraph.runtime.engine import EngineConfig
    from megagraph.runtime.plan import RunPlan

    from tests.tiny import tiny

    _, _, w, consts = tiny(model, act_dtype="f32")
    plan = RunPlan.from_artifacts(art)
    if plan.hw_arch != "cpu":  # GPU-profile artifacts: reference kernels, like the baseline (this
        plan = replace(plan, kernels={})  # is about the EP rewrite, not GPU kernels' CPU fallbacks)
    cfg = EngineConfig(device=device if device == "cpu" else str(ctx.device), max_slots=6,
                       capacity=128, progress=False,
                       allow_fallback=plan.hw_arch != "cpu" or device != "cpu")  # reference kernels
    return RankEngine(plan, w, cfg, ctx=ctx, constants=consts, **kw)


def run_schedule(eng, schedule, assign, rank: int, *, on_step=None) -> list[dict[int, torch.Tensor]]:
    """This rank's logits per step per request (its requests only)."""
    slot: dict[int, int] = {}
    out = []
    for i, step in enumerate(schedule):
        if on_step is not None:
            on_step(i, eng)
        mine = [(r, n) for r, n in step if assign[r] == rank]
        for r, _ in mine:
            if r not in slot:
                slot[r] = eng.slots.allocate()
        logits = eng.step([SeqChunk(slot[r], tokens_for(r, i, n)) for r, n in mine])
        rows, start = {}, 0
        for r, n in mine:
            rows[r] = logits[start:start + n].cpu()
            start += n
        out.append(rows)
    eng.finish()
    return out


def compare(got, want) -> dict:
    """Largest absolute and relative (to the row's max |logit|) difference over all rows."""
    abs_d, rel_d, rows = 0.0, 0.0, 0
    for g_step, w_step in zip(got, want):
        for r, x in g_step.items():
            y = w_step[r]
            d = (x - y).abs().max().item()
            abs_d = max(abs_d, d)
            rel_d = max(rel_d, d / y.abs().max().item())
            rows += x.shape[0]
    return {"max_abs": abs_d, "max_rel": rel_d, "rows": rows}


# -- what each spawned rank runs -------------------------------------------------------------------
def save_baseline(model: str, path: Path, hw: str = "cpu") -> str:
    """The 1-rank logits of SCHEDULE, computed once (by the test process) for every rank."""
    torch.save(baseline(model, SCHEDULE, hw), path)
    return str(path)


def equivalence_rank(jobs: list[tuple[str, str, str]], world: int, device: str = "cpu") -> dict:
    """For each (model, artifacts dir, baseline file): run SCHEDULE on this rank, compare with the
    1-rank baseline; returns {model: differences + this rank's step stats}."""
    from megagraph.runtime.distributed.group import init_from_env

    ctx = init_from_env(device=device, timeout_s=90)
    out = {}
    for model, art, base in jobs:
        eng = rank_engine(Path(art), ctx, model, device)
        got = run_schedule(eng, SCHEDULE, ASSIGN[world], ctx.rank)
        want = torch.load(base)
        out[model] = {**compare(got, want), "ran": eng.stats.ran, "idle": eng.stats.idle,
                      "skipped": eng.stats.skipped}
    return out
