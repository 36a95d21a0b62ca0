"""What the Gluon (Triton 3.6, sm_90) kernels share: the guarded import of the Gluon / Hopper
APIs (cp.async, TMA + mbarrier, wgmma), the capability check, the arithmetic E2M1 -> E4M3
upcast (the L1s), the arithmetic E2M1 -> fp16 upcast (fp16_bits .. fp16x2_regs, halves: the
L2s, the flush bound a constexpr: -5 in the decode L2, -13 in the prefill L2), the prefill
kernels' chunk top (refill_a: cp.async wait, writer-side proxy fence, CTA barrier, next A copy),
the decode kernels' ring refills (issue_chunk, issue_side), the SwiGLU epilogue and the
launchers' common argument checks.

Why one module: the Gluon kernels (decode L1 / L2, the prefill L2s, the warp-specialized L1) are
written against the same Triton 3.6 Gluon API (the H200 image) and must agree on when they may run; a version
gate or capability rule changed in one place and not the other would let one kernel try an API
it was never checked on. The arithmetic upcast is the bit-exact reference both kernels' PTX
upcasts are tested against, and the epilogue is the formula both must match moe_jit with, so
each is one function (a @gluon.jit helper is inlined: the compiled kernels are the same
instructions as with the code written in place - the sm_90 SASS was compared byte for byte).

Importing this module never fails: where Triton is missing, is not 3.6 or lacks a name,
IMPORT_OK is False, the Gluon names are not defined and available() says no.
"""
from __future__ import annotations

import functools

import torch

try:  # Triton 3.6 names; other versions may lack or rename them (available() says no)
    import triton

    # written against Triton 3.6's Gluon (the H200 image): 3.9 removed
    # async_copy_global_to_shared (async_load), so other versions are not assumed to work
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) != (3, 6):
        raise ImportError(f"Gluon API of Triton {triton.__version__} not checked")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as ttgl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    IMPORT_OK = True
except Exception:  # noqa: BLE001  (any import failure: the module still imports)
    IMPORT_OK = False

# what the kernel modules import from here (the Gluon names only where IMPORT_OK): their
# @gluon.jit bodies read them as module globals
__all__ = [
    "IMPORT_OK",
    "TensorDescriptor",
    "async_copy",
    "available",
    "check_l2_pairs",
    "e2m1_e4m3_bits",
    "fence_async_shared",
    "fp16_bits",
    "fp16x2_bits",
    "fp16x2_regs",
    "gluon",
    "halves",
    "issue_chunk",
    "issue_side",
    "program_tile",
    "mbarrier",
    "refill_a",
    "tile_entry",
    "tma",
    "ttgl",
    "warpgroup_mma",
    "warpgroup_mma_wait",
    "wgmma_a",
    "wgmma_acc",
    "wgmma_cols",
    "wgmma_rows",
]


@functools.cache
def _cap_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def available(device: torch.device | None = None) -> bool:
    """Gluon with the Hopper APIs used here imported (Triton 3.6), and a CUDA sm_90 device (the
    kernels are wgmma + cp.async only: no sm_100 / sm_89 build)."""
    if not IMPORT_OK or not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else device
    if dev.type != "cuda":
        return False
    return _cap_ok(dev.index if dev.index is not None else torch.cuda.current_device())


