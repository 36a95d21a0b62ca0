"""The compile pipeline: one list of stages, each run, verified, recorded and noted in the dump.

`compile_graph(graph, hw, options)` runs the stages on a built step graph; `compile_model(cfg, hw,
options)` builds the graph first. Ordering invariants are stated next to each stage (and collected
in passes/README.md). Nothing nondeterministic is stamped into graphs: timings live only in the
records (and the manifest's `timing` section).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from megagraph.graph.errors import IRError
from megagraph.graph.ir import Graph
from megagraph.graph.verify import verify_graph
from megagraph.models.config import ModelConfig

from . import expert_parallel  # registers the pass; check_options
from .base import PASSES, Pass, PassError, PassResult
from .hw import HwProfile

# The default pipeline, in order. Each line: the pass, and why it sits where it does.
PIPELINE = (
    "fold-constants",       # first: identity casts and view round trips vanish, matchers see real ops
    "cse",                  # before fusions: fusions check single use, duplicates would block them
    "fuse-compressor",      # before quantize-epilogues: the compressor reads the unquantized norm
    "quantize-epilogues",   # before mega-moe-fusion, which absorbs the MoE-input quantize_act
    "mega-moe-fusion",      # needs quantize-epilogues' moe_experts_q / swiglu_mlp_q
    "mega-mhc-fusion",      # after mega-moe-fusion: the mHC front halves it left (attention sites)
    "expert-parallel",      # after mega-moe-fusion (splits mega_moe); only with --dp/--ep > 1
    "batch-window-copies",  # after every attention rewrite: it reads each layer's final kv value
    "indexer-products",     # after every attention rewrite: reads the final producers of qi / ikey
    "dead-code",            # safety net for anything the rewrites orphaned
    "partition-prefill",    # last pass that reorders nodes: the plan's segments index this order
    "bounded-replay",       # derives side graphs from the final step (step unchanged)
    "encoder-replay",       # likewise: the prefix cache's ring rebuild graph (always emitted)
    "dspark-draft",         # likewise: DSpark's draft graph and verify step (V4.1 with a head)
)


@dataclass(frozen=True)
class CompileOptions:
    """What `megagraph compile` can be asked for (CLI flags map 1:1)."""

    bounded_replay: bool | None = None  # emit the approximate bounded-suffix graphs; None: the
    #                                     profile's bounded_replay_default (off with --ep > 1)
    logits: str = "all"  # logits for "all" rows or each request's "last" row
    passes: tuple[str, ...] | None = None  # -p: run exactly these passes, in this order
    keep: int = 0  # bounded replay: rows kept per request (0 = window + draft backtracking)
    context: int = 65536  # tokens per slot assumed by the plan's memory numbers
    verify: bool = True  # verify the graph after every pass
    dp: int = 1  # data-parallel attention ranks (passes/expert_parallel.py)
    ep: int = 1  # expert-parallel ranks: 1 or dp
    redundant_experts: int = 0  # extra expert replicas over the EP group (EPLB)
    ep_max_tokens: int = 0  # tokens per rank per step the dispatch buffers hold (0 = auto)
    balanced_routing: bool = False  # benchmarks: experts assigned round-robin, not by the router
    numerics: str = "default"  # "reference": f32 activations, no KV / activation quantization
    #                            (models/numerics.py; the config is changed before building)
    disable_passes: tuple[str, ...] = ()  # --disable-pass: pipeline passes recorded as skipped
    kernel_config: dict = field(default_factory=dict)  # --kernel-config / --set layers,
    #                            {family: {field: value}} over configs/kernels/<profile>.yaml
    allow_unvalidated: bool = False  # --allow-unvalidated: plans may pick kernels not yet run
    #                                  on their device (registry status "unvalidated")

    @property
    def parallel(self) -> bool:
        return self.dp > 1 or self.ep > 1

    def replay_enabled(self, hw: HwProfile) -> bool:
        """Whether the bounded-replay graphs are emitted: the flag, else the profile's default
        (never by default with --ep > 1, where every rank must run the same graph)."""
        if self.bounded_replay is not None:
            return self.bounded_replay
        return hw.bounded_replay_default and self.ep == 1

    def resolved_keep(self, cfg: ModelConfig) -> int:
        """window + the rows a draft may roll back (DSpark: block + 1 verify rows)."""
        if self.keep:
            return self.keep
        return cfg.sliding_window + (cfg.dspark_block_size + 1 if cfg.num_mtp_layers else 0)


@dataclass
class StageRecord:
    """One pipeline stage as the manifest and `inspect` show it."""

    index: int  # 1-based; 0 is the built graph
    name: str  # pass name
    status: str  # "changed", "unchanged", "emitted" (side graphs only) or "skipped"
    note: str  # what it did, or why not
    stats: dict  # pass-specific counts
    options: dict  # the pass's option fields
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    nodes_added: int
    nodes_removed: int
    graph: Graph  # the graph after this stage (with the note in its meta)
    extra_graphs: dict = field(default_factory=dict)  # name -> Graph (bounded replay)
    seconds: float = 0.0  # wall time; never written into anything snapshotted

    def summary(self) -> dict:
        return {"index": self.index, "name": self.name, "status": self.status, "note": self.note,
                "stats": self.stats, "options": self.options,
                "nodes_before": sum(self.ops_before.values()),
                "nodes_after": sum(self.ops_after.values()),
                "nodes_added": self.nodes_added, "nodes_removed": self.nodes_removed}


def make_pass(name: str, hw: HwProfile, opt: CompileOptions, keep: int = 0,
              cfg: ModelConfig | None = None) -> Pass:
    """An instance of pass `name` configured from the profile and the options."""
    cls = PASSES.get(name)
    if cls is None:
        raise IRError(f"unknown pass {name!r}; known: {', '.join(sorted(PASSES))}")
    kwargs = {}
    fields = getattr(cls, "__dataclass_fields__", {})
    if "hw" in fields:
        kwargs["hw"] = hw
    if name == "bounded-replay":
        kwargs.update(enabled=opt.replay_enabled(hw), keep=keep or opt.keep,
                      explicit=opt.bounded_replay is not None)
    if name == "dspark-draft":
        kwargs.update(cfg=cfg)
    if name == "quantize-epilogues":
        kwargs.update(reference=opt.numerics == "reference")
    if name == "expert-parallel":
        kwargs.update(dp=opt.dp, ep=opt.ep, redundant_experts=opt.redundant_experts,
                      max_tokens=opt.ep_max_tokens,
                      routing="balanced" if opt.balanced_routing else "model")
    return cls(**kwargs)


def stage(g: Graph, p: Pass, index: int, opt: CompileOptions, done: list[str]) -> StageRecord:
    """Run one pass: verify the result, record what changed, and note why in the graph's meta."""
    t0 = time.perf_counter()
    if p.name in opt.disable_passes:
        res = p.skip(g, "disabled by --disable-pass")
    else:
        try:
            res = p.run(g)
        except IRError as e:
            raise PassError(f"pass {p.name} failed: {e}\n  (pipeline so far: {', '.join(done)})") from e
    secs = time.perf_counter() - t0
    out = res.graph
    if opt.verify and out is not g:
        verify_graph(out, after_pass=p.name)
    for name, extra in res.extra_graphs.items():
        verify_graph(extra, after_pass=f"{p.name} ({name})")
    before, after = set(g.nodes), set(out.nodes)
    status = ("skipped" if res.skipped else "changed" if out is not g
              else "emitted" if res.extra_graphs else "unchanged")
    notes = list(out.meta_value("notes", ()) or ())
    out = out.with_meta(notes=[*notes, f"{p.name}: {res.note}"])
    note = res.note.removeprefix("skipped: ")
    return StageRecord(index, p.name, status, note, dict(res.stats), p.options(),
                       g.op_counts(), out.op_counts(), len(after - before), len(before - after),
                       out, dict(res.extra_graphs), secs)


