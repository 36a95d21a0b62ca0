"""Bounded-suffix decoder replay: the compiler's approximate prefill graphs, run on request.

With `EngineConfig.bounded_replay`, a step with a prompt chunk longer than `keep` rows runs the
`prefill-prefix` graph (layers up to the last KV source, every row) and then `prefill-suffix`
(the late layers and the LM head on each request's last `keep` rows only). Rows before those
lose their late-layer keys, so this is approximate (exact for chunks of at most `keep` rows);
never use it for requests that want prompt logprobs. Both graphs run eagerly here; the plan's
suffix row buckets are not captured yet.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megagraph.graph.ir import Graph

from .kernels import KernelSet
from .plan import SegmentPlan
from .step import METADATA, StepProgram


def _one_segment(g: Graph) -> tuple[SegmentPlan, ...]:
    return (SegmentPlan(0, "eager", tuple(range(len(g.nodes))), "bounded replay runs eagerly"),)


def keep_rows(seq_new: torch.Tensor, keep: int) -> torch.Tensor:
    """Token rows of each request's last min(seq_new, keep) tokens, in order (i64[K])."""
    ends = torch.cumsum(seq_new, 0)
    kept = seq_new.clamp(max=keep)
    starts = torch.repeat_interleave(ends - kept, kept)
    within = torch.arange(int(kept.sum()), device=seq_new.device) - \
        torch.repeat_interleave(torch.cumsum(kept, 0) - kept, kept)
    return starts + within


class BoundedReplay:
    """The prefix and suffix graphs as programs over the engine's weights and state pools."""

    def __init__(self, prefix: Graph, suffix: Graph, kernels: tuple[KernelSet, KernelSet],
                 weights: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor],
                 state: dict[str, torch.Tensor], keep: int):
        self.keep = keep
        made = {v: lab for lab, v in prefix.outputs}
        self.bridge = {v: made[v] for v in suffix.inputs if v in made}  # suffix input -> label
        self.suffix_meta = tuple(m for m in METADATA if m in suffix.inputs)
        self.prefix = StepProgram(prefix, _one_segment(prefix), kernels[0], weights, constants, state)
        self.suffix = StepProgram(suffix, _one_segment(suffix), kernels[1], weights, constants, state,
                                  runtime_inputs=(*self.suffix_meta, "keep_rows", *self.bridge))

    def run(self, meta: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(suffix outputs, kept rows): logits has one row per kept row."""
        pre = self.prefix.run(meta)
        rows = keep_rows(meta["seq_new"], self.keep)
        env = {m: meta[m] for m in self.suffix_meta}
        env["keep_rows"] = rows
        for v, lab in self.bridge.items():
            env[v] = pre[lab] if lab in pre else self.prefix.state[lab]
        return self.suffix.run(env), rows
