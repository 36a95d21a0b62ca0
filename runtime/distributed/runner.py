"""One DP/EP rank: the runtime Engine on this rank's requests, plus the step discipline that keeps
every rank in every collective.

The discipline (why there are no hangs when DP ranks diverge):

1. **Every step starts with a handshake** on the control group: an all-reduce(MAX) of
   (tokens this rank has, 1 if it is still active, 1 if its step is invalid). All ranks make it,
   so all ranks learn the same three numbers.
2. If no rank has tokens, nobody runs anything (no collective is left half-joined).
   If a step is invalid anywhere (too many tokens for the dispatch buffers, a bad slot, capacity
   exceeded), *every* rank raises, instead of the good ranks waiting in a dispatch forever.
3. A rank with tokens runs the step graph; a rank without runs the `ep-idle` graph
   (passes/expert_parallel.py): each MoE layer's dispatch -> local experts -> combine at T = 0,
   so it still serves its experts and joins each collective in the same order (checked at start:
   the two graphs' collective signatures must be equal).
4. A rank that ran out of work calls `finish()`, which keeps joining idle steps until every rank
   has finished. `generate()` does it for you.

EPLB (runtime/distributed/eplb.py) hooks in at the handshake: every `eplb_interval` steps (a
count every rank shares) the ranks all-reduce the recorded load, compute the same placement and
apply it in place before the step runs. `rebalance()` can also be called directly, by every rank
at the same point between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from megagraph.kernels.parallel.reference import set_ep_group
from megagraph.passes.expert_parallel import (
    IDLE_GRAPH,
    ParallelLayout,
    collective_signature,
    ep_sites,
    graph_placement,
)

from ..batch import SeqChunk
from ..engine import Engine, EngineConfig
from ..plan import ArtifactsError, RunPlan
from . import eplb
from .group import DistContext
from .weights import is_local, load_rank_weights, rank_weights, source_specs


class StepError(RuntimeError):
    """A step some rank could not run; raised on every rank (the message names it)."""


@dataclass
class RankStats:
    steps: int = 0  # handshakes (global steps) this rank took part in
    ran: int = 0  # steps it ran the step graph
    idle: int = 0  # steps it joined with the ep-idle graph
    skipped: int = 0  # steps nobody had tokens for
    rebalances: list = field(default_factory=list)  # one report per applied placement


class RankEngine(Engine):
    """The Engine of one rank of a `--dp P --ep P` (or `--dp P`) job."""

    def __init__(self, plan: RunPlan, weights=None, config: EngineConfig | None = None, *,
                 ctx: DistContext, eplb_interval: int = 0, constants: dict | None = None,
                 report=None):
        """`weights`: full tensors (a dict with the checkpoint's stacked `*` banks: this rank's
        slots are gathered), this rank's tensors (a dict with the `.local.` slot banks), a
        checkpoint dir (only this rank's experts are read), or None (seeded random weights, the
        same values a single-rank engine gets). `constants`: graph constants (the Engram token
        map) when the caller has them already."""
        g = plan.graph
        self._given_constants = constants
        self._origin = Engine._weights_origin(self, weights)  # before weights become tensors
        self.ctx = ctx
        self.layout = ParallelLayout.from_graph(g) or ParallelLayout(1, 1, 0, 0)
        lay = self.layout
        if ctx.world != lay.dp:
            raise ArtifactsError(f"{plan.source or 'artifacts'}: compiled for --dp {lay.dp}, but "
                                 f"this job has {ctx.world} rank(s); launch {lay.dp} ranks "
                                 f"(--nproc {lay.dp}) or recompile with --dp {ctx.world}")
        config = config or EngineConfig(device=str(ctx.device))
        if lay.ep > 1 and config.max_step_tokens > lay.max_tokens:  # the dispatch buffers' size
            config = replace(config, max_step_tokens=lay.max_tokens)
        device = torch.device(config.device)
        self.sites = ep_sites(g) if lay.ep > 1 else []
        self.placement = {s.layer: graph_placement(g) for s in self.sites}
        self.ep_maps = {s.map_input: eplb.expert_map(self.placement[s.layer], lay.experts,
                                                     lay.max_replicas).to(device)
                        for s in self.sites}
        self._slot_expert = {s.layer: eplb.slot_experts(self.placement[s.layer]).to(device)
                             for s in self.sites}
        self.eplb_interval = eplb_interval
        self.stats = RankStats()
        ckpt = None
        if lay.ep > 1:
            set_ep_group(ctx.data_group)
            if weights is None:
                from ..weights import seeded_weights

                full = seeded_weights(source_specs(g, lay.experts), plan.cfg, seed=config.seed,
                                      device=torch.device("cpu"))
                weights = rank_weights(g, full, self.placement, ctx.rank)
            elif isinstance(weights, (str, Path)):
                ckpt = Path(weights)
                weights = load_rank_weights(g, ckpt, self.placement, ctx.rank, experts=lay.experts,
                                            device=device)
            elif not any(w in weights for w in g.weights if is_local(w)):
                weights = rank_weights(g, weights, self.placement, ctx.rank)
        super().__init__(plan, weights, config, report,
                         token_map=(constants or {}).get("engram_token_map"))
        self.load = eplb.ExpertLoad(len(self.sites), lay.experts, self.device) if self.sites else None
        self.idle_program = self._idle_program() if self.sites else None
        self._last_out: dict | None = None
        self.program.run = self._keeping(self.program.run)
        if self.runner is not None:
            self.runner.replay = self._keeping(self.runner.replay)
        self.report.hardware += f"; {ctx}" + (f", DEP x{lay.ep}, {lay.slots_per_rank} expert slots"
                                             if lay.ep > 1 else f", DP x{lay.dp}")

    # -- start-up pieces ---------------------------------------------------------------------------
    def _keeping(self, fn):
        """`fn` (a forward: program run or graph replay) that also keeps its output as
        self._last_out."""
        def keep(arg):
            out = fn(arg)
            self._last_out = out
            return out

        return keep

    def _weights_origin(self, weights):
        return self._origin  # the caller's weights argument, not this rank's tensors made from it

    def _constants(self) -> dict[str, torch.Tensor]:
        given = self._given_constants
        base = super()._constants() if given is None else {k: v.to(self.device) for k, v in given.items()}
        return {**base, **self.ep_maps}

    def _idle_program(self):
        from ..kernels import resolve_kernels
        from ..segments import Program, segment_io

        idle = self.plan.extra_graphs.get(IDLE_GRAPH)
        if idle is None:
            raise ArtifactsError(f"{self.plan.source or 'artifacts'}: no {IDLE_GRAPH} graph next to an "
                                 "expert-parallel step graph; recompile with this megagraph")
        want, got = collective_signature(self.plan.graph), collective_signature(idle)
        if want != got:
            raise ArtifactsError(f"{self.plan.source or 'artifacts'}: the {IDLE_GRAPH} graph does not "
                                 "issue the step graph's collectives in the same order; recompile")
        ks = resolve_kernels(self.plan, [idle], self.device, allow_fallback=self.config.allow_fallback)
        idx = tuple(range(len(idle.nodes)))
        self._idle_graph = idle
        return Program(IDLE_GRAPH, idle, idx, segment_io(idle, [idx])[0], ks.for_node, self.weights)

    # -- the step discipline -----------------------------------------------------------------------
    def _handshake(self, tokens: int, active: bool, error: str = "") -> tuple[int, bool]:
        flags = torch.tensor([tokens, int(active), int(bool(error))], dtype=torch.int64)
        if self.ctx.world > 1:
            import torch.distributed as dist

            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.control_group)
        self.stats.steps += 1
        if flags[2]:
            raise StepError(f"rank {self.ctx.rank}: step {self.stats.steps} aborted on every rank: "
                            + (error or "another rank could not run it (see that rank's error)"))
        if self.eplb_interval and self.sites and self.stats.steps % self.eplb_interval == 0:
            self.rebalance()
        return int(flags[0]), bool(flags[1])

    def _check(self, chunks: Sequence[SeqChunk]) -> str:
        n = sum(len(c.tokens) for c in chunks)
        if self.sites and n > self.layout.max_tokens:
            return (f"rank {self.ctx.rank} scheduled {n} tokens; the dispatch buffers hold "
                    f"{self.layout.max_tokens} per rank per step (compile --ep-max-tokens)")
        for c in chunks:
            if not 0 <= c.slot < self.slots.scratch_slot:
                return f"rank {self.ctx.rank}: slot {c.slot} is not a request slot"
            if self.cached.get(c.slot, 0) + len(c.tokens) > self.config.capacity:
                return f"rank {self.ctx.rank}: slot {c.slot} would exceed capacity {self.config.capacity}"
        return ""

    def step(self, chunks: Sequence[SeqChunk], *, exact: bool = False) -> torch.Tensor:
        """One global step: this rank's `chunks` (may be empty). Every rank must call `step` (or
        be in `finish`) for every global step. Returns this rank's logits (no rows if none)."""
        tokens = sum(len(c.tokens) for c in chunks)
        gmax, _ = self._handshake(tokens, True, self._check(chunks))
        if gmax == 0:
            self.stats.skipped += 1
            return self._no_logits()
        if tokens == 0:
            self._run_idle()
            return self._no_logits()
        self._last_out = None
        logits = super().step(chunks, exact=exact)
        self.stats.ran += 1
        if self.load is not None and self._last_out is not None:
            self._record(tokens)
        return logits

    def finish(self) -> None:
        """This rank has no more work: join idle steps until every rank has none."""
        while True:
            gmax, active = self._handshake(0, False)
            if not active:
                return
            if gmax:
                self._run_idle()
            else:
                self.stats.skipped += 1

    def generate(self, prompts, sampling_params=None) -> list:
        """This rank's prompts to completion, then `finish()` (so other ranks can complete too)."""
        try:
            return super().generate(prompts, sampling_params)
        finally:
            self.finish()

    def _run_idle(self) -> None:
        g = self._idle_graph
        env = {}
        for name in g.inputs:
            t = g.types[name]
            shape = tuple(0 if d == "T" else d for d in t.shape)
            from megagraph.graph.types import TORCH_DTYPES

            env[name] = torch.zeros(shape, dtype=TORCH_DTYPES[t.dtype], device=self.device)
        self.idle_program(env)
        self.stats.idle += 1

    def _no_logits(self) -> torch.Tensor:
        return torch.zeros(0, self.cfg.vocab_size, dtype=torch.float32, device=self.device)

    # -- EPLB --------------------------------------------------------------------------------------
    def _record(self, tokens: int) -> None:
        for i, s in enumerate(self.sites):
            slots = self._last_out[s.slots_output][:tokens]
            self.load.add(i, self._slot_expert[s.layer][slots])
        self.load.steps += 1

    def rebalance(self, load: torch.Tensor | None = None) -> dict:
        """Collective (every rank, same point): all-reduce the recorded load (or use `load`,
        [sites, E], identical on every rank), compute a placement per MoE layer, move the slot
        weights and rewrite the expert maps in place. Returns {layer: (ratio before, after)}."""
        if not self.sites:
            return {}
        if load is None:
            load = self.load.counts.clone()
            if self.ctx.world > 1:
                import torch.distributed as dist

                dist.all_reduce(load, group=self.ctx.data_group)
        rows = load.cpu().tolist()
        lay = self.layout
        old = [self.placement[s.layer] for s in self.sites]
        new = [eplb.compute_placement(rows[i], lay.ep, lay.slots_per_rank, previous=old[i])
               for i in range(len(self.sites))]
        moves = eplb.plan_moves(old, new)
        slot_w = [{w: self.weights[w] for w in s.local_weights} for s in self.sites]
        eplb.exchange_slots(slot_w, moves, self.ctx.rank, self.ctx.world, self.ctx.data_group)
        report = {}
        for i, s in enumerate(self.sites):
            self.placement[s.layer] = new[i]
            self.ep_maps[s.map_input].copy_(eplb.expert_map(new[i], lay.experts, lay.max_replicas))
            self._slot_expert[s.layer].copy_(eplb.slot_experts(new[i]))
            report[s.layer] = (eplb.balance_ratio(rows[i], old[i]), eplb.balance_ratio(rows[i], new[i]))
        self.load.reset()
        self.stats.rebalances.append({"step": self.stats.steps, "moves": len(moves),
                                      "balance": report})
        return report


def rank_engine_from_artifacts(path: str | Path, ctx: DistContext, weights=None, *,
                               eplb_interval: int = 0, **config) -> RankEngine:
    """`Engine.from_artifacts` for one rank of a parallel job."""
    from ..compile import StartupReport

    report = StartupReport()
    with report.timed("artifacts"):
        plan = RunPlan.from_artifacts(path)
    config.setdefault("device", str(ctx.device))
    return RankEngine(plan, weights, EngineConfig(**config), ctx=ctx, eplb_interval=eplb_interval,
                      report=report)


__all__ = ["RankEngine", "RankStats", "StepError", "rank_engine_from_artifacts"]