def compile_graph(g: Graph, hw: HwProfile, options: CompileOptions | None = None, *,
                  keep: int = 0,
                  cfg: ModelConfig | None = None) -> tuple[Graph, list[StageRecord]]:
    """Run the pipeline (or `options.passes`) on a built step graph; `cfg`, the model it was
    built from, lets the passes that need more than the graph (dspark-draft) run."""
    opt = options or CompileOptions()
    expert_parallel.check_options(opt)
    unknown = [x for x in opt.disable_passes if x not in PASSES]
    if unknown:
        raise IRError(f"--disable-pass: unknown pass(es) {unknown}; known: "
                      f"{', '.join(sorted(PASSES))}")
    names = opt.passes if opt.passes is not None else tuple(
        n for n in PIPELINE if n != "expert-parallel" or opt.parallel)  # single rank: no record
    records: list[StageRecord] = []
    for i, name in enumerate(names, start=1):
        rec = stage(g, make_pass(name, hw, opt, keep, cfg), i, opt, [r.name for r in records])
        records.append(rec)
        g = rec.graph
    return g, records


@dataclass
class Compiled:
    """Everything `compile` produced for one model x hardware profile."""

    cfg: ModelConfig
    hw: HwProfile
    options: CompileOptions
    built: Graph
    graph: Graph  # the final step graph
    records: list[StageRecord]
    extra_graphs: dict[str, Graph]
    build_seconds: float

    @property
    def stages(self) -> list[tuple[str, Graph]]:
        """(file stem, graph) per dump: 00-built, 01-<pass>, ..."""
        out = [("00-built", self.built)]
        out += [(f"{r.index:02d}-{r.name}", r.graph) for r in self.records]
        return out


def compile_model(cfg: ModelConfig, hw: HwProfile, options: CompileOptions | None = None) -> Compiled:
    """Build the step graph of `cfg` and compile it for `hw`. With `options.numerics` =
    "reference" the config is `models.numerics.with_numerics(cfg, "reference")` first, and
    `Compiled.cfg` (written as model.yaml) is that config."""
    from megagraph.models.build import build_step
    from megagraph.models.numerics import with_numerics

    opt = options or CompileOptions()
    cfg = with_numerics(cfg, opt.numerics)
    t0 = time.perf_counter()
    built = build_step(cfg, logits=opt.logits)
    secs = time.perf_counter() - t0
    final, records = compile_graph(built, hw, opt, keep=opt.resolved_keep(cfg), cfg=cfg)
    extra = {k: v for r in records for k, v in r.extra_graphs.items()}
    return Compiled(cfg, hw, opt, built, final, records, extra, secs)


__all__ = ["PIPELINE", "CompileOptions", "StageRecord", "Compiled", "compile_graph",
           "compile_model", "make_pass", "PassResult"]
