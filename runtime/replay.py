"""Bounded-suffix decoder replay: the compiler's approximate prefill graphs, run for large steps.

A step that takes this path runs the `prefill-prefix` graph (layers up to the last KV source,
every row, eagerly) and then `prefill-suffix` (the late layers and the LM head on each request's
last `keep` rows only). Rows before those lose their late-layer keys, so this is approximate
(exact for chunks of at most `keep` rows); steps with a request that wants prompt logprobs take
the exact step graph instead (`Engine.step(..., exact=True)`).

Capture. The suffix graph starts with its row selection (`suffix_meta`, `select_rows`), whose
inputs have the step's T rows: T is unbounded on this path, so the selection runs eagerly and
only the rest (`rows_graph`: the late layers on K rows, K renamed T so it is step-shaped) is
captured, one CUDA graph per suffix row bucket of the plan, by the step graphs' `GraphRunner`.
A step's K kept rows are padded to the bucket with pad requests on the scratch slot
(runtime/batch.py `pad_batch`); the kept bridge rows are its extra inputs (pad rows zeroed).
K above the largest bucket runs the whole suffix eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch

from megagraph.graph.ir import Graph
from megagraph.graph.registry import get_op
from megagraph.graph.types import TensorType
from megagraph.graph.verify import verify_graph
from megagraph.kernels.reference_table import reference_impls

from .batch import StepBatch, pad_batch
from .cuda_graphs import GraphRunner
from .kernels import KernelSet
from .plan import SegmentPlan
from .step import METADATA, StepProgram

SELECTION_OPS = ("suffix_meta", "select_rows")
KEPT_META = {"positions.k": "positions", "token_req.k": "token_req", "seq_new.k": "seq_new"}


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


def takes_replay(seq_new: torch.Tensor, keep: int, step_tokens_above: int) -> bool:
    """The plan's rule of use: a step with a chunk longer than `keep` rows, and (where the plan
    captures step graphs, `step_tokens_above` > 0) more tokens than the captured graphs hold.
    Below that the exact step graph is captured and as fast; at most `keep` rows per request
    there is nothing to save."""
    if seq_new.numel() == 0 or int(seq_new.max()) <= keep:
        return False
    return int(seq_new.sum()) > step_tokens_above


def rows_graph(suffix: Graph, state_bridges: Mapping[str, str],
               other_bridges: tuple[str, ...] = ()) -> tuple[Graph, tuple[str, ...]]:
    """(the suffix after its row selection, its extra inputs).

    The graph is step-shaped: dim K renamed T, the kept metadata (`positions.k`, ...) renamed to
    the step's names, and bridges that are prefix state outputs (`state_bridges`: value -> pool)
    read from their pool, which the prefix has committed. The extra inputs are the selected
    bridge rows (`select_rows` outputs, now [T, ...]) and the `other_bridges` still read."""
    selection = [n for n in suffix.nodes if n.op in SELECTION_OPS]
    late = [n for n in suffix.nodes if n.op not in SELECTION_OPS]
    if not selection or suffix.nodes[:len(selection)] != tuple(selection):
        raise ValueError(f"{suffix.name}: expected the row selection ({', '.join(SELECTION_OPS)}) "
                         "at the start of the suffix graph")
    renames = {**KEPT_META, **state_bridges}
    nodes = [replace(n, inputs=tuple(renames.get(i, i) for i in n.inputs)) for n in late]
    used = {i for n in nodes for i in n.inputs if i is not None} | {v for _, v in suffix.outputs}
    produced = {o for n in nodes for o in n.outputs}
    weights = set(suffix.weights)
    selected = [n.outputs[0] for n in selection if n.op == "select_rows"]
    order = [renames.get(i, i) for i in suffix.inputs] + selected
    needed = [v for v in dict.fromkeys(order)
              if v in used and v not in produced and v not in weights]
    extra = tuple(v for v in needed if v in selected or v in other_bridges)
    inputs = tuple([v for v in needed if v not in extra] + list(extra))
    old = {new: o for o, new in renames.items()}
    types: dict[str, TensorType] = {}
    for v in (*inputs, *suffix.weights, *(o for n in nodes for o in n.outputs)):
        t = suffix.types[old.get(v, v)]
        if v not in weights and "T" in t.shape:
            raise ValueError(f"{suffix.name}: %{v} still has the step's T rows after selection")
        types[v] = TensorType(t.dtype, tuple("T" if d == "K" else d for d in t.shape))
    g = Graph(suffix.name + "/rows", tuple(d for d in suffix.dims if d != "K"), inputs,
              suffix.weights, tuple(nodes), suffix.outputs, types, suffix.meta)
    return verify_graph(g), extra


def segments_of(g: Graph) -> tuple[SegmentPlan, ...]:
    """Maximal runs of capturable nodes between breaks (the ops' registry entries decide, as
    in passes/partition.py)."""
    out: list[SegmentPlan] = []
    run: list[int] = []
    kind = None
    for i, n in enumerate(g.nodes):
        d = get_op(n.op)
        k = "eager" if d.is_break else "graph"
        if k != kind and run:
            out.append(_seg(len(out), kind, run, g))
            run = []
        kind = k
        run.append(i)
    if run:
        out.append(_seg(len(out), kind, run, g))
    return tuple(out)


def _seg(index: int, kind: str, nodes: list[int], g: Graph) -> SegmentPlan:
    why = "; ".join(dict.fromkeys(f"{g.nodes[i].op}: {get_op(g.nodes[i].op).break_reason}"
                                  for i in nodes)) if kind == "eager" else ""
    return SegmentPlan(index, kind, tuple(nodes), why)


@dataclass
class ReplayCounts:
    """Steps that took bounded replay, by how their suffix ran (start-up report, tests)."""

    captured: int = 0  # suffix padded to a row bucket: replayed from its CUDA graph on CUDA,
    #                    the same padded program uncaptured elsewhere
    eager: int = 0  # kept rows above the largest bucket, or no buckets


@dataclass(frozen=True)
class SuffixCapture:
    """How the engine wants the suffix's rows part run: its buckets and the runner's needs."""

    buckets: tuple[int, ...]  # suffix row buckets (K)
    device: torch.device
    capture: bool  # CUDA graphs on
    scratch_slot: int
    capacity: int
    bucket_reqs: Callable[[tuple[int, ...]], dict[int, int]]  # buckets -> request rows each


class BoundedReplay:
    """The prefix and suffix graphs as programs over the engine's weights and state pools."""

    def __init__(self, prefix: Graph, suffix: Graph, kernels: tuple[KernelSet, KernelSet],
                 weights: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor],
                 state: dict[str, torch.Tensor], keep: int, *, step_tokens_above: int = 0,
                 capture: SuffixCapture | None = None):
        self.keep, self.step_tokens_above = keep, step_tokens_above
        self.device = next(iter(state.values())).device
        self._kept_meta = reference_impls()["suffix_meta"]  # on host tensors, see _run_rows
        made = {v: lab for lab, v in prefix.outputs}
        self.bridge = {v: made[v] for v in suffix.inputs if v in made}  # suffix input -> label
        self.suffix_meta = tuple(m for m in METADATA if m in suffix.inputs)
        self.prefix = StepProgram(prefix, _one_segment(prefix), kernels[0], weights, constants, state)
        self.suffix = StepProgram(suffix, _one_segment(suffix), kernels[1], weights, constants, state,
                                  runtime_inputs=(*self.suffix_meta, "keep_rows", *self.bridge))
        self.selection = [(n, kernels[1].for_node(n)) for n in suffix.nodes
                          if n.op in SELECTION_OPS]
        self.counts = ReplayCounts()
        self.runner: GraphRunner | None = None
        if capture is not None and capture.buckets:
            self.runner = self._runner(suffix, kernels[1], weights, constants, state, capture)
            self._capture = capture

    def _runner(self, suffix, kernels, weights, constants, state, c: SuffixCapture) -> GraphRunner:
        pools = {v: lab for lab, v in self.prefix.graph.outputs
                 if lab in state and v in self.bridge}
        g, extra = rows_graph(suffix, pools, tuple(v for v in self.bridge if v not in pools))
        self.rows_extra = extra
        segs = segments_of(g)
        program = StepProgram(g, segs, kernels, weights, constants, state,
                              runtime_inputs=(*METADATA, *extra))
        capturable = {s.index for s in segs if s.kind == "graph"
                      and all(g.nodes[i].outputs[0] in kernels.capture_safe for i in s.nodes)}
        reasons = {s.index: s.why_eager or "kernels not capturable (reference)"
                   for s in segs if s.index not in capturable}
        return GraphRunner(program, c.buckets, capturable=capturable, eager_reasons=reasons,
                           device=c.device, capture=c.capture,
                           bucket_reqs=c.bucket_reqs(c.buckets), extra_inputs=extra)

    def capture(self):
        """Warm up and capture the suffix row buckets (a CaptureReport), or None."""
        if self.runner is None:
            return None
        return self.runner.capture(scratch_slot=self._capture.scratch_slot,
                                   capacity=self._capture.capacity)

    def applies(self, seq_new: torch.Tensor) -> bool:
        return takes_replay(seq_new, self.keep, self.step_tokens_above)

    def run(self, meta: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(suffix outputs, kept rows): logits has one row per kept row. `meta`: the step's
        metadata on the host (i64)."""
        device = self.device
        pre = self.prefix.run({k: v.to(device) for k, v in meta.items()})
        rows = keep_rows(meta["seq_new"], self.keep)
        bridges = {v: pre[lab] if lab in pre else self.prefix.state[lab]
                   for v, lab in self.bridge.items()}
        k = int(rows.shape[0])
        if self.runner is not None and self.runner.can_run(_rows_only(k)):
            out = self._run_rows(meta, rows, bridges, device)
            self.counts.captured += 1
            return {lab: v[:k] for lab, v in out.items()}, rows
        env = {m: meta[m].to(device) for m in self.suffix_meta}
        env["keep_rows"] = rows.to(device)
        env.update(bridges)
        self.counts.eager += 1
        return self.suffix.run(env), rows

    def _run_rows(self, meta, rows, bridges, device) -> dict[str, torch.Tensor]:
        """The selection eagerly (the kept metadata on the host, with the reference kernel: pad
        rows are appended there; bridge rows on the device), then the rows graph padded to its
        bucket."""
        host = {**{m: meta[m] for m in self.suffix_meta}, "keep_rows": rows}
        dev = {**bridges, "keep_rows": rows.to(device)}
        for n, fn in self.selection:
            env = host if n.op == "suffix_meta" else dev
            fn = self._kept_meta if n.op == "suffix_meta" else fn
            outs = fn(*(env[i] for i in n.inputs), **n.attr_dict)
            outs = outs if isinstance(outs, tuple) else (outs,)
            env.update(zip(n.outputs, outs))
        kept = {new: host[old] for old, new in KEPT_META.items()}
        k = int(rows.shape[0])
        step = {"token_ids": torch.zeros(k, dtype=torch.int64),
                "seq_slots": meta["seq_slots"], "seq_cached": meta["seq_cached"], **kept}
        batch = StepBatch(step, k, int(meta["seq_slots"].shape[0]))
        b = self.runner.padded_size(k)
        padded = pad_batch(batch, b, self.runner.reqs(b), scratch_slot=self._capture.scratch_slot,
                           capacity=self._capture.capacity)
        return self.runner.replay(padded, {v: dev[v] for v in self.rows_extra})


def _rows_only(k: int) -> StepBatch:
    """A stand-in batch of k rows for `GraphRunner.can_run`."""
    return StepBatch({}, k, 0)
