"""ModelConfig: the validated, frozen description of a V4 / V4.1 model.

One adapter maps our YAML (configs/models/*.yaml, our field names) or a checkpoint's HF
`config.json` (V4 flat, V4.1 nested under `text_config`) onto these fields; nothing downstream
reads raw HF keys. Every error names the file and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import yaml

FAMILIES = ("v4", "v4.1")
WEIGHT_FORMATS = ("release", "dense")  # release: FP8 block dense + MXFP4 experts; dense: float
INDEX_KEY_READINGS = ("owner", "vendor")  # models/index_keys.py
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A bad model/hardware config; the message names the file and the field."""


@dataclass(frozen=True)
class ModelConfig:
    name: str  # e.g. "v4.1-flash"
    family: str  # "v4" or "v4.1"
    vocab_size: int
    hidden_size: int  # d
    num_layers: int
    num_heads: int  # query heads H
    head_dim: int  # D = 512 (one shared latent, K = V)
    rope_head_dim: int  # last channels of each head carrying RoPE
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    experts_per_token: int
    sliding_window: int  # W
    compress_ratios: tuple[int, ...]  # per backbone layer (0 = window only)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-6
    swiglu_limit: float = 10.0
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    norm_topk: bool = True
    rope_theta: float = 10000.0  # ratio-0 layers (no YaRN)
    compress_rope_theta: float = 160000.0  # ratio != 0 layers (with YaRN)
    yarn_factor: float = 16.0
    yarn_original: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    num_hash_layers: int = 0  # V4: layers 0..n-1 are hash-routed
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # V4.1 CSA2 sharing
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    candidate_source_layer: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # Engram (V4.1)
    engram_layers: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram: int = 4
    engram_vocab_size: int = 16000000  # prime search start + 1
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # draft stages (V4.1 DSpark / V4 MTP)
    num_mtp_layers: int = 0
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layers: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_experts_per_token: int = 0
    # storage and numerics
    weight_format: str = "release"
    fp8_block: int = 32  # V4.1: 32x32 weight blocks, V4: 128x128
    act_dtype: str = "bf16"  # residual/activation dtype of the reference ("f32" for parity tests)
    quantize_kv: bool = True  # QAT fake-quant of window/compressed/index rows (vendor numerics)
    # which index keys a V4.1 indexer scores against on decode rows (models/index_keys.py,
    # docs/index-key-reading.md): "owner" (its own KV owner's; decode == prefill) or "vendor"
    # (the last published cache, as DeepSeek's inference/model.py does)
    index_key_reading: str = "owner"
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    source: str = field(default="", compare=False)  # file it was read from (for errors)

    # -- derived -----------------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.family == "v4.1"

    def config_hash(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("source")
        return "sha256:" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def replace(self, **changes) -> "ModelConfig":
        return validate(dataclasses.replace(self, **changes))

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> "ModelConfig":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {unknown}")
        kwargs = {}
        for k, v in d.items():
            kwargs[k] = _coerce(k, v, known[k].type, source)
        missing = [f.name for f in fields(cls) if f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {missing}")
        kwargs["source"] = source
        return validate(cls(**kwargs))

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        d = _parse(path, yaml.safe_load, yaml.YAMLError, "YAML")
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a mapping of fields, got {type(d).__name__}")
        return cls.from_dict(d, str(path))

    @classmethod
    def from_hf(cls, path: str | Path, **overrides) -> "ModelConfig":
        from .hf_config import hf_to_fields

        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        raw = _parse(path, json.loads, json.JSONDecodeError, "JSON")
        d = hf_to_fields(raw, str(path))
        d.update(overrides)
        return cls.from_dict(d, str(path))


def _parse(path: Path, loads: Callable[[str], Any], error: type[Exception], kind: str) -> Any:
    """`loads` of the text at `path`, a ConfigError naming the file where it cannot be read or
    is not well-formed `kind`."""
    try:
        return loads(path.read_text())
    except error as e:
        raise ConfigError(f"{path}: malformed {kind}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None


def _coerce(key: str, v: Any, typ: Any, source: str) -> Any:
    t = str(typ)
    where = f"{source}: field {key!r}"
    if t.startswith("tuple"):
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ConfigError(f"{where} must be a list of ints, got {v!r}")
        return tuple(v)
    if t in ("int", "int | None"):
        if v is None and "None" in t:
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{where} must be an int, got {v!r}")
        return v
    if t == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"{where} must be a number, got {v!r}")
        return float(v)
    if t == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{where} must be true/false, got {v!r}")
        return v
    if t == "str":
        if not isinstance(v, str):
            raise ConfigError(f"{where} must be a string, got {v!r}")
        return v
    return v


def validate(c: ModelConfig) -> ModelConfig:
    """Cross-field checks; each error names the field and what would be valid."""
    src = c.source or "<config>"

    def need(cond: bool, fld: str, msg: str):
        if not cond:
            raise ConfigError(f"{src}: field {fld!r}: {msg}")

    need(c.family in FAMILIES, "family", f"must be one of {FAMILIES}, got {c.family!r}")
    need(c.weight_format in WEIGHT_FORMATS, "weight_format", f"must be one of {WEIGHT_FORMATS}")
    need(c.act_dtype in ("bf16", "f32"), "act_dtype", "must be bf16 or f32")
    need(c.index_key_reading in INDEX_KEY_READINGS, "index_key_reading",
         f"must be one of {INDEX_KEY_READINGS}, got {c.index_key_reading!r}")
    for fld in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
                "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts",
                "experts_per_token", "sliding_window", "index_n_heads", "index_head_dim", "index_topk"):
        need(getattr(c, fld) > 0, fld, f"must be positive, got {getattr(c, fld)}")
    need(len(c.compress_ratios) == c.num_layers, "compress_ratios",
         f"needs one entry per layer ({c.num_layers}), got {len(c.compress_ratios)}")
    allowed = {0, 1, 2} if c.is_v41 else {0, 4, 128}
    bad = sorted(set(c.compress_ratios) - allowed)
    need(not bad, "compress_ratios", f"unknown layer type(s) {bad} for family {c.family}; allowed {sorted(allowed)}")
    need(c.rope_head_dim % 2 == 0 and c.rope_head_dim <= c.head_dim, "rope_head_dim", "must be even and <= head_dim")
    need(c.num_heads % c.o_groups == 0, "o_groups", f"must divide num_heads ({c.num_heads})")
    need(c.experts_per_token <= c.n_routed_experts, "experts_per_token", "must be <= n_routed_experts")
    need(c.num_hash_layers <= c.num_layers, "num_hash_layers", "must be <= num_layers")
    need(c.hc_mult >= 1, "hc_mult", "must be >= 1")
    need(c.fp8_block in (32, 64, 128), "fp8_block", f"must be 32, 64 or 128, got {c.fp8_block}")
    if c.is_v41:
        for i in c.kv_source_layers + c.index_source_layers + c.engram_layers:
            need(0 <= i < c.num_layers, "kv_source_layers/index_source_layers/engram_layers",
                 f"layer {i} out of range 0..{c.num_layers - 1}")
        for i, r in enumerate(c.compress_ratios):
            if r:
                owners = [s for s in c.kv_source_layers if s <= i and c.compress_ratios[s] == r]
                need(bool(owners), "kv_source_layers", f"layer {i} (ratio {r}) has no KV-source layer "
                     "of the same ratio at or before it")
                idx = [s for s in c.index_source_layers if s <= i and c.compress_ratios[s] == r]
                need(bool(idx), "index_source_layers", f"layer {i} (ratio {r}) has no index-source "
                     "layer of the same ratio at or before it")
        for s in c.kv_source_layers:
            need(c.compress_ratios[s] > 0, "kv_source_layers", f"layer {s} has ratio 0")
        need(set(c.kv_source_layers) <= set(c.index_source_layers), "index_source_layers",
             "every KV-source layer must also be an index source")
        need(len(c.engram_num_embeddings) == len(c.engram_layers), "engram_num_embeddings",
             "needs one row count per Engram layer")
        need(c.engram_head_dim % 32 == 0, "engram_head_dim", "must be a multiple of 32 (row scales)")
        if c.candidate_source_layer is not None:
            need(c.candidate_source_layer in c.index_source_layers, "candidate_source_layer",
                 "must be an index-source layer")
        need(c.num_hash_layers == 0, "num_hash_layers", "V4.1 has no hash-routed layers")
    else:
        need(not c.kv_source_layers and not c.engram_layers, "kv_source_layers/engram_layers",
             "are V4.1 features; family v4 has none")
    if c.index_key_reading == "vendor":
        from .index_keys import vendor_reads

        vendor_reads(c)  # raises a ConfigError for a layout it is not defined on
    return c


def known_models() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yaml"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A shipped model by name (`v4.1-flash`), a YAML path, or a checkpoint dir / config.json."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return ModelConfig.from_yaml(p)
    if p.is_dir() or p.name == "config.json":
        return ModelConfig.from_hf(p)
    shipped = CONFIG_DIR / "models" / f"{name_or_path}.yaml"
    if shipped.exists():
        return ModelConfig.from_yaml(shipped)
    raise ConfigError(f"unknown model {str(name_or_path)!r}; known: {', '.join(known_models())} "
                      "(or pass a .yaml file, a checkpoint dir or its config.json)")
