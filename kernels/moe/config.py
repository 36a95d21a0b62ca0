"""The MoE family's configuration (`MoeConfig`) and its dispatcher decision (`choose`).

mega_moe / moe_experts_q run the routed experts as two grouped GEMMs (L1: SwiGLU, L2: down
projection) plus a shared expert; each stage has several kernels, each best in one range of
rows per expert. Every switch, threshold, tile and ring depth of that choice is a field here with
the H200's tuned default (docs/kernels/moe.md has the measurements), and `choose` is the
choice itself as a pure function of the config and the problem's shape: the plan writes its
answer per bucket, and kernels/moe/triton.py walks the same candidate lists at launch.

A candidate list is ordered by preference; at launch the first candidate whose kernel takes the
actual tensors on the actual device runs (`fits`), and a step down the list is logged once per
reason. `choose` answers for the device the profile describes (sm_90 with Gluon, MXFP4 experts
with one E8M0 exponent per 32 columns, E4M3 activations), so its answer is what runs there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megagraph.kernels.gemm.config import Tile, parse_tiles
from megagraph.kernels.kernel_config import KernelConfig, register

# the Gluon kernels' shape conditions that the shape alone decides (module constants of
# gluon_ws / gluon_l2 / gluon_l2_ws; the launch checks the tensors as well)
_WS_BN_WIDE = 128
_L2_BN, _L2_K_STEP = 128, 384


@register
@dataclass(frozen=True)
class MoeConfig(KernelConfig):
    """Every choice of the MoE kernels. Row counts are rows per expert (tokens x topk /
    min(experts, tokens x topk)), the quantity the kernels' ranges are measured in."""

    FAMILY = "moe"
    OPS = ("mega_moe", "moe_experts_q[act_fmt=fp8_1x128]", "moe_experts")

    # -- H format ----------------------------------------------------------------------------
    # H (the L1 output) as E4M3 with per-(row, 128 columns) scales at every size
    fp8_h: bool = False
    # ... at prefill sizes (> wide_l1_min_rows) where the warp-specialized FP8-H kernels run:
    # DeepSeek's own numerics for the down-projection input; 6.74 -> 6.33 ms at 8192 tokens
    fp8_h_prefill: bool = True
    # -- row ranges --------------------------------------------------------------------------
    decode_max_rows: int = 12  # decode kernels up to this many rows per expert
    prefill_min_rows: int = 48  # the Gluon prefill L2 above this
    wide_l1_min_rows: int = 100  # the warp-specialized / wide L1 and FP8 H above this
    cublas_l1_min_rows: int = 100  # the cuBLAS grouped L1 above this (its upcast pays back)
    # -- L1 ----------------------------------------------------------------------------------
    gluon: bool = True  # the Gluon kernels at all (False: Triton moe_gemm everywhere)
    gluon_decode: bool = True  # decode L1: moe_gluon_decode (1.66 -> 1.11 ms at 64 tokens)
    gluon_decode_load: Literal["cp.async", "tma"] = "tma"  # how it streams the weights
    gluon_ws_l1: bool = True  # prefill L1: the warp-specialized moe_gluon_ws
    ws_l1_bn: Literal[64, 128] = 128  # its tile's W1 / W3 columns (128 where inter % 128 == 0)
    ws_rings: tuple[int, int] = (6, 3)  # (raw, upcast) ring depths of the 64-column tile
    ws_wide_rings: tuple[int, int] = (4, 2)  # ... of the 128-column tile (fits 227 KB)
    ws_wide_a_tma: bool = True  # the 128-column tile reads A by TMA (two upcast partitions)
    ws_l1_frames: bool = True  # one exponent frame per weight row over all of K, where exact
    ws_small_tma: bool = True  # moe_gluon_ws's scale boxes by TMA
    gluon_wide_l1: bool = True  # else the decode kernel with wide_bt-token tiles
    wide_bt: int = 64
    cublas_prefill: bool = True  # else the cuBLAS grouped FP8 L1 (experts upcast per call)
    # -- L2 ----------------------------------------------------------------------------------
    gluon_decode_l2: bool = True  # decode L2: moe_gluon_decode_l2
    gluon_decode_l2_load: Literal["cp.async", "tma"] = "cp.async"
    gluon_prefill_l2: bool = True  # prefill L2: moe_gluon_l2 (4.01 vs 5.82 ms for Triton's)
    gluon_prefill_l2_ws: bool = True  # ... as its warp-specialized twin moe_gluon_l2_ws
    ws_l2_rings: Optional[tuple[int, int]] = None  # its (stages, bstages); None: per tile
    ws_l2_bn: Optional[int] = None  # its tile columns; None: 256 where hidden % 256, else 128
    gluon_ws_l2_fp8: bool = True  # FP8 H at prefill: moe_gluon_ws's L1 epilogue + l2_fp8
    # -- shared expert -----------------------------------------------------------------------
    shared_fp8_h: bool = True  # follows the routed H format (both GEMMs on cuBLAS FP8)
    shared_early: bool = True  # on a side stream while the router runs (decode sizes)
    shared_early_max_tokens: int = 256
    shared_mm_out: bool = True  # its bf16 W2 GEMM writes its slot of y directly
    # -- router and data movement -------------------------------------------------------------
    gate_tile: tuple[int, int, int, int] = (128, 64, 4, 3)  # (rows, experts, warps, stages)
    a_prep_triton: bool = True  # the ws L1's A copies as Triton kernels (else torch ops)
    # -- numerics ----------------------------------------------------------------------------
    # the E2M1 -> E4M3 upcast in PTX: "auto" where a one-time bit-exact device check passes
    fp4_asm: Literal["auto", "on", "off"] = "auto"
    # every GEMM on fully dequantized bf16 (fp32 in the interpreter) operands: debugging only
    exact: bool = False
    # -- Triton grouped GEMMs ----------------------------------------------------------------
    # tiles pinned per role (l1, l2, l1_fp8h, l2_fp8h, dense, dense_swiglu): a pinned role runs
    # the Triton GEMM with that tile ("l1:bm=16,bn=64,bk=128,num_warps=4,num_stages=3,par=1")
    tiles: tuple[str, ...] = ()
    # -- DeepGEMM MegaMoE (sm_100) ------------------------------------------------------------
    # "on": DeepGEMM's MegaMoE for the routed experts where it takes the call (never run on its
    # device); the plan's kernel deepgemm.fp8_fp4_mega_moe runs with it on (deepgemm_entry.py)
    deepgemm_mega: Literal["off", "on"] = "off"
    deepgemm_mega_max_tokens: int = 8192  # its symmetric buffer's size per step
    deepgemm_mega_fast_math: bool = True  # DeepGEMM's default

    def __post_init__(self):
        parse_tiles(self.tiles)

    def tile_overrides(self) -> dict[str, Tile]:
        return parse_tiles(self.tiles)

    # -- the decision --------------------------------------------------------------------------
    def fp8_h_auto(self, rows: float) -> bool:
        """FP8 H is tried at this size without a per-call request (fp8_h, or fp8_h_prefill's
        prefill range, where the warp-specialized FP8-H kernels are the candidates)."""
        return self.fp8_h or (self.fp8_h_prefill and rows > self.wide_l1_min_rows)

    def l1_candidates(self, rows: float, fp8_h: bool) -> list[str]:
        """The L1 kernels in order of preference ("triton" last: it takes every call)."""
        pinned = self.tile_overrides()
        out = []
        if fp8_h:
            if (self.gluon and self.gluon_ws_l1 and self.gluon_ws_l2_fp8
                    and rows > self.wide_l1_min_rows and "l1_fp8h" not in pinned):
                out.append("gluon_ws_fp8h")
            return out + ["triton"]
        if "l1" not in pinned:
            if self.gluon and rows > self.wide_l1_min_rows:
                if self.gluon_ws_l1:
                    out.append("gluon_ws")
                if self.gluon_wide_l1:
                    out.append("gluon_decode_wide")
            elif self.gluon and self.gluon_decode and rows <= self.decode_max_rows:
                out.append("gluon_decode")
            if self.cublas_prefill and rows > self.cublas_l1_min_rows:
                out.append("cublas_grouped")
        return out + ["triton"]

    def l2_candidates(self, rows: float, fp8_h: bool) -> list[str]:
        """The L2 kernels in order of preference ("triton" last)."""
        pinned = self.tile_overrides()
        out = []
        if fp8_h:
            if (self.gluon and self.gluon_ws_l2_fp8 and rows > self.wide_l1_min_rows
                    and "l2_fp8h" not in pinned):
                out.append("gluon_l2_fp8")
            return out + ["triton"]
        if self.gluon and "l2" not in pinned:
            if rows > self.prefill_min_rows and self.gluon_prefill_l2:
                if self.gluon_prefill_l2_ws:
                    out.append("gluon_l2_ws")
                out.append("gluon_l2")
            elif rows <= self.decode_max_rows and self.gluon_decode_l2:
                out.append("gluon_decode_l2")
        return out + ["triton"]

    def choose(self, shape: dict[str, int]) -> dict[str, str]:
        """The kernels of each stage for `tokens` tokens routed to `topk` of `experts` experts
        of width `hidden` (d) and `inter` (F): l1, l2, h (fp8 / fp16), shared (the shared
        expert's H format) and shared_overlap (router: the shared expert on a side stream while
        the router runs; none)."""
        t, e, k = (int(shape.get(n, 0)) for n in ("tokens", "experts", "topk"))
        d, f = int(shape.get("hidden", 0)), int(shape.get("inter", 0))
        p = t * k
        rows = p / max(1, min(e, p))
        fp8_h = self.fp8_h_auto(rows)
        l1 = [c for c in self.l1_candidates(rows, fp8_h) if _shape_fits(self, c, d, f)][0]
        l2 = [c for c in self.l2_candidates(rows, fp8_h) if _shape_fits(self, c, d, f)][0]
        if fp8_h and not self.fp8_h and "triton" in (l1, l2):
            fp8_h = False  # the prefill default wants both warp-specialized FP8-H kernels
            l1 = [c for c in self.l1_candidates(rows, False) if _shape_fits(self, c, d, f)][0]
            l2 = [c for c in self.l2_candidates(rows, False) if _shape_fits(self, c, d, f)][0]
        shared_h = "fp8" if self.shared_fp8_h and self.fp8_h_auto(rows) and f % 128 == 0 \
            else "fp16"
        early = self.shared_early and t <= self.shared_early_max_tokens
        if l1 == "gluon_ws" and self.ws_l1_bn == _WS_BN_WIDE and f % _WS_BN_WIDE == 0:
            l1 = "gluon_ws_wide"
        return {"h": "fp8" if fp8_h else "fp16", "l1": l1, "l2": l2, "shared": shared_h,
                "shared_overlap": "router" if early else "none"}


def _shape_fits(cfg: MoeConfig, kernel: str, d: int, f: int) -> bool:
    """The conditions on the expert widths alone (hidden d, inter F) under which `kernel`
    takes a call; 0 for an unknown width passes (the launch checks the tensors)."""
    if not d or not f:
        return True
    if kernel in ("gluon_ws_fp8h", "gluon_l2_fp8"):
        return f % _WS_BN_WIDE == 0
    if kernel in ("gluon_l2", "gluon_l2_ws"):
        return d % _L2_BN == 0 and f % _L2_K_STEP == 0
    return True
