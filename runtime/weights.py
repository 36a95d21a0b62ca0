"""Weight binding: checkpoint (streamed, memory-mapped) or seeded random, in the plan's storage
formats, after a fit check that fails before anything is loaded.

Weights read only by eager breaks (Engram tables: `engram_lookup` gathers rows on the CPU) stay
host-resident, memory-mapped from the checkpoint when there is one; everything else goes to the
device as stored (FP8 + e8m0 scales, packed MXFP4 experts): kernels dequantize, loading never does.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from megagraph.graph.ir import Graph
from megagraph.graph.registry import get_op
from megagraph.models.checkpoint import WeightSpec, bytes_needed, open_checkpoint, random_weights
from megagraph.models.checkpoint.reader import TensorInfo
from megagraph.models.config import ConfigError, ModelConfig
from megagraph.models.session import weight_specs

GiB = 2**30


class FitError(RuntimeError):
    """The model does not fit the device; the message says what is needed and what would fit."""


def graph_weight_specs(graphs: list[Graph]) -> list[WeightSpec]:
    """Every weight the graphs read, once, in first-use order."""
    seen: dict[str, WeightSpec] = {}
    for g in graphs:
        for s in weight_specs(g):
            seen.setdefault(s.name, s)
    return list(seen.values())


def host_resident(g: Graph) -> set[str]:
    """Weights whose every reader is an eager break (they stay in host memory)."""
    weights, readers = set(g.weights), {}
    for n in g.nodes:
        for i in n.inputs:
            if i in weights:
                readers.setdefault(i, []).append(n.op)
    return {w for w, ops in readers.items() if all(get_op(op).is_break for op in ops)}


@dataclass(frozen=True)
class MemoryNeed:
    """Device bytes a start-up needs, by part."""

    weights: int  # device-resident weights in storage format
    state: int  # state pools (all slots incl. scratch, at capacity)
    graph_pools: int  # captured graphs' intermediates (from the plan)
    per_layer: dict[int, int]  # weight bytes of each layer (for "what fits")

    @property
    def total(self) -> int:
        return self.weights + self.state + self.graph_pools


def memory_need(specs: list[WeightSpec], host: set[str], *, state_bytes: int,
                graph_pools: int) -> MemoryNeed:
    dev = [s for s in specs if s.name not in host]
    per_layer: dict[int, int] = {}
    for s in dev:
        parts = s.name.split(".")
        if parts[0] == "layers" and parts[1].isdigit():
            per_layer[int(parts[1])] = per_layer.get(int(parts[1]), 0) + s.nbytes
    return MemoryNeed(bytes_needed(dev), state_bytes, graph_pools, per_layer)


def check_fit(cfg: ModelConfig, need: MemoryNeed, available: int, where: str) -> None:
    """Raise FitError when `need` exceeds `available` bytes, saying what would fit."""
    if need.total <= available:
        return
    fixed = need.total - sum(need.per_layer.values())
    per_layer = max(need.per_layer.values(), default=0)
    layers = max(0, (available - fixed) // per_layer) if per_layer else 0
    gpus = math.ceil(need.total / max(available, 1))
    raise FitError(
        f"{cfg.name} does not fit {where}: it needs {_size(need.total)} (weights "
        f"{_size(need.weights)} in storage format, state {_size(need.state)}, graph pools "
        f"{_size(need.graph_pools)}) and {_size(available)} is available.\n"
        f"What would fit: a layer slice of at most {min(layers, cfg.num_layers)} of "
        f"{cfg.num_layers} layers ({_size(per_layer)} each; benchmarks/probes/decode_runtime.py builds "
        f"one), fewer slots or a shorter context (state), or about {gpus} GPUs with the experts "
        "split across them (expert parallelism is a later issue).")


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def available_bytes(device: torch.device, budget: int | None = None) -> int:
    """Free device memory (`budget` overrides it, e.g. in tests), host RAM for the CPU."""
    if budget is not None:
        return budget
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_weights(specs: list[WeightSpec], host: set[str], ckpt_dir: str | Path, *,
                 device: torch.device, cfg: ModelConfig, progress: bool = True) -> dict[str, torch.Tensor]:
    """Stream the checkpoint (validated first, by name, shape and dtype) onto the device; map
    host-resident tensors from their shard files without copying.

    The plan's weight dtypes are fixed, so a float stored wider than declared is rounded to the
    declared dtype and E8M0 bytes tagged U8 are read as E8M0 (models/checkpoint/reader.py; the
    check logs one line when it happens)."""
    ckpt_dir = Path(ckpt_dir)
    check_config(cfg, ckpt_dir)
    ck = open_checkpoint(ckpt_dir)
    dev_specs = [s for s in specs if s.name not in host]
    ck.check(specs, warn_unexpected=False)
    out = ck.load(dev_specs, device=device, progress=progress, warn_unexpected=False, note=False)
    for s in specs:
        if s.name in host:
            info = ck.info(s.name) if not s.stacked else None
            same_bytes = info is not None and (info.dtype == s.safetensors_dtype
                                               or (s.dtype == "e8m0" and info.dtype == "U8"))
            out[s.name] = map_tensor(info, s) if same_bytes else \
                ck.load([s], progress=False, warn_unexpected=False, note=False)[s.name]
    return out


def map_tensor(info: TensorInfo, spec: WeightSpec) -> torch.Tensor:
    """A read-only view of one tensor's bytes in its shard (memory-mapped, nothing read yet)."""
    with open(info.file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    start = 8 + header + info.data_offsets[0]
    with warnings.catch_warnings():  # read-only by design: kernels only gather rows from it
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.frombuffer(memoryview(mm)[start:start + info.nbytes], dtype=torch.uint8)
    return flat.view(spec.torch_dtype).view(spec.shape)


def check_config(cfg: ModelConfig, ckpt_dir: Path) -> None:
    """A checkpoint's config.json (if any) must describe the artifacts' model."""
    p = ckpt_dir / "config.json"
    if not p.is_file():
        return
    try:
        theirs = ModelConfig.from_hf(p)
    except (ConfigError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: cannot read the checkpoint's config: {e}") from None
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "n_routed_experts",
              "moe_intermediate_size", "compress_ratios", "engram_layers")
    diff = [f for f in fields if getattr(theirs, f) != getattr(cfg, f)]
    if diff:
        f = diff[0]
        raise ConfigError(f"{p}: checkpoint is for another model: {f} = {getattr(theirs, f)} but the "
                          f"artifacts' model {cfg.name} has {getattr(cfg, f)} (also differ: "
                          f"{', '.join(diff[1:]) or 'nothing else'})")


def seeded_weights(specs: list[WeightSpec], cfg: ModelConfig, *, seed: int,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The tests' random weights (models.checkpoint.random_weights, init_std = d^-1/2)."""
    w = random_weights(specs, seed=seed, init_std=cfg.hidden_size ** -0.5, stacked=True)
    return w if device.type == "cpu" else {k: v.to(device) for k, v in w.items()}


def fast_random_weights(specs: list[WeightSpec], cfg: ModelConfig, *, seed: int,
                        device: torch.device) -> dict[str, torch.Tensor]:
    """Random weights made directly on `device` in the storage formats (for full-width benchmark
    slices, where random_weights' CPU quantization would take minutes): fp8 from N(0, std) rounded,
    fp4x2 random codes with scales that bring them to std, fp8 scales 1, norms ~1. Not bit-equal to
    `seeded_weights`."""
    gen = torch.Generator(device).manual_seed(seed)
    std = cfg.hidden_size ** -0.5
    fp4_scale = 127 + round(math.log2(std / 2.5))  # e2m1 codes average |v| ~ 2.5
    dtypes = {s.name: s.dtype for s in specs}
    out = {}
    for s in specs:
        if s.dtype == "fp8e4m3":
            t = (torch.randn(s.shape, generator=gen, device=device) * std).to(torch.float8_e4m3fn)
        elif s.dtype == "fp4x2":
            t = torch.randint(0, 256, s.shape, generator=gen, device=device, dtype=torch.uint8).view(torch.int8)
        elif s.dtype == "e8m0":
            code = fp4_scale if dtypes.get(s.name[: -len("scale")] + "weight") == "fp4x2" else 127
            t = torch.full(s.shape, code, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
        elif s.torch_dtype.is_floating_point:
            t = torch.randn(s.shape, generator=gen, device=device) * std
            t = (t + 1.0 if s.name.endswith("norm.weight") else t).to(s.torch_dtype)
        elif s.name.endswith("tid2eid"):
            t = torch.rand(s.shape[0], cfg.n_routed_experts, generator=gen, device=device)
            t = t.argsort(dim=1)[:, : s.shape[1]].to(s.torch_dtype)
        else:
            t = torch.randint(0, 16, s.shape, generator=gen, device=device).to(s.torch_dtype)
        out[s.name] = t
    return out
