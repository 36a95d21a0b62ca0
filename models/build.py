"""Model family -> step-graph builder dispatch."""

from __future__ import annotations

from megagraph.graph.ir import Graph

from .config import ModelConfig


def build_step(cfg: ModelConfig, *, logits: str = "all") -> Graph:
    """The step graph of `cfg` (V4.1 or V4); `logits` = "all" rows or each request's "last"."""
    if logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
    if cfg.family == "v4.1":
        from .v41 import build_v41_step

        return build_v41_step(cfg, logits=logits)
    from .v4 import build_v4_step

    return build_v4_step(cfg, logits=logits)