if IMPORT_OK:

    # the swapped decode kernels' wgmma layouts as functions of the token tile BT (the wgmma's
    # n: m64nBTkK, one warpgroup), K = 32 (E4M3, the L1) or 16 (fp16, the L2); at BT = 16 they
    # are the objects the kernels were written with
    @gluon.constexpr_function
    def wgmma_acc(BT, K):
        """The accumulator layout of the m64nBTkK wgmma (one warpgroup of 4 warps)."""
        return ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                           instr_shape=[16, BT, K])

    @gluon.constexpr_function
    def wgmma_a(BT, K, KW):
        """The register A operand (the upcast weights, k_width KW) of that wgmma."""
        return ttgl.DotOperandLayout(operand_index=0, parent=wgmma_acc(BT, K), k_width=KW)

    @gluon.constexpr_function
    def wgmma_rows(BT, K):
        """Per weight row (the accumulator's dim 0): promotion scales, output columns."""
        return ttgl.SliceLayout(1, wgmma_acc(BT, K))

    @gluon.constexpr_function
    def wgmma_cols(BT, K):
        """Per token (dim 1): A scales / pair weights, output rows."""
        return ttgl.SliceLayout(0, wgmma_acc(BT, K))

    @gluon.jit
    def e2m1_e4m3_bits(c, rel):
        """moe_jit.e2m1_e4m3_bits (the arithmetic twin of the PTX upcasts): the E4M3 byte of
        E2M1 code c times 2^rel; rel in [-5, 6] is exact, rel < -5 gives (signed) zero."""
        m = c & 7
        base = ttgl.where(m >= 2, m * 4 + 0x30, m * 0x30) + rel * 8
        base = ttgl.where((m == 0) | (rel < -5), 0, base)
        return base | ((c & 8) << 4)

    @gluon.jit
    def fp16_bits(c, rel, REL_MIN: ttgl.constexpr):
        """fp16 bits (int32) of E2M1 code c (low 4 bits) times 2^rel, elementwise: high byte 0x38
        (0.5) or 0x38 + 2 m (m = 2 .. 7: 1 .. 6) plus 4 rel, sign at bit 15; (signed) zero for
        code 0 or rel < REL_MIN (the flush: -5 in the decode L2's per-chunk frame, -13 in the
        prefill L2's per-row frame). The arithmetic twin of the L2s' PTX table upcast
        (moe_gluon_decode_l2.FP16_TABLE_ASM_TEXT)."""
        m = c & 7
        hb = ttgl.where(m >= 2, 0x38 + 2 * m, 0x38) + 4 * rel
        hb = ttgl.where((m == 0) | (rel < REL_MIN), 0, hb)
        return (hb << 8) | ((c & 8) << 12)

    @gluon.jit
    def fp16x2_bits(w, rel, J: ttgl.constexpr, REL_MIN: ttgl.constexpr):
        """The arithmetic twin of the PTX table upcast's output register J: fp16x2 of byte J of
        the packed word w (low half = its low nibble) at offset rel, elementwise."""
        b = (w >> (8 * J)) & 0xFF
        return fp16_bits(b & 0xF, rel, REL_MIN) | (fp16_bits(b >> 4, rel, REL_MIN) << 16)

    @gluon.jit
    def fp16x2_regs(w, rel, REL_MIN: ttgl.constexpr):
        """All 4 registers of the table upcast of the packed words w (fp16x2 of bytes 0 .. 3) at
        offsets rel (the shape of w), by integer arithmetic: both L2s' USE_ASM = False path."""
        return (fp16x2_bits(w, rel, 0, REL_MIN), fp16x2_bits(w, rel, 1, REL_MIN),
                fp16x2_bits(w, rel, 2, REL_MIN), fp16x2_bits(w, rel, 3, REL_MIN))

    @gluon.jit
    def halves(r):
        """An fp16x2 register tensor (int32) -> [.., 2] int16 (low half, high half)."""
        return ttgl.join(r.to(ttgl.int16), (r >> 16).to(ttgl.int16))

    @gluon.jit
    def refill_a(a_nxt, a_ptrs, a_mask, i, n_k, BK: ttgl.constexpr):
        """The prefill kernels' chunk top (moe_gluon_l2.l2_kernel: one A
        copy group in flight): wait for this thread's cp.async of A[i]; the writer-side proxy
        fence - each thread fences its own completed generic-proxy writes to shared memory (the
        cp.async bytes, and its upcast stores not fenced yet) for the wgmma's async proxy BEFORE
        the CTA barrier the wgmma issuers wait at (CUTLASS's order, the PTX rule; fenced after
        the barrier, a fast warp could issue its wgmma before a slow warp had fenced its part);
        the barrier (Triton 3.6's membar pass adds one more right after the wait, as the next op
        is no barrier: two per chunk); then cp.async of A[i + 1] (clamped to chunk n_k - 1: past
        K it re-copies the last chunk into a stage nobody reads) into a_nxt, committed."""
        async_copy.wait_group(0)
        fence_async_shared()
        ttgl.thread_barrier()
        kn = ttgl.minimum(i + 1, n_k - 1) * BK
        async_copy.async_copy_global_to_shared(a_nxt, a_ptrs + kn, mask=a_mask)
        async_copy.commit_group()

    @gluon.jit
    def issue_chunk(w_dst, e_dst, x_dst, w_ptrs, e_ptrs, x_ptrs, x_mask, c, n_k,
                    BK: ttgl.constexpr):
        """The decode kernels' ring refill: cp.async of K chunk min(c, n_k - 1) (clamped: past
        K it re-reads the last chunk into a stage nobody reads) - the packed MXFP4 rows
        (w_ptrs, byte offset k0 / 2), then issue_side's exponents and activation tile - and
        commit the group."""
        k0 = ttgl.minimum(c, n_k - 1) * BK
        async_copy.async_copy_global_to_shared(w_dst, w_ptrs + k0 // 2)
        issue_side(e_dst, x_dst, e_ptrs, x_ptrs, x_mask, c, n_k, BK)

    @gluon.jit
    def issue_side(e_dst, x_dst, e_ptrs, x_ptrs, x_mask, c, n_k, BK: ttgl.constexpr):
        """cp.async of K chunk min(c, n_k - 1)'s E8M0 exponents (e_ptrs, offset k0 / 32) and
        activation tile (x_ptrs, element offset k0, masked past the tile's rows), committed as
        one group: what the decode kernels stream besides the packed weights (issue_chunk adds
        those by cp.async; the TMA variants move them through an mbarrier instead, so the
        exponents' 4-byte rows - below TMA's 16-byte box - and the gathered activation rows stay
        on cp.async and its group count)."""
        k0 = ttgl.minimum(c, n_k - 1) * BK
        async_copy.async_copy_global_to_shared(e_dst, e_ptrs + k0 // 32)
        async_copy.async_copy_global_to_shared(x_dst, x_ptrs + k0, mask=x_mask)
        async_copy.commit_group()

    @gluon.jit
    def tile_entry(work_ptr, pid, num_n, MT, G, P, BM: ttgl.constexpr):
        """Program pid's row tile in moe.tile_list's device list of BM-row tiles ([total,
        grp[MT], row0[MT], rend[MT]]), num_n column tiles per row tile: (skip, group as int64,
        row0, nrows, pid_n). rend is the END OF THE GROUP, so the tile's rows are row0 ..
        min(rend, row0 + BM, P) - 1 (the decode L1 once took rend - row0 and lost every tile of
        an expert but the last); skip for entries past the list or out of range: the caller
        returns before it forms any pointer. One reader of the list for every Gluon kernel."""
        j = pid // num_n
        total = ttgl.load(work_ptr)
        g32 = ttgl.load(work_ptr + 1 + j)  # j < MT (the grid): inside the list either way
        row0 = ttgl.load(work_ptr + 1 + MT + j)
        rend = ttgl.load(work_ptr + 1 + 2 * MT + j)
        nrows = ttgl.minimum(ttgl.minimum(rend, row0 + BM), P) - row0
        skip = (j >= total) | (g32 < 0) | (g32 >= G) | (row0 < 0) | (nrows <= 0)
        return skip, g32.to(ttgl.int64), row0, nrows, pid % num_n

    @gluon.jit
    def program_tile(work_ptr, N, MT, G, P, BN: ttgl.constexpr, BM: ttgl.constexpr):
        """tile_entry for a kernel of one tile per program: program_id(0)'s row tile of BM rows
        and its block of BN of the N output columns, (skip, group as int64, row0, nrows,
        pid_n); the caller returns on skip before it forms any index or pointer from them."""
        return tile_entry(work_ptr, ttgl.program_id(0), N // BN, MT, G, P, BM)

    @gluon.jit
    def swiglu(gt, up, limit, HAS_LIMIT: ttgl.constexpr):
        """moe_jit.swiglu_act on the fp32 accumulators of W1 (gt) and W3 (up): silu(min(gt,
        limit)) * clamp(up, -limit, limit) (no clamp unless HAS_LIMIT): both kernels' epilogue,
        one formula so their outputs cannot drift apart."""
        if HAS_LIMIT:
            up = ttgl.minimum(ttgl.maximum(up, -limit), limit)
            gt = ttgl.minimum(gt, limit)
        return gt * (1 / (1 + ttgl.exp(-gt))) * up


# ---- the launchers' shared argument checks (plain Python, run before any launch) ---------------


def check_rows(a_scale, a_idx, out, N: int, K: int) -> int:
    """The A scales [T, K / 128] with contiguous rows, out [>= P, N]: P = a_idx.numel() sorted
    rows (the same checks, in the same order, in both launchers)."""
    if a_scale.stride(1) != 1 or a_scale.shape[1] < K // 128:
        raise ValueError("a_scale [T, K / 128] with contiguous rows")
    P = a_idx.numel()
    if out.shape[0] < P or out.shape[1] != N:
        raise ValueError(f"out {tuple(out.shape)} for {P} sorted rows x {N}")
    return P


OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the L2 kernels' y dtypes


def check_l2_pairs(h, counts, c_idx, row_w, out, *, groups: int, N: int, topk: int, ks: int,
                   names: tuple[str, str, str]) -> int:
    """The L2 launchers' checks of the pair arguments (ValueError): counts [E <= groups] int32,
    c_idx int32 [P] with P <= the rows of h, row_w >= P contiguous float pair weights, out one of
    OUT_DTYPES [rows, N] with contiguous rows and a row for every pair's (token, slot); returns
    P. names: what the launcher calls c_idx, row_w and out (its own argument names, so that the
    message names what the caller passed)."""
    idx_name, w_name, out_name = names
    if counts.dtype != torch.int32 or counts.dim() != 1 or counts.numel() > groups:
        raise ValueError("counts: int32, at most one per expert of the bank")
    P = c_idx.numel()
    if c_idx.dtype != torch.int32 or c_idx.dim() != 1 or h.shape[0] < P:
        raise ValueError(f"{idx_name}: int32 [P], P <= the rows of h")
    if row_w.dim() != 1 or row_w.stride(0) != 1 or row_w.numel() < P or \
            not row_w.is_floating_point():
        raise ValueError(f"{w_name}: a contiguous float vector of >= P pair weights")
    if topk < 1 or ks < topk:
        raise ValueError(f"topk {topk}, ks {ks}: need 1 <= topk <= ks")
    if out.dtype not in OUT_DTYPES or out.dim() != 2 or out.shape[1] != N or out.stride(1) != 1:
        raise ValueError(f"{out_name}: fp32 / bf16 / fp16 [rows, {N}] with contiguous rows")
    if P and out.shape[0] <= ((P - 1) // topk) * ks + (P - 1) % topk:
        raise ValueError(f"{out_name} has {out.shape[0]} rows: too few for {P} pairs at ks {ks}")
    return P


def l1_format_problem(name: str, a_q, a_scale, w1, w3) -> str | None:
    """Why a call does not fit the Gluon L1 kernels' formats, or None: MXFP4 banks (E8M0 per 32
    columns) and E4M3 activations with fp8_1x128 scales (the first checks of both L1 launchers,
    moe_gluon_decode and moe_gluon_ws)."""
    if not (w1.wfmt == 0 and w3.wfmt == 0 and w1.bk == 32 and w1.bn == 1 and w3.bk == 32
            and w3.bn == 1):
        return f"{name} takes MXFP4 banks (E8M0 per 32 columns)"
    if a_q.dtype != torch.float8_e4m3fn or a_scale is None:
        return f"{name} takes E4M3 activations with fp8_1x128 scales"
    return None


def l1_bank_problem(w1, w3, counts=None) -> str | None:
    """Why the W1 / W3 banks do not fit the Gluon L1 kernels' copies, or None: the same strides,
    16-byte weight rows and 4-byte exponent rows (the kernels' 16- / 4-byte copies), as many
    experts in both, at least counts' (None: not checked)."""
    if w1.w.stride() != w3.w.stride() or w1.s.stride() != w3.s.stride():
        return "W1 and W3 banks need the same strides"
    if w1.w.stride(1) % 16 or w1.s.stride(1) % 4 or w1.w.data_ptr() % 16 or \
            w3.w.data_ptr() % 16 or w1.s.data_ptr() % 4 or w3.s.data_ptr() % 4:
        return "weight rows must be 16-byte, exponent rows 4-byte aligned"
    if w1.groups != w3.groups or (counts is not None and counts.numel() > w1.groups):
        return "counts has more experts than the banks"
    return None


def tile_list(counts, rows: int, max_tiles: int, tiles):
    """The device tile list of `rows`-row tiles: `tiles` if the caller built it (checked against
    max_tiles), else moe.tile_list(counts, rows, max_tiles) (one tiny launch, no host sync)."""
    from megagraph.kernels.moe import triton as moe

    if tiles is None:
        return moe.tile_list(counts, rows, max_tiles)
    if tiles.numel() != 1 + 3 * max_tiles:
        raise ValueError("tiles was built for another max_tiles")
    return tiles


def load_and_stages(load: str | None, stages: int | None, default_load: str,
                    default_stages: int, loads: tuple[str, ...]) -> tuple[str, int]:
    """A decode launcher's load (default_load when None: the module's LOAD) and TMA ring depth
    (default_stages when None), checked: one of `loads`, stages only with load='tma', at least
    3 (the ring refills the stage of the chunk before). Both decode kernels take the same pair."""
    load = default_load if load is None else load
    if load not in loads:
        raise ValueError(f"load {load!r}: one of {loads}")
    if stages is not None and load != "tma":
        raise ValueError("stages is the TMA ring's depth (load='tma')")
    ns = default_stages if stages is None else int(stages)
    if ns < 3:
        raise ValueError(f"stages {ns}: the TMA ring needs at least 3")
    return load, ns



def token_tile(bt: int | None, default: int, bts: tuple[int, ...]) -> int:
    """A decode launcher's token tile (default when None: the module's decode tile BT),
    checked: one of `bts`, the n its kernels' wgmma is built at (a launch at another n would
    fail in the kernel's static_assert, at compile time on the GPU machine)."""
    bt = default if bt is None else int(bt)
    if bt not in bts:
        raise ValueError(f"bt {bt}: one of {bts}")
    return bt
