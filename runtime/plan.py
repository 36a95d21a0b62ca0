"""What the runtime executes: the compiled step graph and the plan's decisions, in one object.

`RunPlan.from_artifacts(dir)` reads them through the compiler's loader; `RunPlan.from_graph` wraps a
bare step graph (one eager segment, no buckets) for tests and tools that skip `compile`. The
runtime reads segments, buckets and kernel choices from here and never recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megagraph.graph.ir import Graph
from megagraph.models.config import ModelConfig


class ArtifactsError(ValueError):
    """Artifacts missing, malformed, or not for this device; the message names the file."""


@dataclass(frozen=True)
class SegmentPlan:
    """A run of step-graph nodes executed one way."""

    index: int
    kind: str  # "graph" (capturable) or "eager" (a break, or a profile without CUDA graphs)
    nodes: tuple[int, ...]  # indices into graph.nodes, in order
    why_eager: str = ""  # the plan's reason, for the start-up report


@dataclass(frozen=True)
class RunPlan:
    """A compiled model as the runtime sees it."""

    cfg: ModelConfig
    graph: Graph  # the final step graph
    hw_name: str  # profile the artifacts were compiled for ("cpu", "h200", ...)
    hw_arch: str  # its arch ("cpu", "sm_90", ...)
    segments: tuple[SegmentPlan, ...]
    decode_buckets: tuple[int, ...] = ()  # captured decode batch sizes (rows)
    prefill_buckets: tuple[int, ...] = ()  # captured prefill token counts
    kernels: dict[str, str] = field(default_factory=dict)  # kernel key -> implementation name
    kernel_families: dict[str, str] = field(default_factory=dict)  # kernel key -> config family
    kernel_configs: dict = field(default_factory=dict)  # family -> its KernelConfig (plan.yaml)
    compile_backend: str | None = None  # torch.compile backend the plan asks for, if any
    extra_graphs: dict[str, Graph] = field(default_factory=dict)  # bounded replay, by name
    memory: dict = field(default_factory=dict)  # the plan's memory section
    replay: dict = field(default_factory=dict)  # the plan's bounded_replay section (keep, graphs)
    tokenizer: str | None = None  # tokenizer the model uses (configs/tokenizers name or path)
    source: Path | None = None  # artifacts dir
    edited: tuple[str, ...] = ()  # artifact files that differ from the manifest (allowed to load)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Every captured step size: a bucket b holds T <= b tokens (and at most b requests; the engine caps the rows at its slots plus pad rows)."""
        return tuple(sorted(set(self.decode_buckets) | set(self.prefill_buckets)))

    @classmethod
    def from_graph(cls, cfg: ModelConfig, g: Graph, *, buckets: tuple[int, ...] = (),
                   tokenizer: str | None = None) -> "RunPlan":
        """One segment over the whole step; `buckets` only for padding tests on CPU."""
        seg = SegmentPlan(0, "graph" if buckets else "eager", tuple(range(len(g.nodes))),
                          "" if buckets else "no plan (bare step graph)")
        return cls(cfg, g, "cpu", "cpu", (seg,), decode_buckets=tuple(buckets),
                   tokenizer=tokenizer or default_tokenizer(cfg))

    @classmethod
    def from_artifacts(cls, path: str | Path, *, allow_edited: bool = False) -> "RunPlan":
        """Every file is checked against the manifest's hash; an edited one is refused (naming
        it) unless `allow_edited`, which records it in `edited`."""
        from .artifacts import load_run_plan

        return load_run_plan(Path(path), allow_edited=allow_edited)


def segments_from_rows(g: Graph, rows: list[dict], where: str) -> tuple[SegmentPlan, ...]:
    """Plan segment rows ({kind, first, last, ...}) -> node index runs of `g`, checked to tile it."""
    index = {n.outputs[0]: i for i, n in enumerate(g.nodes)}
    out, expect = [], 0
    for k, row in enumerate(rows):
        try:
            a, b = index[row["first"]], index[row["last"]]
        except KeyError as e:
            raise ArtifactsError(f"{where}: segment {k} names node %{e.args[0]}, which is not in the "
                                 "final graph (plan and graph are from different compiles?)") from None
        if a != expect or b < a:
            raise ArtifactsError(f"{where}: segment {k} covers nodes {a}..{b}; expected it to start "
                                 f"at node {expect}")
        why = "; ".join(row.get("breaks", ())) or row.get("why_eager", "")
        out.append(SegmentPlan(k, row["kind"], tuple(range(a, b + 1)), why))
        expect = b + 1
    if expect != len(g.nodes):
        raise ArtifactsError(f"{where}: segments cover {expect} of {len(g.nodes)} nodes")
    return tuple(out)


def default_tokenizer(cfg: ModelConfig) -> str | None:
    """Tokenizer of a model run without a checkpoint: the bundled DeepSeek-V4 one when the model's
    vocabulary covers its 129,280 ids (the tiny models and the release models do)."""
    from .tokenizer import BUNDLED_V4

    return BUNDLED_V4 if cfg.vocab_size >= 129280 else None
