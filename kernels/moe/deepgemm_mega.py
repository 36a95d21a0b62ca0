"""Optional dispatch of the `mega_moe` op to DeepGEMM's MegaMoE (`fp8_fp4_mega_moe`, sm_100).

NOT RUN YET: written on a CPU-only machine without DeepGEMM (the GPU at hand is an H200, sm_90;
the kernel is Blackwell-only). The layout code below is tested on the CPU against its
definitions (tests/kernels/test_deepgemm_mega.py); everything that calls DeepGEMM is unverified.
One file of ~700 lines: the weight / scale layout conversions and the buffer lifecycle of one
external kernel.

Same signature and semantics as kernels/moe/triton.py's `mega_moe` (router, routed experts,
shared expert, combine + mHC expand); returns None wherever this path does not apply, so the
caller (moe.mega_moe) runs its Triton kernels instead. Work split:
  router            ours: moe.route_ids (sqrtsoftplus / bias / top-k / renorm / route_scale, or
                    hash routing), ids i64 + weights f32 copied into the symmetric buffer
                    (MegaMoE takes precomputed top-k ids and weights)
  routed experts    DeepGEMM fp8_fp4_mega_moe: dispatch, L1 (FP8 act x FP4 W1|W3, 1x32 UE8M0),
                    SwiGLU with the clamp, x routing weight, L2, combine -> y [T, d] bf16
  shared expert     ours: moe.shared_expert into slot 1 of y2 [T, 2, d]
  combine + expand  ours: moe.combine(y2, topk=1, shared=True) -> streams'

DeepGEMM interfaces relied on (deepseek-ai/DeepGEMM; kernels.md pins @54e22612, the file index
holds several versions and these parts agree across them):
  deep_gemm/mega/__init__.py: get_symm_buffer_for_mega_moe(group, num_experts,
      num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, ...) -> SymmBuffer with
      views .x (e4m3 [max_tokens, d]), .x_sf (int32 [max_tokens, d/128], K-major, 4 packed UE8M0
      per int), .topk_idx (i64 [max_tokens, k], -1 = none), .topk_weights (f32 [max_tokens, k]),
      .num_max_tokens_per_rank (aligned up by the library);
      transform_weights_for_mega_moe((l1, l1_sf), (l2, l2_sf)): L1 rows interleaved gate/up in
      groups of 8 ("[gate 0..7, up 0..7, gate 8..15, ...] instead of [gate | up]"), weights and
      SFs alike, then both SFs transposed for UTCCP in 4 x 32 row groups
      (_transpose_sf_for_utccp); L2 data unchanged;
      fp8_fp4_mega_moe(y, l1, l2, sym_buffer, ..., activation_clamp=None, fast_math=True),
      num_tokens = y.size(0).
  csrc/apis/mega.hpp: recipe (1, 1, 32); weights packed FP4 torch.int8 (kPackedFP4), K-major,
      contiguous, L1 [E, 2F, d/2], L2 [E, d, F/2]; weight SFs int32 packed UE8M0 checked by
      check_sf_layout(..., gran (1, 32), tma_stride_check) (csrc/utils/layout.hpp: MN-major,
      stride(-1) >= align(MN, 4), group stride = stride(-1) * size(-1)); hidden % 128 and
      intermediate % 128; x_sf K-major.
  deep_gemm/utils/math.py (pack_ue8m0_to_int): the 4 exponent bytes of one int32 are
      consecutive K groups, the first in the low byte; packed FP4 low nibble = even element.
  deep_gemm/include/deep_gemm/impls/sm100_fp8_fp4_mega_moe.cuh (L1 epilogue): gate and up are
      rounded to bf16, then gate <= clamp and -clamp <= up <= clamp (our swiglu_limit), SwiGLU,
      x routing weight, H quantized to E4M3 with per-32 UE8M0 scales for L2.

Numerics (expected, unmeasured): like moe.py's FP8_H variant plus bf16 gate/up rounding: a few
% relative (Frobenius) against kernels.reference_table, not the Triton default's ~3e-3.

Conditions under which this returns None (Triton runs), in the order checked:
  * disabled: MoeConfig.deepgemm_mega "off" (the default: never run on its device); "on" turns
    it on (the plan's kernel deepgemm.fp8_fp4_mega_moe, chosen with compile --allow-unvalidated,
    runs with it on: kernels/moe/deepgemm_entry.py)
  * `unsupported(...)`: routed fmt not "mxfp4" (1x32 E8M0 banks [E, F, d/2], [E, d, F/2]);
    act_fmt not "fp8_1x128" (e4m3 x_q [T, d], f32 power-of-two x_scale [T, d/128]); x not bf16
    (DeepGEMM's y is bf16) or not 2-D; streams not [T, n, d] in f32/bf16/f16; the bank does not
    hold every expert (E != gate_w rows); d or F not a multiple of 128; topk outside
    [1, min(E, 32)]; T == 0 or T > MoeConfig.deepgemm_mega_max_tokens; score_func unknown;
    a shared expert the Triton GEMM cannot take (moe.bank None or stacked)
  * `available(device)` false: not CUDA, compute capability major not 10, deep_gemm not
    importable or without the MegaMoE entry points, torch.distributed / symmetric memory
    missing, no usable 1-rank group (below)
  * the Triton helpers cannot run on these tensors (moe._q_ok)
  * x_scale not all positive powers of two (checked once per configuration, eagerly: DeepGEMM
    reads the exponent byte only; quantize_act's scales always are)
  * this configuration raised at warm-up (DeepGEMM's host checks or JIT): warned once, then
    Triton for that configuration for the rest of the process.

Process group: MegaMoE's buffer belongs to a torch.distributed group and the op here is the
single-rank one (every expert local; the expert-parallel pass splits mega_moe for --ep > 1).
Used, in order: the group given to set_group() (must have 1 rank); else the default group when
torch.distributed is initialized with world size 1. Nothing is created implicitly: with
torch.distributed not initialized the path refuses until the runtime calls
init_single_rank_group() once at start-up (default group: 1 rank, NCCL, in-process HashStore, no
network); with world size > 1 (data parallel, experts replicated) it refuses until each rank
registers a 1-rank group (set_group(dist.new_group([rank])), created collectively).

CUDA graphs: weight conversion and the symmetric buffer are made on first use, which must be
outside capture (a warm-up call; the runtime's capture() does one per bucket, largest first); a
miss during capture raises WarmupRequired. Converted weights are cached per source tensors
(data_ptr, version counter, shape, strides, dtype): an in-place weight update converts again on
the next eager call (graphs captured before it keep the old copy: capture again). L1 is a copy
(W1|W3 interleaved: ~4.5 GB per V4.1 layer), L2's data is a view of W2; clear_cache() drops them.
Buffers are never freed while the process may replay graphs that use them (release_buffers()).
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from megagraph.kernels.moe.config import MoeConfig

# the symmetric buffer's tokens per step by default (MoeConfig.deepgemm_mega_max_tokens)
MAX_TOKENS = MoeConfig.deepgemm_mega_max_tokens
MIN_BUFFER_TOKENS = 128
ENTRY_POINTS = ("get_symm_buffer_for_mega_moe", "transform_weights_for_mega_moe",
                "fp8_fp4_mega_moe")
ARCH_MAJORS = (10,)  # csrc/apis/mega.hpp dispatches arch 10 only (tcgen05 / TMEM / 2-CTA UMMA)
GRAN_K = 32  # one UE8M0 exponent per 32 elements along K (recipe (1, 1, 32))
GATE_UP_GRAN = 8  # L1 rows: [gate 0..7, up 0..7, gate 8..15, up 8..15, ...]
UTCCP_ROWS, UTCCP_LANES = 4, 32  # SF rows transposed in 4 x 32 groups (128 rows)
MAX_TOPK = 32  # the kernel's dispatch warp packs 32 / topk tokens


class WarmupRequired(RuntimeError):
    """A conversion or buffer allocation was needed while a CUDA graph was being captured."""


# ---------------------------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------------------------


def enabled(cfg: MoeConfig | None = None) -> bool:
    """MoeConfig.deepgemm_mega == "on" (registry status "unvalidated": never ran on its device,
    so off unless the plan asks)."""
    return (cfg or MoeConfig()).deepgemm_mega == "on"


_IMPORT_ERROR: list[str] = []


@functools.cache
def _deep_gemm():
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001  (ImportError, or an OSError from its extension)
        _IMPORT_ERROR.append(f"{type(e).__name__}: {e}")
        return None
    return deep_gemm


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing (False where CUDA is absent)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _capability(device, capability) -> tuple[str | None, tuple[int, int] | None]:
    """(refusal, (major, minor)) of a device, a HwProfile-like description (`.arch`, e.g.
    "sm_90") or an explicit capability."""
    arch = getattr(device, "arch", None)
    if isinstance(arch, str):
        if not arch.startswith("sm_"):
            return f"profile arch {arch!r} is not a CUDA device", None
        digits = arch[3:].rstrip("abf")
        if not digits.isdigit() or len(digits) < 2:
            return f"profile arch {arch!r} is not of the form sm_XY", None
        return None, (int(digits[:-1]), int(digits[-1]))
    if device is None:
        device = "cuda" if (capability is not None or torch.cuda.is_available()) else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        return f"not a device: {device!r} ({e})", None
    if dev.type != "cuda":
        return (f"device {dev} is not a CUDA device (DeepGEMM's MegaMoE is an sm_100 CUDA "
                "kernel)"), None
    if capability is not None:
        return None, (int(capability[0]), int(capability[1]))
    if not torch.cuda.is_available():
        return "CUDA is not available (torch build or machine)", None
    try:
        return None, torch.cuda.get_device_capability(dev)
    except Exception as e:  # noqa: BLE001
        return f"cannot query {dev}: {e}", None


def available(device=None, *, capability: tuple[int, int] | None = None) -> tuple[bool, str]:
    """(usable, reason) for DeepGEMM's MegaMoE on `device` (a torch device / string / index, or a
    HwProfile-like object with `.arch`; `capability` describes a device without querying it).
    Checks hardware first, then software, then the process group; never raises."""
    try:
        why, cap = _capability(device, capability)
        if why:
            return False, why
        if cap[0] not in ARCH_MAJORS:
            return False, (f"compute capability {cap[0]}.{cap[1]} (sm_{cap[0]}{cap[1]}): "
                           "fp8_fp4_mega_moe needs sm_100 / sm_103 (tcgen05, TMEM, UTCCP; "
                           "DeepGEMM dispatches arch 10 only); the Triton MegaMoE runs instead")
        dg = _deep_gemm()
        if dg is None:
            err = _IMPORT_ERROR[-1] if _IMPORT_ERROR else "import failed"
            return False, f"deep_gemm is not importable ({err})"
        missing = [n for n in ENTRY_POINTS if not callable(getattr(dg, n, None))]
        if missing:
            return False, (f"deep_gemm {getattr(dg, '__version__', '?')} lacks the MegaMoE entry "
                           f"points {missing}")
        import torch.distributed as dist

        if not dist.is_available():
            return False, "torch.distributed is not available in this torch build"
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return False, f"torch symmetric memory is not importable ({e})"
        group, why = group_status()
        if group is None:
            return False, why
        return True, f"DeepGEMM MegaMoE on sm_{cap[0]}{cap[1]}; {why}"
    except Exception as e:  # noqa: BLE001  (never raise: a reason instead)
        return False, f"availability check failed: {type(e).__name__}: {e}"


_GROUP: list = []  # the group set_group() registered (at most one)


def set_group(group) -> None:
    """Register the 1-rank process group MegaMoE's symmetric buffer belongs to (None: unset)."""
    _GROUP.clear()
    if group is not None:
        if group.size() != 1:
            raise ValueError(f"mega_moe is the single-rank op: the group must have 1 rank, "
                             f"got {group.size()}")
        _GROUP.append(group)


