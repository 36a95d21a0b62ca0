"""Named numerics of a model config: `default` (the config as written) and `reference` (fp32).

`reference` is what a user checking a checkpoint against an fp32 reference wants, spelled once
instead of in YAML: activations and residual streams in f32 (`act_dtype: f32`) and no QAT
fake-quantization of the window / compressed / index-key rows (`quantize_kv: false`), so the KV
caches hold f32 rows. Weights stay as the checkpoint stores them (FP8 / MXFP4 dequantized inside
the GEMMs, in f32). The compiler adds the third piece: no FP8 activation quantization in front of
the GEMMs on profiles with FP8 tensor cores (passes/quantize_epilogues.py skips). The resolved
values land in the artifacts' model.yaml like any other config value, and the manifest's
options record `numerics: reference`.
"""

from __future__ import annotations

from .config import ModelConfig

NUMERICS = ("default", "reference")

#: config values `reference` sets (every numerics knob of ModelConfig)
REFERENCE = {"act_dtype": "f32", "quantize_kv": False}


def with_numerics(cfg: ModelConfig, numerics: str) -> ModelConfig:
    """`cfg` with the named numerics applied; ValueError naming the choices for another name."""
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
    return cfg if numerics == "default" else cfg.replace(**REFERENCE)
