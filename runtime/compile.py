"""torch.compile around segments, the on-disk compile caches, and the start-up timing report.

Caches live in one directory per (artifacts, torch version, device, backend): `$MEGAGRAPH_CACHE`
if set, else `<artifacts>/.cache/`, else `~/.cache/megagraph/`. Inductor's own caches (FX graph
cache, generated kernels, Triton binaries) are pointed there before the first compile, and the
portable "mega-cache" (torch.compiler.save_cache_artifacts) is saved there after start-up and
loaded at the next one. `startup.json` keeps the previous start's timings, so a second start says
how much faster it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

BACKENDS = ("none", "eager", "aot_eager", "inductor")  # aot_eager: debugging (no Inductor code)
MEGACACHE = "torch_compile_cache.bin"


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown compile backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


NUMERICS = ("eager", "fast")


def check_numerics(name: str) -> str:
    if name not in NUMERICS:
        raise ValueError(f"unknown compile numerics {name!r}; choose one of {', '.join(NUMERICS)}")
    return name


def numerics_options(backend: str, numerics: str) -> dict[str, bool]:
    """Inductor options for `numerics`: "eager" asks for eager's rounding where this torch has the
    knobs: fp32 division correctly rounded (Inductor's Triton `/` is div.full, approximate, on
    CUDA: the source of the 1e-7 differences in the mHC normalizations that FP8 activation
    rounding then amplifies, docs/compile.md) and bf16 intermediates rounded as eager rounds them;
    "fast" is Inductor's own defaults. The division knob is spelled
    `eager_numerics.division_rounding` in newer torch, `emulate_divison_rounding` in older."""
    check_numerics(numerics)
    if backend != "inductor" or numerics == "fast":
        return {}
    cfg = torch._inductor.config
    out = {}
    if hasattr(getattr(cfg, "eager_numerics", None), "division_rounding"):
        out["eager_numerics.division_rounding"] = True
    elif hasattr(cfg, "emulate_divison_rounding"):
        out["emulate_divison_rounding"] = True
    if hasattr(cfg, "emulate_precision_casts"):
        out["emulate_precision_casts"] = True
    return out


def cache_dir(artifacts: Path | None, key: str) -> Path:
    """Where this start's compile caches go (created)."""
    from megagraph.configs.process import cache_root

    root = cache_root()
    if root:
        base = Path(root)
    elif artifacts is not None and os.access(artifacts, os.W_OK):
        base = artifacts / ".cache"
    else:
        base = Path.home() / ".cache" / "megagraph"
    d = base / key
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_key(plan_id: str, device: torch.device, backend: str, numerics: str = "eager") -> str:
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = f"{plan_id}|torch {torch.__version__}|{dev}|{backend}|{numerics}"
    return f"{backend}-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def point_caches(d: Path) -> None:
    """Inductor and Triton write their caches under `d` (set before the first compile)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(d / "triton")
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")


def load_megacache(d: Path) -> bool:
    p = d / MEGACACHE
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if not p.is_file() or load is None:
        return False
    try:
        load(p.read_bytes())
        return True
    except Exception:  # a cache from another torch build is simply not used
        return False


def save_megacache(d: Path) -> int:
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    if save is None:
        return 0
    res = save()
    if not res:
        return 0
    data = res[0]
    (d / MEGACACHE).write_bytes(data)
    return len(data)


def wrap(program, backend: str, num_shapes: int, dynamic: bool = False,
         opaque: set[str] = frozenset(), e8m0_as_bytes: bool = True,
         numerics: str = "eager") -> Callable:
    """`program` (a segments.Program) compiled with `backend`: one specialization per bucket, or
    with `dynamic` one compile for every bucket (sizes 0 and 1 still specialize).

    NOTE: Inductor cannot generate code that takes float8_e8m0fnu buffers, so e8m0 scale weights
    enter the compiled program as their uint8 bytes (the kernels' e8m0 decoding accepts both).
    `opaque` nodes are not traced: Dynamo calls them as they are (a graph break around each):
    library kernels (Triton, DeepGEMM), since Inductor re-compiling user Triton kernels fails on
    them, and the capturable tile-loop kernels (kernels/capturable TILE_LOOP_OPS) unless the engine
    is told to trace them. `numerics`: numerics_options."""
    e8m0 = {k: v.view(torch.uint8) for k, v in program.weights.items()
            if e8m0_as_bytes and v.dtype == torch.float8_e8m0fnu}
    fn = program.with_weights(e8m0) if e8m0 else program
    if opaque & {c.outputs[0] for c in program.calls}:
        fn = fn.with_wrapped(set(opaque), torch.compiler.disable)
    # Dynamo's recompile limits count per code object over the whole process: every engine
    # started in it compiles shared frames (rms_norm, Program.__call__) again for its own shapes,
    # and a frame past the limit silently runs uncompiled (the H200 benchmark of several engines
    # per process hit it). Each wrap therefore adds its own allowance.
    cfg = torch._dynamo.config
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, getattr(cfg, knob) + 4 * num_shapes + 8)
    options = numerics_options(backend, numerics)
    return torch.compile(fn, backend=backend, dynamic=dynamic, options=options or None)


def cache_counters() -> dict[str, int]:
    """Inductor FX-graph cache hits/misses so far in this process."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {"fxgraph_cache_hit": int(c.get("fxgraph_cache_hit", 0)),
            "fxgraph_cache_miss": int(c.get("fxgraph_cache_miss", 0))}


