"""HwProfile: what one GPU (or the CPU reference) offers the compiler, read from configs/hw/*.yaml.

Passes ask a profile questions (`has_format("mxfp8")`, `fusion("mega_moe")`, `buckets()`); they
never test a hardware name. Every error names the file and the field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import yaml

from megagraph.models.config import CONFIG_DIR, ConfigError

HW_DIR = CONFIG_DIR / "hw"
NUMBER_FORMATS = ("fp8_e4m3", "mxfp8", "mxfp4", "nvfp4")
KERNEL_LIBRARIES = ("deepgemm", "flashmla", "deepep", "triton")
FUSIONS = ("mega_moe", "mega_mhc", "attn_epilogue", "compressor", "window_copies")


@dataclass(frozen=True)
class HwProfile:
    """One device as the compiler sees it (per GPU; multi-GPU layouts come later)."""

    name: str  # e.g. "gb300"
    description: str
    arch: str  # "sm_90", "sm_100", "sm_103" or "cpu"
    sm_count: int  # streaming multiprocessors (0 for cpu)
    memory_gib: float  # device memory, GiB (0 = not modelled)
    hbm_tbps: float  # memory bandwidth, TB/s
    dense_tflops: tuple[tuple[str, float], ...]  # (dtype, dense TFLOP/s): bf16, fp8, fp4
    formats: tuple[str, ...]  # tensor-core number formats, subset of NUMBER_FORMATS
    kernel_libraries: tuple[str, ...]  # libraries that can exist on this device
    fusions: tuple[tuple[str, str], ...]  # (fusion, how it is implemented here)
    cuda_graphs: bool  # can steps be captured at all
    graph_token_limit: int  # max prefill tokens per GPU in a captured graph (0 = none)
    prefill_buckets: tuple[tuple[int, int, int], ...]  # [first, last, step] runs of token buckets
    decode_buckets: tuple[int, ...]  # captured decode batch sizes (rows)
    replay_row_bucket: int = 128  # bounded-suffix graphs: bucket step in rows
    replay_max_rows: int = 2048  # bounded-suffix graphs: largest bucket
    bounded_replay_default: bool = False  # emit the bounded-replay graphs (and use them for
    #                                       steps above graph_token_limit) unless compile says no
    source: str = field(default="", compare=False)  # file it was read from

    # -- questions passes ask ----------------------------------------------------------------
    def has_format(self, fmt: str) -> bool:
        return fmt in self.formats

    def fusion(self, name: str) -> str | None:
        """How this profile implements a fusion, or None if it does not."""
        return dict(self.fusions).get(name)

    def tflops(self, dtype: str) -> float:
        return dict(self.dense_tflops).get(dtype, 0.0)

    @property
    def is_gpu(self) -> bool:
        return self.arch != "cpu"

    @property
    def capabilities(self) -> frozenset[str]:
        """Everything a kernel may require: arch, arch family, formats, libraries."""
        caps = {self.arch, *self.formats, *self.kernel_libraries}
        if self.arch.startswith("sm_10"):
            caps.add("sm_100f")  # Blackwell family (sm_100, sm_103): DeepGEMM's sm_100f build
        if self.cuda_graphs:
            caps.add("cuda")
        return frozenset(caps)

    def prefill_token_buckets(self) -> list[int]:
        """Captured prefill token counts, ascending, none above graph_token_limit."""
        out = set()
        for first, last, step in self.prefill_buckets:
            out.update(range(first, last + 1, step))
        return sorted(b for b in out if b <= self.graph_token_limit)

    def replay_buckets(self) -> list[int]:
        if not self.cuda_graphs:
            return []
        return list(range(self.replay_row_bucket, self.replay_max_rows + 1, self.replay_row_bucket))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("source")
        d["dense_tflops"] = dict(self.dense_tflops)
        d["fusions"] = dict(self.fusions)
        for k in ("formats", "kernel_libraries", "decode_buckets"):
            d[k] = list(d[k])
        d["prefill_buckets"] = [list(r) for r in self.prefill_buckets]
        return d

    def profile_hash(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def known_hw() -> list[str]:
    return sorted(p.stem for p in HW_DIR.glob("*.yaml"))


def load_hw_profile(name_or_path: str | Path) -> HwProfile:
    """A shipped profile by name (`gb300`) or a YAML path."""
    p = Path(name_or_path)
    if not (p.suffix in (".yaml", ".yml") and p.exists()):
        p = HW_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            raise ConfigError(f"unknown hardware {str(name_or_path)!r}; known: {', '.join(known_hw())} "
                              "(or pass a .yaml file)")
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: malformed YAML: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: expected a mapping of fields, got {type(d).__name__}")
    return _from_dict(d, str(p))


def _from_dict(d: dict, src: str) -> HwProfile:
    known = {f.name for f in fields(HwProfile)} - {"source"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"{src}: unknown field(s) {unknown}; known: {sorted(known)}")
    required = [f.name for f in fields(HwProfile) if f.default is MISSING]
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"{src}: missing field(s) {missing}")

    def need(cond: bool, fld: str, msg: str):
        if not cond:
            raise ConfigError(f"{src}: field {fld!r}: {msg}")

    for fld in ("formats", "kernel_libraries"):
        need(isinstance(d[fld], list), fld, "must be a list")
    bad = sorted(set(d["formats"]) - set(NUMBER_FORMATS))
    need(not bad, "formats", f"unknown format(s) {bad}; known: {list(NUMBER_FORMATS)}")
    bad = sorted(set(d["kernel_libraries"]) - set(KERNEL_LIBRARIES))
    need(not bad, "kernel_libraries", f"unknown librar(ies) {bad}; known: {list(KERNEL_LIBRARIES)}")
    need(isinstance(d["fusions"], dict), "fusions", "must be a mapping fusion -> how")
    bad = sorted(set(d["fusions"]) - set(FUSIONS))
    need(not bad, "fusions", f"unknown fusion(s) {bad}; known: {list(FUSIONS)}")
    need(isinstance(d["dense_tflops"], dict), "dense_tflops", "must map dtype -> TFLOP/s")
    need(d["arch"] in ("sm_90", "sm_100", "sm_103", "cpu"), "arch", "must be sm_90, sm_100, sm_103 or cpu")
    runs = d["prefill_buckets"]
    need(isinstance(runs, list) and all(isinstance(r, list) and len(r) == 3 for r in runs),
         "prefill_buckets", "must be a list of [first, last, step]")
    need(isinstance(d["graph_token_limit"], int) and d["graph_token_limit"] >= 0, "graph_token_limit",
         "must be a non-negative int")
    need(isinstance(d.get("bounded_replay_default", False), bool), "bounded_replay_default",
         "must be true or false")
    return HwProfile(
        name=d["name"], description=d["description"], arch=d["arch"], sm_count=int(d["sm_count"]),
        memory_gib=float(d["memory_gib"]), hbm_tbps=float(d["hbm_tbps"]),
        dense_tflops=tuple(sorted((k, float(v)) for k, v in d["dense_tflops"].items())),
        formats=tuple(d["formats"]), kernel_libraries=tuple(d["kernel_libraries"]),
        fusions=tuple(sorted(d["fusions"].items())), cuda_graphs=bool(d["cuda_graphs"]),
        graph_token_limit=d["graph_token_limit"],
        prefill_buckets=tuple(tuple(int(x) for x in r) for r in runs),
        decode_buckets=tuple(int(x) for x in d["decode_buckets"]),
        replay_row_bucket=int(d.get("replay_row_bucket", 128)),
        replay_max_rows=int(d.get("replay_max_rows", 2048)),
        bounded_replay_default=d.get("bounded_replay_default", False), source=src)
