"""One engine step as the plan's segments: Programs over shared state pools, run eagerly.

`StepProgram.run(meta)` executes every segment in order at the step's exact shapes (the CPU path,
and the CUDA path for steps no captured graph holds). State outputs are copied back into the
pools (skipped when a kernel updated its pool in place), so pools keep fixed addresses and
captured graphs and eager steps can alternate.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megagraph.graph.ir import Graph

from .kernels import KernelSet
from .plan import SegmentPlan
from .segments import Program, segment_io

METADATA = ("token_ids", "positions", "token_req", "seq_slots", "seq_cached", "seq_new")


class StepProgram:
    """The segments of one step graph as Programs, plus the state pools they update."""

    def __init__(self, g: Graph, segments: tuple[SegmentPlan, ...], kernels: KernelSet,
                 weights: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor],
                 state: dict[str, torch.Tensor], runtime_inputs: tuple[str, ...] = METADATA):
        self.graph, self.segments = g, segments
        self.ios = segment_io(g, [s.nodes for s in segments])
        self.programs = [Program(f"{s.index}:{s.kind}", g, s.nodes, io, kernels.for_node, weights)
                         for s, io in zip(segments, self.ios)]
        self.constants = dict(constants)
        self.state = state
        missing = [i for i in g.inputs if i not in runtime_inputs and i not in state
                   and i not in constants]
        if missing:
            raise ValueError(f"graph {g.name}: no value for input(s) {missing}")
        self.result_labels = tuple(lab for lab, _ in g.outputs if lab not in state)

    def run(self, meta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run every segment on `meta` (the step's runtime inputs); commit state; return the
        non-state outputs."""
        env = {**meta, **self.constants, **self.state}
        for p in self.programs:
            env.update(p(env))
        outs = {lab: env[v] for lab, v in self.graph.outputs}
        commit_state(self.state, outs)
        return {lab: outs[lab] for lab in self.result_labels}


def commit_state(state: dict[str, torch.Tensor], outs: Mapping[str, torch.Tensor]) -> None:
    """Copy each state output into its pool unless the kernel already wrote the pool in place."""
    for name, pool in state.items():
        new = outs.get(name)
        if new is not None and new.data_ptr() != pool.data_ptr():
            pool.copy_(new)