@dataclass
class StartupReport:
    """Where start-up time went, what was cached, and how the previous start compares."""

    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    compile_backend: str = "none"
    compile_options: dict[str, bool] = field(default_factory=dict)  # Inductor numerics options
    cache_dir: str | None = None
    megacache_loaded: bool = False
    cache: dict[str, int] = field(default_factory=dict)  # fxgraph hits/misses
    previous_total: float | None = None  # last start's total seconds (same cache dir)
    captured_segments: list[int] = field(default_factory=list)
    eager_segments: dict[int, str] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=list)
    graph_memory_bytes: int = 0
    kernel_fallbacks: dict[str, str] = field(default_factory=dict)
    kernel_configs: dict[str, str] = field(default_factory=dict)  # family -> its bound fields
    weights: str = ""  # where the weights came from
    hardware: str = ""  # artifacts' profile vs this device
    token_map: str = ""  # where the Engram token map came from (V4.1; runtime/token_map.py)
    prefix_cache: str = ""  # the serving prefix cache's budget and mode (runtime/prefix_cache.py)

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def timed(self, phase: str):
        report = self

        class _T:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                report.phases[phase] = report.phases.get(phase, 0.0) + time.perf_counter() - self.t

        return _T()

    def remember(self) -> None:
        """Record this start in the cache dir; read the previous one first."""
        if not self.cache_dir:
            return
        p = Path(self.cache_dir) / "startup.json"
        if p.is_file():
            try:
                self.previous_total = json.loads(p.read_text())["total"]
            except (ValueError, KeyError):
                self.previous_total = None
        p.write_text(json.dumps({"total": self.total, "phases": self.phases}, indent=1))

    def lines(self) -> list[str]:
        out = [f"start-up {self.total:.2f}s: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items()),
               f"{self.hardware}; weights: {self.weights}"]
        if self.token_map:
            out.append(f"engram token map: {self.token_map}")
        if self.prefix_cache:
            out.append(self.prefix_cache if self.prefix_cache.startswith("prefix cache")
                       else f"prefix cache: {self.prefix_cache}")
        if self.kernel_fallbacks:
            out.append("kernel fallbacks: " + "; ".join(f"{k}: {v}" for k, v in self.kernel_fallbacks.items()))
        for fam, fields_ in sorted(self.kernel_configs.items()):
            out.append(f"kernel config {fam}: {fields_}")
        if self.buckets:
            out.append(f"buckets {self.buckets}; captured segments {self.captured_segments or 'none'}; "
                       f"graph memory {self.graph_memory_bytes / 2**20:.1f} MiB")
        for k, why in sorted(self.eager_segments.items()):
            out.append(f"segment {k} runs eagerly: {why}")
        if self.compile_backend != "none":
            opts = ", ".join(self.compile_options) or "Inductor's defaults"
            out.append(f"torch.compile backend {self.compile_backend} (numerics: {opts}; not "
                       f"bitwise the uncompiled engine: docs/compile.md); caches in {self.cache_dir} "
                       f"(inductor/, triton/, {MEGACACHE}); mega-cache "
                       f"{'loaded' if self.megacache_loaded else 'not found'}; FX graph cache "
                       f"{self.cache.get('fxgraph_cache_hit', 0)} hit(s), "
                       f"{self.cache.get('fxgraph_cache_miss', 0)} miss(es)")
        if self.previous_total is not None:
            out.append(f"previous start with these caches took {self.previous_total:.2f}s; this one "
                       f"{self.total:.2f}s ({self.previous_total / max(self.total, 1e-9):.1f}x)")
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}
