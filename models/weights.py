"""Weight declarations in the storage format the config chooses, named as in the official checkpoint.

`release` format: dense projections are FP8 E4M3 with UE8M0 block scales (`X.weight` + `X.scale`),
experts are packed MXFP4 (`fp4x2`) with per-32 UE8M0 scales, small tensors keep their bf16/f32
dtypes. `dense` format: every matrix is a float tensor in the activation dtype (tiny parity models).
"""

from __future__ import annotations

from dataclasses import dataclass

from megagraph.graph.builder import GraphBuilder
from megagraph.graph.types import T

from .config import ModelConfig


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Weights:
    """Declares weights on a builder; returns (weight, scale, fmt) triples for linear ops."""

    b: GraphBuilder
    cfg: ModelConfig

    @property
    def release(self) -> bool:
        return self.cfg.weight_format == "release"

    @property
    def small_dtype(self) -> str:
        """dtype of norms, embeddings, router weights and other bf16 tensors of the release."""
        return "bf16" if self.release else self.cfg.act_dtype

    def vector(self, name: str, n: int, dtype: str | None = None) -> str:
        return self.b.weight(name, T(dtype or self.small_dtype, n))

    def tensor(self, name: str, *shape, dtype: str | None = None) -> str:
        return self.b.weight(name, T(dtype or self.small_dtype, *shape))

    def fp8(self, prefix: str, out: int, inp: int) -> tuple[str, str | None, str]:
        """A dense projection `prefix.weight` [out, inp] (FP8 block-scaled in release format)."""
        if not self.release:
            return self.b.weight(f"{prefix}.weight", T(self.cfg.act_dtype, out, inp)), None, "dense"
        blk = self.cfg.fp8_block
        w = self.b.weight(f"{prefix}.weight", T("fp8e4m3", out, inp))
        s = self.b.weight(f"{prefix}.scale", T("e8m0", _ceil(out, blk), _ceil(inp, blk)))
        return w, s, "fp8_block"

    def bf16(self, prefix: str, out: int, inp: int) -> tuple[str, None, str]:
        """A projection the release stores in bf16 (compressor, indexer keys, router...)."""
        return self.b.weight(f"{prefix}.weight", T(self.small_dtype, out, inp)), None, "dense"

    def experts(self, prefix: str, n: int, out: int, inp: int) -> tuple[str, str | None]:
        """Stacked expert bank `prefix.*.{name}.weight` [E, out, inp] (MXFP4 in release format)."""
        if not self.release:
            return self.b.weight(f"{prefix}.weight", T(self.cfg.act_dtype, n, out, inp)), None
        w = self.b.weight(f"{prefix}.weight", T("fp4x2", n, out, inp // 2))
        s = self.b.weight(f"{prefix}.scale", T("e8m0", n, out, inp // 32))
        return w, s

    @property
    def expert_fmt(self) -> str:
        return "mxfp4" if self.release else "dense"
