"""Artifacts dir -> RunPlan, through the compiler's loader (passes/artifacts.py)."""

from __future__ import annotations

from pathlib import Path

from megagraph.kernels.kernel_config import KernelConfigError, from_plan
from megagraph.models.config import ModelConfig

from .plan import ArtifactsError, RunPlan, default_tokenizer, segments_from_rows


def load_run_plan(path: Path, *, allow_edited: bool = False) -> RunPlan:
    from megagraph.passes.artifacts import ArtifactError, load_artifacts

    try:
        arts = load_artifacts(path, allow_edited=allow_edited)
    except ArtifactError as e:
        raise ArtifactsError(str(e)) from None
    where = str(path / "plan.yaml")
    plan, hw = arts.plan, arts.manifest.get("hardware", {})
    try:
        cfg = ModelConfig.from_dict(arts.model, source=str(path / "model.yaml"))
        graph = arts.graphs["step"]
        segments = segments_from_rows(graph, plan["segments"], where)
        buckets = plan.get("buckets", {})
        kernels = {k: row["kernel"] for k, row in plan.get("kernels", {}).items()}
        families = {k: row["family"] for k, row in plan.get("kernels", {}).items()
                    if "family" in row}
        configs = kernel_configs(plan.get("kernel_configs") or {}, where)
    except KeyError as e:
        raise ArtifactsError(f"{where}: missing field {e.args[0]!r} (artifacts from an older "
                             "compiler? recompile with --force)") from None
    extra = {k: v for k, v in arts.graphs.items() if k != "step"}
    return RunPlan(cfg, graph, hw.get("name", "?"), hw.get("arch", "?"), segments,
                   decode_buckets=tuple(buckets.get("decode_rows", ())),
                   prefill_buckets=tuple(buckets.get("prefill_tokens", ())),
                   kernels=kernels, kernel_families=families, kernel_configs=configs,
                   compile_backend=plan.get("compile_backend"),
                   extra_graphs=extra, memory=plan.get("memory", {}),
                   replay=plan.get("bounded_replay") or {},
                   tokenizer=arts.manifest.get("model", {}).get("tokenizer") or default_tokenizer(cfg),
                   source=Path(path), edited=arts.edited)


def kernel_configs(section: dict, where: str) -> dict:
    """The plan's `kernel_configs` section -> {family: KernelConfig} (kernel_config.from_plan)."""
    try:
        objs = from_plan({fam: row["fields"] for fam, row in section.items()},
                         where=f"{where}: kernel_configs")
    except KernelConfigError as e:
        raise ArtifactsError(str(e)) from None
    return {fam: objs[fam] for fam in section}
