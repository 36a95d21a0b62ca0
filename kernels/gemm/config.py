"""The dense FP8-block GEMM family's configuration (`GemmConfig`) and the launch tile (`Tile`)
that it shares with the MoE family's Triton grouped GEMMs.

Why one object: `linear_q`, `grouped_linear_q` and `swiglu_mlp_q` each pick between DeepGEMM,
cuBLAS's block-scaled FP8 GEMM (kernels/gemm/cublas_fp8.py) and the Triton FP8-block GEMM
from row thresholds and recipe forms; those picks are written here as fields with the H200's
tuned defaults, so the plan records them and the runtime hands the kernels exactly these.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from megagraph.kernels.kernel_config import KernelConfig, KernelConfigError, register

CublasForm = Literal["1x128", "128x128"]


@dataclass(frozen=True)
class Tile:
    """Tile of one Triton GEMM launch (kernels/moe/triton_jit.moe_gemm): rows, columns (per
    weight matrix), K chunk (divides 128 or is 128), warps, software-pipeline stages; par: MXFP4
    K split by column parity (A split in registers instead of interleaving the upcast weights).
    A GEMM that quantizes its output (the FP8-H L1, role "l1_fp8h") needs bn a multiple of 128;
    qsplit = 2 (bn = 128 only) computes those 128 columns as two 64-column K loops in one program
    (the 64-column tile's registers, same numbers). swap (MXFP4 weights, fp8 / fp16 MMA, not
    with qsplit 2): the K loop with the operands
    swapped (C^T = W A^T per chunk), so a 16-row decode tile runs on wgmma m64n16."""

    bm: int
    bn: int
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 3
    par: bool = False
    qsplit: int = 1
    swap: bool = False

    def spec(self, role: str) -> str:
        """This tile as a `tiles` entry of a config ("l1:bm=16,bn=64,...")."""
        vals = ",".join(f"{f.name}={int(getattr(self, f.name))}" for f in dataclasses.fields(self))
        return f"{role}:{vals}"


@functools.cache
def parse_tiles(specs: tuple[str, ...]) -> dict[str, Tile]:
    """A config's `tiles` entries ("role:bm=16,bn=64,bk=128,num_warps=4,num_stages=3,par=1")
    as role -> Tile; bm and bn are required, the other fields keep Tile's defaults. Cached: the
    launcher asks at every launch (do not mutate the answer)."""
    out: dict[str, Tile] = {}
    names = {f.name: f.type for f in dataclasses.fields(Tile)}
    for spec in specs:
        role, colon, body = spec.partition(":")
        if not colon or not role:
            raise KernelConfigError(f"tiles entry {spec!r}: expected role:field=value,...")
        kw = {}
        for item in filter(None, body.split(",")):
            k, eq, v = item.partition("=")
            k = k.strip()
            if not eq or k not in names:
                raise KernelConfigError(f"tiles entry {spec!r}: unknown field {k!r}; "
                                        f"fields: {', '.join(names)}")
            try:
                n = int(v)
            except ValueError as e:
                raise KernelConfigError(f"tiles entry {spec!r}: {k} needs an integer") from e
            kw[k] = bool(n) if names[k] in (bool, "bool") else n
        if "bm" not in kw or "bn" not in kw:
            raise KernelConfigError(f"tiles entry {spec!r}: bm and bn are required")
        out[role.strip()] = Tile(**kw)
    return out


@register
@dataclass(frozen=True)
class GemmConfig(KernelConfig):
    """Every choice of the dense FP8-block GEMMs. Defaults: the H200's tuned values
    (docs/kernels/gemm.md has the measurements behind them)."""

    FAMILY = "gemm"
    OPS = ("linear_q[act_fmt=fp8_1x128]", "grouped_linear_q[act_fmt=fp8_1x128]",
           "swiglu_mlp_q[act_fmt=fp8_1x128]", "linear")

    # DeepGEMM's fp8_gemm_nt first where it imports and the weight blocks are 128 x 128
    deepgemm: bool = True
    # `linear` on dense half-precision weights: cuBLAS's half GEMM with fp32 accumulation
    # (cublas_dense, exact products), else the capturable fp32 GEMM
    cublas_dense: bool = True
    # cuBLAS's block-scaled FP8 GEMM (cublas_fp8) where its device check passes
    cublas_fp8: bool = True
    # the recipe tried first by the device check; 1x128 is 1.5-2x faster at <= 64 rows
    cublas_form: CublasForm = "1x128"
    # the recipe of calls with >= cublas_prefill_rows rows that ask for it (the shared expert);
    # "": cublas_form everywhere. 128x128 is 20-25% faster at >= 1024 rows
    cublas_form_prefill: Literal["", "1x128", "128x128"] = "128x128"
    cublas_prefill_rows: int = 1024
    # linear_q and the shared expert's first GEMM on cuBLAS from this many rows on
    cublas_min_rows: int = 1
    # grouped_linear_q as one cuBLAS GEMM per group from this many rows on (below: one batched
    # Triton launch beats G small cuBLAS launches)
    cublas_grouped_min_rows: int = 256
    # Triton tiles pinned per role ("dense", "dense_swiglu"): entries "role:bm=..,bn=..,.."
    tiles: tuple[str, ...] = ()
    # the E2M1 -> E4M3 upcast of MXFP4 weights in PTX: "auto" where a one-time bit-exact device
    # check passes (MoeConfig.fp4_asm's twin for dense MXFP4 weights)
    fp4_asm: Literal["auto", "on", "off"] = "auto"
    # the Triton GEMM on fully dequantized operands (bf16; fp32 in the interpreter): debugging
    exact: bool = False

    def __post_init__(self):
        parse_tiles(self.tiles)

    def tile_overrides(self) -> dict[str, Tile]:
        return parse_tiles(self.tiles)

    def prefill_form(self, rows: int) -> str | None:
        """cublas_form_prefill for calls of >= cublas_prefill_rows rows, else None (the
        device's default form)."""
        return (self.cublas_form_prefill or None) if rows >= self.cublas_prefill_rows else None

    def choose(self, shape: dict[str, int]) -> dict[str, str]:
        """Which GEMM runs for `tokens` rows of FP8-block weights on a device where cuBLAS's
        check passed (DeepGEMM, where it imports, takes 128 x 128-block weights first):
        linear (linear_q, the shared expert's L1), grouped (grouped_linear_q), and the recipe."""
        t = int(shape.get("tokens", 0))
        cub = self.cublas_fp8
        out = {"linear": "cublas_fp8" if cub and t >= self.cublas_min_rows else "triton",
               "grouped": ("cublas_fp8" if cub and t >= self.cublas_grouped_min_rows
                           else "triton")}
        if cub:
            out["form"] = self.prefill_form(t) or self.cublas_form
        return out
