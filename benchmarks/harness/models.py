"""The models the benchmarks run: the tiny V4.1 and full-width V4.1-Flash layer slices, compiled
through the public compiler API for a hardware profile, with weights made once on the device (so
that every engine of a run shares them)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


def slice_config(layers: int = 4):
    """Full-width V4.1-Flash (release widths and formats, 384 experts) cut to a layer slice that
    covers every layer role: the shipped configs/models/v4.1-flash-slice{4,5}.yaml, so that the
    benchmarks and `megagraph compile --model v4.1-flash-slice5` build the same model
    (tests/models/test_slice_configs.py derives both from v4.1-flash.yaml field by field).

    4 layers: L0 window-only + Engram, L1 ratio-2 KV/index source, L2 ratio-2 reuse, L3 ratio-1
    KV/index/candidate source. 5 layers: the same plus L4, a ratio-1 reindex layer (its own indexer
    over L3's index keys, restricted to L3's candidate blocks)."""
    from megagraph.models.config import load_model_config

    if layers not in (4, 5):
        raise ValueError(f"no {layers}-layer slice (4 or 5)")
    return load_model_config(f"v4.1-flash-slice{layers}")


MODELS = {"tiny": "v4.1-flash-tiny (9 layers at toy width, seeded random weights)",
          "slice": "4-layer full-width V4.1-Flash slice", "slice4": "4-layer full-width slice",
          "slice5": "5-layer full-width V4.1-Flash slice (adds a reindex layer)"}


def model_config(name: str):
    from megagraph.models.config import load_model_config

    if name in ("slice", "slice4"):
        return slice_config(4)
    if name == "slice5":
        return slice_config(5)
    if name == "tiny":
        return load_model_config("v4.1-flash-tiny")
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def hw_for(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    from megagraph.runtime.kernels import device_arch

    arch = device_arch(device)
    return {"sm_90": "h200", "sm_100": "b200", "sm_103": "b300"}.get(arch, "h200")


def compile_artifacts(cfg, hw: str, root: Path, logits: str = "all") -> Path:
    from megagraph.passes import compile_model, load_hw_profile
    from megagraph.passes.artifacts import write_artifacts
    from megagraph.passes.pipeline import CompileOptions

    out = root / f"{cfg.name}-{hw}-{logits}"
    write_artifacts(compile_model(cfg, load_hw_profile(hw), CompileOptions(logits=logits)), out,
                    force=True)
    return out


@dataclass
class Model:
    """A compiled model with its weights on the device."""

    name: str  # "tiny", "slice", "slice5"
    cfg: object
    plan: object  # RunPlan
    weights: dict
    hw: str
    setup_s: float

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights.values())

    @property
    def device_weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights.values()
                   if w.device.type != "cpu")

    def describe(self) -> dict:
        c = self.cfg
        return {"model": c.name, "key": self.name, "hw_profile": self.hw, "layers": c.num_layers,
                "hidden": c.hidden_size, "experts": c.n_routed_experts,
                "compress_ratios": list(c.compress_ratios), "roles": layer_kinds(c),
                "weight_bytes": self.weight_bytes, "setup_s": self.setup_s}


def load_model(name: str, device: torch.device, root: Path, *, logits: str = "all",
               hw: str | None = None, log=print) -> Model:
    """Compile `name` for `hw` (default: this device's profile) and make its weights once
    (slices: fast random weights on the device; tiny: the tests' seeded weights)."""
    from megagraph.runtime.plan import RunPlan
    from megagraph.runtime.weights import (
        fast_random_weights,
        graph_weight_specs,
        seeded_weights,
    )

    cfg = model_config(name)
    hw = hw or hw_for(device)
    t0 = time.perf_counter()
    plan = RunPlan.from_artifacts(compile_artifacts(cfg, hw, root, logits))
    make = seeded_weights if name == "tiny" else fast_random_weights
    weights = make(graph_weight_specs([plan.graph]), plan.cfg, seed=0, device=device)
    m = Model(name, cfg, plan, weights, hw, round(time.perf_counter() - t0, 2))
    log(f"{cfg.name}: artifacts + weights ({m.weight_bytes / 2**30:.2f} GiB) in {m.setup_s}s")
    return m


def layer_kinds(cfg) -> list[str]:
    """'swa', 'full r2', 'reuse r1', ... per layer (+ ' +engram')."""
    from megagraph.models.v41 import layer_roles

    return [f"{r.kind}" + (f" r{r.ratio}" if r.ratio else "") +
            (" +engram" if r.engram_table is not None else "") for r in layer_roles(cfg)]