def group_status():
    """(group, how it was chosen) or (None, why there is none); creates nothing."""
    import torch.distributed as dist

    if _GROUP:
        return _GROUP[0], "1-rank group registered with set_group()"
    if not dist.is_available():
        return None, "torch.distributed is not available in this torch build"
    if not dist.is_initialized():
        return None, ("torch.distributed is not initialized: MegaMoE's symmetric buffer needs a "
                      "process group; call deepgemm_mega.init_single_rank_group() once at "
                      "start-up (1 rank, NCCL, in-process HashStore) or set_group(group)")
    ws = dist.get_world_size()
    if ws != 1:
        return None, (f"torch.distributed has {ws} ranks and no 1-rank group was registered: "
                      "mega_moe holds every expert on this rank (the expert-parallel pass splits "
                      "it for --ep > 1); register one per rank with "
                      "set_group(dist.new_group([rank])) (collective, at start-up)")
    return dist.group.WORLD, "the default process group (world size 1)"


def init_single_rank_group(device=None, backend: str | None = None):
    """Create the default process group with one rank over an in-process HashStore (no network,
    no environment variables) unless torch.distributed is initialized already; returns the group
    mega_moe will use. backend: "nccl" for a CUDA device (default), "gloo" otherwise."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("torch.distributed is initialized with more than one rank: "
                               "register a 1-rank group with set_group() instead")
        return dist.group.WORLD
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    kw = {"device_id": dev} if (dev.type == "cuda" and backend == "nccl") else {}
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return dist.group.WORLD


# ---------------------------------------------------------------------------------------------
# layouts (pure torch; the CPU tests check them against their definitions)
# ---------------------------------------------------------------------------------------------


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _bytes(s: Tensor) -> Tensor:
    return s.view(torch.uint8) if s.dtype in (torch.float8_e8m0fnu, torch.int8) else s


def pack_ue8m0(sf: Tensor) -> Tensor:
    """E8M0 exponents (uint8 or float8_e8m0fnu) [..., MN, K/32] -> int32 [..., MN, K/128]: four
    consecutive K groups per int, the first in the low byte (DeepGEMM's pack_ue8m0_to_int).
    Row-major (K-major) result; mn_major() makes the TMA layout."""
    b = _bytes(sf)
    if b.dtype != torch.uint8 or b.shape[-1] % 4:
        raise ValueError(f"need uint8 / e8m0 exponents with K/32 a multiple of 4, got "
                         f"{sf.dtype} {tuple(sf.shape)}")
    dense = torch.empty(b.shape, dtype=torch.uint8, device=b.device)  # stride(-1) == 1
    return dense.copy_(b).view(torch.int32)


def unpack_ue8m0(packed: Tensor) -> Tensor:
    """int32 [..., MN, K/128] (any strides) -> uint8 exponents [..., MN, K/32]."""
    dense = torch.empty(packed.shape, dtype=torch.int32, device=packed.device)  # strides (.., 1)
    return dense.copy_(packed).view(torch.uint8)


def mn_major(t: Tensor) -> Tensor:
    """The same int32 values [..., MN, W] laid out MN-major and TMA-aligned: stride(-2) = 1,
    stride(-1) = align(MN, 4) (16 bytes), groups contiguous (stride(-3) = stride(-1) * W);
    padding rows zero. (get_mn_major_tma_aligned_packed_ue8m0_tensor's layout.)"""
    *lead, mn, w = t.shape
    a = _align(mn, 4)
    buf = torch.zeros(*lead, w, a, dtype=t.dtype, device=t.device)
    buf[..., :mn] = t.transpose(-1, -2)
    return buf[..., :mn].transpose(-1, -2)


def check_sf_layout(sf: Tensor, mn: int, k: int, num_groups: int) -> None:
    """DeepGEMM's check_sf_layout(sf, mn, k, 1, 32, num_groups, tma_stride_check=True, int32)
    (csrc/utils/layout.hpp), raising ValueError."""
    problems = []
    if sf.dtype != torch.int32:
        problems.append(f"dtype {sf.dtype} (int32 needed)")
    if tuple(sf.shape) != (num_groups, mn, -(-k // (GRAN_K * 4))):
        problems.append(f"shape {tuple(sf.shape)} (expected {(num_groups, mn, -(-k // 128))})")
    elif sf.stride(-2) != 1 and mn != 1:
        problems.append(f"not MN-major (strides {sf.stride()})")
    elif sf.stride(-1) < _align(mn, 4) or sf.stride(-1) % 4:
        problems.append(f"stride(-1) {sf.stride(-1)} not TMA-aligned (>= {_align(mn, 4)}, % 4)")
    elif sf.stride(-3) != sf.stride(-1) * sf.size(-1):
        problems.append(f"group stride {sf.stride(-3)} != {sf.stride(-1) * sf.size(-1)}")
    if problems:
        raise ValueError("scale factors not in DeepGEMM's layout: " + "; ".join(problems))


def gate_up_source_rows(n: int, gran: int = GATE_UP_GRAN) -> Tensor:
    """src[r]: the row of [gate | up] (n = 2F rows) that lands at row r of DeepGEMM's interleaved
    L1: r = 2 gran b + gran h + i  <-  h F + gran b + i (h = 0 gate, 1 up)."""
    if n % (2 * gran):
        raise ValueError(f"L1 rows {n} must be a multiple of {2 * gran}")
    r = torch.arange(n)
    b, h, i = r // (2 * gran), (r // gran) % 2, r % gran
    return h * (n // 2) + gran * b + i


def utccp_source_rows(mn: int) -> Tensor:
    """src[r]: the SF row that lands at row r after the UTCCP transpose: within each group of
    128 rows, r = 128 c + 4 i + j  <-  128 c + 32 j + i (i < 32, j < 4)."""
    if mn % (UTCCP_ROWS * UTCCP_LANES):
        raise ValueError(f"SF rows {mn} must be a multiple of {UTCCP_ROWS * UTCCP_LANES}")
    r = torch.arange(mn)
    c, i, j = r // 128, (r % 128) // UTCCP_ROWS, r % UTCCP_ROWS
    return 128 * c + UTCCP_LANES * j + i


def inverse(perm: Tensor) -> Tensor:
    return torch.argsort(perm)


def permute_rows(t: Tensor, src: Tensor) -> Tensor:
    """out[..., r, :] = t[..., src[r], :] with t's memory layout (DeepGEMM's
    `torch.empty_like(t).copy_(...)`)."""
    return torch.empty_like(t).copy_(t.index_select(-2, src.to(t.device)))


def reference_transform(l1: tuple[Tensor, Tensor], l2: tuple[Tensor, Tensor]):
    """A torch port of deep_gemm.transform_weights_for_mega_moe for FP4/FP8 weights: L1 rows (data
    and SF) interleaved gate/up by 8, then L1's and L2's SF rows transposed for UTCCP. Runs where
    deep_gemm is absent (tests); with DeepGEMM the library's function is used (and the GPU test
    compares the two bit for bit)."""
    (w1, s1), (w2, s2) = l1, l2
    src = gate_up_source_rows(w1.shape[-2])
    w1i, s1i = permute_rows(w1, src), permute_rows(s1, src)
    return ((w1i, permute_rows(s1i, utccp_source_rows(s1i.shape[-2]))),
            (w2, permute_rows(s2, utccp_source_rows(s2.shape[-2]))))


def to_deepgemm_inputs(w1: Tensor, s1: Tensor, w3: Tensor, s3: Tensor, w2: Tensor, s2: Tensor):
    """Our MXFP4 banks (packed E2M1 uint8/int8 [E, F, d/2] W1 (gate), W3 (up), [E, d, F/2] W2,
    low nibble first; E8M0 scales [E, rows, cols/32]) -> DeepGEMM's inputs to
    transform_weights_for_mega_moe: ((L1 int8 [E, 2F, d/2] = [W1 | W3] rows, int32 SF
    [E, 2F, d/128]), (L2 int8 [E, d, F/2], int32 SF [E, d, F/128])), SFs packed UE8M0,
    MN-major, TMA-aligned. Same bytes: both formats put the even element in the low nibble
    (sign bit 3, magnitude {0, .5, 1, 1.5, 2, 3, 4, 6}) and E8M0 = UE8M0."""
    E, F, dh = w1.shape
    d = 2 * dh
    if tuple(w3.shape) != (E, F, dh) or tuple(w2.shape) != (E, d, F // 2):
        raise ValueError(f"banks must be W1/W3 [E, F, d/2] and W2 [E, d, F/2], got "
                         f"{tuple(w1.shape)} / {tuple(w3.shape)} / {tuple(w2.shape)}")
    l1 = torch.cat([_bytes(w1), _bytes(w3)], dim=1).view(torch.int8)
    l1_sf = mn_major(pack_ue8m0(torch.cat([_bytes(s1), _bytes(s3)], dim=1)))
    l2 = _bytes(w2).contiguous().view(torch.int8)  # a view of W2 when it is contiguous
    l2_sf = mn_major(pack_ue8m0(s2))
    for sf, mn, k in ((l1_sf, 2 * F, d), (l2_sf, d, F)):
        check_sf_layout(sf, mn, k, E)
    return (l1, l1_sf), (l2, l2_sf)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_mxfp4(packed: Tensor, exps: Tensor) -> Tensor:
    """Straightforward decoder: packed E2M1 [..., N, K/2] (low nibble = even element, bit 3 =
    sign) x 2^(e - 127) per 32 along K (uint8 / e8m0 [..., N, K/32]) -> f32 [..., N, K]."""
    p = _bytes(packed).view(torch.uint8).to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=p.device)
    v = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    e = _bytes(exps).to(torch.float32) - 127.0
    return v * torch.exp2(e).repeat_interleave(GRAN_K, dim=-1)


def decode_transformed(l1: tuple[Tensor, Tensor], l2: tuple[Tensor, Tensor]):
    """DeepGEMM's transformed (L1, L2) -> f32 (W1, W3, W2) by undoing the UTCCP transpose and the
    gate/up interleave (for tests and debugging)."""
    (w1, s1), (w2, s2) = l1, l2
    n = w1.shape[-2]
    back = inverse(gate_up_source_rows(n))
    s1 = permute_rows(permute_rows(s1, inverse(utccp_source_rows(n))), back)
    dense1 = decode_mxfp4(permute_rows(w1, back), unpack_ue8m0(s1))
    s2 = permute_rows(s2, inverse(utccp_source_rows(s2.shape[-2])))
    return dense1[..., : n // 2, :], dense1[..., n // 2:, :], decode_mxfp4(w2, unpack_ue8m0(s2))


def pack_act_scales(x_scale: Tensor) -> Tensor:
    """fp8_1x128 activation scales (f32 powers of two [T, d/128]) -> DeepGEMM's x_sf (int32
    [T, d/128], K-major): each 128-block's exponent repeated for its four 32-groups, so the
    1x32 dequantization equals ours exactly. No host sync (capturable)."""
    e = ((x_scale.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return e.unsqueeze(-1).expand(*e.shape, 4).contiguous().view(torch.int32).squeeze(-1)


def pow2_scales(x_scale: Tensor) -> bool:
    """Whether every scale is a positive normal power of two (what pack_act_scales keeps
    exactly). A host sync."""
    bits = x_scale.float().contiguous().view(torch.int32)
    return bool((((bits & 0x7FFFFF) == 0) & (bits >= 1 << 23)).all())


# ---------------------------------------------------------------------------------------------
# caches (conversion and buffers happen once, never during capture)
# ---------------------------------------------------------------------------------------------

_WEIGHTS: dict[tuple, tuple[tuple, object]] = {}  # source identity -> (versions, converted)
_BUFFERS: dict[tuple, object] = {}
_RETIRED: list = []  # outgrown buffers, kept alive for graphs that may still replay them
_FAILED: dict[tuple, str] = {}  # configuration -> why it runs Triton for the rest of the process
_CHECKED: set[tuple] = set()  # configurations whose activation scales were checked once


def _ident(t: Tensor) -> tuple:
    return (t.device.type, t.device.index, t.data_ptr(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: in-place changes go unseen
        return -1


def _warmup_error(what: str) -> WarmupRequired:
    return WarmupRequired(
        f"deepgemm_mega: {what} is needed during CUDA-graph capture; run the step once eagerly "
        "(a warm-up call with the same weights and at least this many tokens) before capturing")


def converted_weights(w1: Tensor, s1: Tensor, w3: Tensor, s3: Tensor, w2: Tensor, s2: Tensor,
                      *, transform=None):
    """DeepGEMM's transformed (L1, L2) for these banks, converted once and cached by the source
    tensors' (data_ptr, version, shape, strides, dtype). transform: None = the library's
    transform_weights_for_mega_moe where deep_gemm imports, else reference_transform. Raises
    WarmupRequired on a miss during CUDA-graph capture."""
    srcs = (w1, s1, w3, s3, w2, s2)
    key = tuple(_ident(t) for t in srcs)
    ver = tuple(_version(t) for t in srcs)
    hit = _WEIGHTS.get(key)
    if hit is not None and hit[0] == ver:
        return hit[1]
    if _capturing():
        raise _warmup_error("converting the expert weights to DeepGEMM's layout")
    l1, l2 = to_deepgemm_inputs(*srcs)
    dg = _deep_gemm()
    if transform is None:
        transform = dg.transform_weights_for_mega_moe if dg is not None else reference_transform
    out = transform(l1, l2)
    _WEIGHTS[key] = (ver, out)
    return out


def clear_cache() -> None:
    """Drop every converted weight (graphs captured with them must not replay afterwards)."""
    _WEIGHTS.clear()


def _capacity(tokens: int, max_tokens: int = MAX_TOKENS) -> int:
    cap = max(tokens, MIN_BUFFER_TOKENS)
    return max(tokens, min(1 << (cap - 1).bit_length(), max_tokens))


def symm_buffer(group, device: torch.device, num_experts: int, tokens: int, topk: int,
                hidden: int, intermediate: int, max_tokens: int = MAX_TOKENS):
    """The SymmBuffer for this configuration holding at least `tokens` rows (a power of two,
    >= MIN_BUFFER_TOKENS, <= max_tokens), made outside capture (WarmupRequired inside)."""
    key = (device.index, id(group), num_experts, topk, hidden, intermediate)
    buf = _BUFFERS.get(key)
    if buf is not None and buf.num_max_tokens_per_rank >= tokens:
        return buf
    if _capturing():
        raise _warmup_error(f"a MegaMoE symmetric buffer for {tokens} tokens")
    dg = _deep_gemm()
    with torch.cuda.device(device):
        new = dg.get_symm_buffer_for_mega_moe(group, num_experts,
                                              _capacity(tokens, max_tokens), topk,
                                              hidden, intermediate)
    cap = new.num_max_tokens_per_rank
    expect = {"x": (torch.float8_e4m3fn, (cap, hidden)),
              "x_sf": (torch.int32, (cap, hidden // (GRAN_K * 4))),
              "topk_idx": (torch.int64, (cap, topk)), "topk_weights": (torch.float32, (cap, topk))}
    for name, (dt, shape) in expect.items():
        v = getattr(new, name, None)
        if not isinstance(v, Tensor) or v.dtype != dt or tuple(v.shape) != shape:
            got = (v.dtype, tuple(v.shape)) if isinstance(v, Tensor) else type(v).__name__
            raise RuntimeError(f"SymmBuffer.{name}: expected {dt} {shape}, got {got}")
    if buf is not None:
        _RETIRED.append(buf)
    _BUFFERS[key] = new
    return new


def reserve(device, num_experts: int, tokens: int, topk: int, hidden: int,
            intermediate: int) -> None:
    """Allocate the buffer for the largest step up front (start-up, outside capture)."""
    group, why = group_status()
    if group is None:
        raise RuntimeError(why)
    symm_buffer(group, torch.device(device), num_experts, tokens, topk, hidden, intermediate)


def release_buffers() -> None:
    """Free every symmetric buffer (only once no captured graph using them will replay)."""
    for b in [*_BUFFERS.values(), *_RETIRED]:
        destroy = getattr(b, "destroy", None)
        if destroy is not None:
            destroy()
    _BUFFERS.clear()
    _RETIRED.clear()


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------


def _moe():
    from megagraph.kernels.moe import triton as moe

    return moe


def unsupported(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3,
                w3_scale, w2, w2_scale, sw1=None, sw1_scale=None, sw3=None, sw3_scale=None,
                sw2=None, sw2_scale=None, tid2eid=None, token_ids=None, *, topk, route_scale,
                norm_topk=True, score_func="sqrtsoftplus", fmt="dense", shared_fmt="dense",
                swiglu_limit=0.0, act_fmt, kernel_config: MoeConfig | None = None) -> str | None:
    """Why these inputs are outside what this path takes (shapes and formats only; device
    independent), or None."""
    moe = _moe()
    max_tokens = (kernel_config or MoeConfig()).deepgemm_mega_max_tokens
    if fmt != "mxfp4":
        return f"routed experts fmt {fmt!r}: DeepGEMM's MegaMoE takes MXFP4 (fp8xfp4)"
    if act_fmt != "fp8_1x128":
        return f"act_fmt {act_fmt!r}: this path takes fp8_1x128 activations"
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        return f"x must be bf16 [T, d] (DeepGEMM's output is bf16), got {x.dtype} {tuple(x.shape)}"
    T, d = x.shape
    if T == 0:
        return "no tokens"
    if T > max_tokens:
        return f"{T} tokens > MAX_TOKENS {max_tokens} (symmetric buffer size)"
    if (x_q.dtype != torch.float8_e4m3fn or tuple(x_q.shape) != (T, d)
            or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (T, d // 128)
            or d % 128):
        return (f"x_q / x_scale must be e4m3 [T, d] / f32 [T, d/128] with d % 128 == 0, got "
                f"{x_q.dtype} {tuple(x_q.shape)} / {x_scale.dtype} {tuple(x_scale.shape)}")
    if (streams.dim() != 3 or streams.shape[0] != T or streams.shape[2] != d
            or streams.dtype not in moe.RDT):
        return (f"streams must be [T, n, d] in f32/bf16/f16, got {streams.dtype} "
                f"{tuple(streams.shape)}")
    if score_func not in moe.SCORES:
        return f"score_func {score_func!r} unknown to the Triton router"
    banks = [moe.bank(w, s, fmt) for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale))]
    if None in banks or w1.dim() != 3:
        return ("routed weights are not stacked MXFP4 banks (E8M0 [E, rows, cols/32] scales, "
                "cols % 128 == 0)")
    b1, b3, b2 = banks
    if not all(b.bn == 1 and b.bk == GRAN_K for b in banks):
        return "routed scales are not one E8M0 per 32 columns of a row"
    E, F = b1.groups, b1.n
    if (b1.k, b3.k, b3.n, b3.groups, b2.groups, b2.n, b2.k) != (d, d, F, E, E, d, F):
        return (f"bank shapes W1 {tuple(w1.shape)} W3 {tuple(w3.shape)} W2 {tuple(w2.shape)} do "
                f"not fit d = {d}")
    if gate_w.dim() != 2 or gate_w.shape[0] != E or gate_w.shape[1] != d:
        return (f"gate_w {tuple(gate_w.shape)} vs {E} local experts: the bank must hold every "
                "expert (single-rank op)")
    if F % 128:
        return f"intermediate size {F} is not a multiple of 128"
    if not 1 <= topk <= min(E, MAX_TOPK):
        return f"topk {topk} outside [1, min(E, {MAX_TOPK})]"
    if sw1 is not None:
        sb = [moe.bank(w, s, shared_fmt) for w, s in ((sw1, sw1_scale), (sw3, sw3_scale),
                                                      (sw2, sw2_scale))]
        if None in sb or sb[0].groups != 1 or sb[0].k != d or sb[2].n != d:
            return f"shared expert ({shared_fmt}) is not a single bank the Triton GEMM takes"
    return None


def _config(x, w1, topk, group, swiglu_limit, cap) -> tuple:
    return (x.device.index, id(group), w1.shape[0], x.shape[1], w1.shape[1], topk, cap,
            swiglu_limit)


def decline_reason(*args, **kw) -> str | None:
    """Why mega_moe(*args, **kw) would return None here, or None when it runs DeepGEMM."""
    if not enabled(kw.get("kernel_config")):
        return "disabled (moe.deepgemm_mega=on enables this unvalidated path)"
    why = unsupported(*args, **kw)
    if why:
        return why
    x, x_q, x_scale = args[:3]
    ok, why = available(x.device)
    if not ok:
        return why
    if not _moe()._q_ok(x_q, x_scale, kw["act_fmt"]):
        return "the Triton router / shared expert / combine cannot run on these tensors"
    return None


def mega_moe(x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3, w3_scale,
             w2, w2_scale, sw1=None, sw1_scale=None, sw3=None, sw3_scale=None, sw2=None,
             sw2_scale=None, tid2eid=None, token_ids=None, *, topk, route_scale, norm_topk=True,
             score_func="sqrtsoftplus", fmt="dense", shared_fmt="dense", swiglu_limit=0.0,
             act_fmt, kernel_config: MoeConfig | None = None):
    """kernels.fused.reference.mega_moe with the routed experts in DeepGEMM's MegaMoE, or None
    (the caller runs its own kernels): the module doc lists when."""
    args = (x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3, w3_scale,
            w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale, tid2eid, token_ids)
    kw = {"topk": topk, "route_scale": route_scale, "norm_topk": norm_topk,
          "score_func": score_func, "fmt": fmt, "shared_fmt": shared_fmt,
          "swiglu_limit": swiglu_limit, "act_fmt": act_fmt}
    kc = kernel_config or MoeConfig()
    kw["kernel_config"] = kc
    if decline_reason(*args, **kw) is not None:
        return None
    group = group_status()[0]
    cfg = _config(x, w1, topk, group, swiglu_limit,
                  _capacity(x.shape[0], kc.deepgemm_mega_max_tokens))
    if cfg in _FAILED:
        return None
    if _capturing():  # warmed up: any error is real
        return _run(group, *args, **kw)
    if cfg not in _CHECKED:  # once per configuration, eagerly: one host sync
        _CHECKED.add(cfg)
        if not pow2_scales(x_scale):
            _FAILED[cfg] = "x_scale holds values that are not positive powers of two"
            return None
    try:
        return _run(group, *args, **kw)
    except WarmupRequired:
        raise
    except Exception as e:  # noqa: BLE001  (host checks / JIT of an unvalidated kernel)
        _FAILED[cfg] = f"{type(e).__name__}: {e}"
        warnings.warn(f"deepgemm_mega: DeepGEMM MegaMoE failed for {cfg}, the Triton MegaMoE "
                      f"runs instead: {_FAILED[cfg]}", RuntimeWarning, stacklevel=2)
        return None


def _run(group, x, x_q, x_scale, streams, post, comb, gate_w, gate_bias, w1, w1_scale, w3,
         w3_scale, w2, w2_scale, sw1, sw1_scale, sw3, sw3_scale, sw2, sw2_scale, tid2eid,
         token_ids, *, topk, route_scale, norm_topk, score_func, fmt, shared_fmt, swiglu_limit,
         act_fmt, kernel_config: MoeConfig):
    moe = _moe()
    dg = _deep_gemm()
    T, d = x.shape
    E, F = w1.shape[0], w1.shape[1]
    dev = x.device
    l1, l2 = converted_weights(w1, w1_scale, w3, w3_scale, w2, w2_scale)
    buf = symm_buffer(group, dev, E, T, topk, d, F, kernel_config.deepgemm_mega_max_tokens)
    ids, wts = moe.route_ids(x, gate_w, gate_bias, topk=topk, route_scale=route_scale,
                             norm_topk=norm_topk, score_func=score_func, tid2eid=tid2eid,
                             token_ids=token_ids, ids64=True)
    buf.x[:T].copy_(x_q)
    buf.x_sf[:T].copy_(pack_act_scales(x_scale))
    buf.topk_idx[:T].copy_(ids)
    buf.topk_weights[:T].copy_(wts)
    routed = torch.empty(T, d, dtype=torch.bfloat16, device=dev)
    clamp = float(swiglu_limit) if swiglu_limit and swiglu_limit > 0 else None
    dg.fp8_fp4_mega_moe(routed, l1, l2, buf, activation_clamp=clamp,
                        fast_math=kernel_config.deepgemm_mega_fast_math)
    shared = sw1 is not None
    y = torch.empty(T, 1 + int(shared), d, dtype=torch.bfloat16, device=dev)
    y[:, 0].copy_(routed)
    if shared:
        sbanks = [moe.bank(w, s, shared_fmt) for w, s in ((sw1, sw1_scale), (sw3, sw3_scale),
                                                          (sw2, sw2_scale))]
        moe.shared_expert(x_q, x_scale, *sbanks, y[:, 1], swiglu_limit=swiglu_limit,
                          cfg=kernel_config)
    out = torch.empty(streams.shape, dtype=streams.dtype, device=dev)
    sc = streams if streams.stride(-1) == 1 else streams.contiguous()
    return moe.combine(y, out, topk=1, shared=shared, rdt=x.dtype, streams=sc,
                       post=post.float().contiguous(), comb=comb.float().contiguous())


mega_moe.capturable = True

__all__ = ["ARCH_MAJORS", "ENTRY_POINTS", "MAX_TOKENS", "WarmupRequired", "available",
           "check_sf_layout", "clear_cache", "converted_weights", "decline_reason",
           "decode_mxfp4", "decode_transformed", "enabled", "gate_up_source_rows",
           "group_status", "init_single_rank_group", "inverse", "mega_moe", "mn_major",
           "pack_act_scales", "pack_ue8m0", "permute_rows", "pow2_scales", "reference_transform",
           "release_buffers",
           "reserve", "set_group", "symm_buffer", "to_deepgemm_inputs", "unpack_ue8m0",
           "unsupported", "utccp_source_rows"]
