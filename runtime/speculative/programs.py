"""The DSpark draft graph and the verify step as programs over an engine's weights and pools.

Both come from the plan (passes/dspark_draft.py): `dspark-draft` reads the `mtp.S.ring` pools
the step keeps up to date and writes no state; `dspark-verify` is the step graph with extra
per-row outputs, so it runs with the engine's own segments and kernels and commits into the
engine's pools exactly as `Engine.step` does. The draft head's own tensors (`mtp.*` beyond the
step's) are bound here: from the engine's checkpoint, given tensors, or the engine's seeded
random weights (the same per-name seeds, so shared tensors agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from megagraph.graph.ir import Graph
from megagraph.passes.dspark_draft import DRAFT, VERIFY

from ..batch import SeqChunk, make_batch
from ..kernels import resolve_kernels
from ..plan import ArtifactsError, SegmentPlan
from ..step import StepProgram
from ..weights import graph_weight_specs, host_resident, load_weights, seeded_weights

DRAFT_INPUTS = ("anchor_ids", "seq_slots", "seq_cached")


@dataclass(frozen=True)
class DraftOut:
    """One draft step: per request B drafts, their confidences and the Markov logits."""

    drafts: torch.Tensor  # i64[R, B]
    confidence: torch.Tensor  # f32[R, B]
    logits: torch.Tensor  # f32[R, B, V]


def plan_graphs(plan) -> tuple[Graph, Graph]:
    """(draft, verify) graphs of a plan, or an error saying why they are not there."""
    where = plan.source or "artifacts"
    draft, verify = plan.extra_graphs.get(DRAFT), plan.extra_graphs.get(VERIFY)
    if draft is None:
        raise ArtifactsError(f"{where}: no {DRAFT} graph; {plan.cfg.name} needs a DSpark head "
                             "(V4.1, num_mtp_layers > 0) compiled by a megagraph with the "
                             "dspark-draft pass")
    if verify is None:
        raise ArtifactsError(f"{where}: no {VERIFY} graph (see the dspark-draft note in "
                             "manifest.yaml: profiles with the fused compressor lack it)")
    return draft, verify


def verify_segments(plan, verify: Graph) -> tuple[SegmentPlan, ...]:
    """The step's segments (the verify graph starts with the step's nodes, in order), plus one
    eager segment for the nodes it appends."""
    n = len(plan.graph.nodes)
    if verify.nodes[:n] != plan.graph.nodes:
        raise ArtifactsError(f"{plan.source or 'artifacts'}: the {VERIFY} graph does not start "
                             "with the step graph's nodes (graphs from different compiles?)")
    if len(verify.nodes) == n:
        return plan.segments
    return (*plan.segments, SegmentPlan(len(plan.segments), "eager",
                                        tuple(range(n, len(verify.nodes))),
                                        "verify: the pending rows a fused compressor hides"))


class SpecPrograms:
    """Draft and verify programs bound to one engine."""

    def __init__(self, engine, draft_weights: Mapping[str, torch.Tensor] | None = None):
        self.engine = engine
        plan, c = engine.plan, engine.config
        self.draft_graph, self.verify_graph = plan_graphs(plan)
        self.block = int(self.draft_graph.meta_value("block"))
        weights = dict(engine.weights)
        weights.update(self._draft_weights(draft_weights))
        kernels = resolve_kernels(plan, [self.draft_graph], engine.device,
                                  allow_fallback=c.allow_fallback, override=c.kernels)
        rings = {n: engine.state[n] for n in self.draft_graph.inputs if n in engine.state}
        seg = (SegmentPlan(0, "eager", tuple(range(len(self.draft_graph.nodes))),
                           "the draft graph runs eagerly"),)
        self.draft = StepProgram(self.draft_graph, seg, kernels, weights, {}, rings,
                                 runtime_inputs=DRAFT_INPUTS)
        self.verify = StepProgram(self.verify_graph, verify_segments(plan, self.verify_graph),
                                  self._verify_kernels(), engine.weights, engine.constants,
                                  engine.state)

    def _verify_kernels(self):
        """The step's kernels, plus the verify graph's own nodes (the pending-row projections
        a fused compressor hides) resolved from the plan the same way."""
        eng, g = self.engine, self.verify_graph
        if len(g.nodes) == len(eng.plan.graph.nodes):
            return eng.kernels
        ks = resolve_kernels(eng.plan, [g], eng.device, allow_fallback=eng.config.allow_fallback,
                             override=eng.config.kernels)
        ks.run_on_host(g, host_resident(eng.plan.graph) if eng.device.type == "cuda" else set())
        return ks

    def _draft_weights(self, given) -> dict[str, torch.Tensor]:
        eng = self.engine
        specs = [s for s in graph_weight_specs([self.draft_graph]) if s.name not in eng.weights]
        if given is not None:
            missing = [s.name for s in specs if s.name not in given]
            if missing:
                raise ValueError(f"draft weights: {len(missing)} tensors missing, e.g. "
                                 f"{missing[:3]}")
            return {s.name: given[s.name].to(eng.device) for s in specs}
        if eng.ckpt_dir is not None:
            return load_weights(specs, set(), eng.ckpt_dir, device=eng.device, cfg=eng.cfg,
                                progress=False)
        return seeded_weights(specs, eng.cfg, seed=eng.config.seed, device=eng.device)

    def run_draft(self, slots: Sequence[int], anchors: Sequence[int]) -> DraftOut:
        """Draft a block for each (slot, anchor token) from the slot's cached tokens."""
        dev = self.engine.device
        i64 = lambda v: torch.tensor(list(v), dtype=torch.int64, device=dev)  # noqa: E731
        out = self.draft.run({"anchor_ids": i64(anchors), "seq_slots": i64(slots),
                              "seq_cached": i64(self.engine.cached[s] for s in slots)})
        R = len(slots)
        return DraftOut(out["drafts"], out["confidence"], out["logits"].reshape(R, self.block, -1))

    def run_verify(self, chunks: Sequence[SeqChunk]) -> dict[str, torch.Tensor]:
        """One verify step (the step graph + per-row outputs); advances `engine.cached` by every
        fed row (rollback.py puts back the rejected ones)."""
        eng = self.engine
        for ch in chunks:
            if eng.cached.get(ch.slot, 0) + len(ch.tokens) > eng.config.capacity:
                raise ValueError(f"slot {ch.slot}: verify rows exceed the capacity "
                                 f"{eng.config.capacity}")
        batch = make_batch(chunks, eng.cached)
        out = self.verify.run({k: v.to(eng.device) for k, v in batch.meta.items()})
        for ch in chunks:
            eng.cached[ch.slot] = eng.cached.get(ch.slot, 0) + len(ch.tokens)
        return out
