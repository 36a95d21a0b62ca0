"""Number formats of the DeepSeek-V4 family checkpoints: E8M0 scales, E2M1 (FP4) codes, FP8 blocks.

Everything here is plain vectorized torch (CPU-friendly, works on any device) and bit-exact where the
format allows it.  Formats (see docs/reference v41-flash-architecture.md section 2.2):

* **E8M0** (``torch.float8_e8m0fnu`` / UE8M0): one byte = biased exponent ``s``; value ``2^(s-127)``.
  ``s = 255`` is NaN, there is no zero.  The smallest value, ``s = 0``, is ``2^-127`` (an f32 subnormal).
* **E2M1** (FP4) nibble codes 0..15: bit 3 = sign, bits 0-2 index ``{0, .5, 1, 1.5, 2, 3, 4, 6}``.
  Packed two per byte (IR dtype ``fp4x2``, stored as int8 "I8"): **low nibble = even column**, high
  nibble = odd column.
* **FP8 block** (dense weights): ``W[o,i] = e4m3(q[o,i]) * 2^(s[o//b, i//b] - 127)``; ``b = 32`` for
  V4.1, ``128`` for V4; the last block row/column may be ragged (``scale = [ceil(O/b), ceil(I/b)]``).
* **MXFP4** (routed experts): ``W[o,i] = e2m1(nib[o,i]) * 2^(s[o, i//32] - 127)``; ``scale [O, I/32]``.
* **FP8 rows** (Engram tables): e4m3 values + one e8m0 scale per 32 columns of each row,
  ``scale [rows, W/32]``.

Quantizers use power-of-two scales ``2^ceil(log2(amax / qmax))`` (``qmax`` = 448 for e4m3, 6 for e2m1),
computed exactly (no log2 rounding issues).  An all-zero block gets scale 1.0 (code 127).

Error bounds of quantize -> dequantize (``s`` the block's scale; ``s < 2*amax/qmax`` by construction),
each tested in tests/kernels/test_formats.py:

* FP8 (e4m3, 3 mantissa bits, RNE, min normal 2^-6, subnormal step 2^-9):
  ``|w - deq(q(w))| <= max(2^-4 * |w|, 2^-10 * s)`` elementwise; hence also
  ``<= 2^-4 * amax_block`` (since ``2^-10 * s < 2^-9 * amax / 448``).
* E2M1 (grid steps .5/.5/.5/.5/1/1/2): ``|w - deq(q(w))| <= max(|w| / 4, s / 4)`` elementwise;
  hence ``<= amax_block / 4``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "E2M1_VALUES",
    "DType",
    "DTYPES",
    "ir_to_torch",
    "ir_to_safetensors",
    "safetensors_to_ir",
    "torch_to_ir",
    "ir_itemsize",
    "e8m0_to_f32",
    "f32_to_e8m0",
    "e2m1_to_f32",
    "f32_to_e2m1_codes",
    "pack_e2m1",
    "unpack_e2m1",
    "infer_block_size",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_mxfp4",
    "unpack_mxfp4",
    "quantize_fp8_rows",
    "dequantize_fp8_rows",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: magnitudes of E2M1 codes 0..7 (codes 8..15 are the negatives)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_LUT = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)

# ----------------------------------------------------------------------------------------------------
# dtype table
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DType:
    """One IR dtype: its torch storage dtype, safetensors header name and bytes per stored element."""

    ir: str
    torch: torch.dtype
    safetensors: str
    itemsize: int
    description: str


DTYPES: dict[str, DType] = {
    d.ir: d
    for d in (
        DType("bf16", torch.bfloat16, "BF16", 2, "bfloat16"),
        DType("f16", torch.float16, "F16", 2, "float16"),
        DType("f32", torch.float32, "F32", 4, "float32"),
        DType("f64", torch.float64, "F64", 8, "float64"),
        DType("fp8e4m3", torch.float8_e4m3fn, "F8_E4M3", 1, "float8 E4M3 (fn), max 448"),
        DType("e8m0", torch.float8_e8m0fnu, "F8_E8M0", 1, "power-of-two scale, biased exponent"),
        DType("fp4x2", torch.int8, "I8", 1, "two packed E2M1 codes per byte, low nibble = even column"),
        DType("i8", torch.int8, "I8", 1, "int8"),
        DType("u8", torch.uint8, "U8", 1, "uint8"),
        DType("i32", torch.int32, "I32", 4, "int32"),
        DType("i64", torch.int64, "I64", 8, "int64"),
        DType("bool", torch.bool, "BOOL", 1, "bool"),
    )
}

# Reverse maps.  int8 / "I8" are ambiguous (i8 or fp4x2): they map to "i8" unless the caller says the
# tensor is packed FP4.
_TORCH_TO_IR = {d.torch: d.ir for d in DTYPES.values() if d.ir != "fp4x2"}
_ST_TO_IR = {d.safetensors: d.ir for d in DTYPES.values() if d.ir != "fp4x2"}


def _dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown IR dtype {name!r}; known: {', '.join(DTYPES)}") from None


def ir_to_torch(name: str) -> torch.dtype:
    """IR dtype name -> torch storage dtype (``fp4x2`` -> ``torch.int8``)."""
    return _dtype(name).torch


def ir_to_safetensors(name: str) -> str:
    """IR dtype name -> safetensors header dtype string (``fp4x2`` -> ``"I8"``)."""
    return _dtype(name).safetensors


def ir_itemsize(name: str) -> int:
    """Bytes per *stored* element (``fp4x2``: 1 byte holding two E2M1 values)."""
    return _dtype(name).itemsize


def safetensors_to_ir(name: str, *, packed_fp4: bool = False) -> str:
    """safetensors header dtype -> IR name. ``"I8"`` is ``i8`` unless ``packed_fp4`` (then ``fp4x2``)."""
    if name == "I8" and packed_fp4:
        return "fp4x2"
    try:
        return _ST_TO_IR[name]
    except KeyError:
        raise ValueError(f"safetensors dtype {name!r} has no IR dtype") from None


def torch_to_ir(dtype: torch.dtype, *, packed_fp4: bool = False) -> str:
    """torch dtype -> IR name. ``torch.int8`` is ``i8`` unless ``packed_fp4`` (then ``fp4x2``)."""
    if dtype == torch.int8 and packed_fp4:
        return "fp4x2"
    try:
        return _TORCH_TO_IR[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no IR dtype") from None


# ----------------------------------------------------------------------------------------------------
# E8M0
# ----------------------------------------------------------------------------------------------------


def _e8m0_bytes(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.float8_e8m0fnu:
        return s.view(torch.uint8)
    if s.dtype == torch.uint8:
        return s
    if s.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        if s.numel() and (int(s.min()) < 0 or int(s.max()) > 255):
            raise ValueError("e8m0 biased exponents must lie in 0..255")
        return s.to(torch.uint8)
    raise TypeError(f"e8m0_to_f32 expects float8_e8m0fnu or uint8 biased exponents, got {s.dtype}")


def e8m0_to_f32(s: torch.Tensor) -> torch.Tensor:
    """E8M0 scale (``float8_e8m0fnu``, or uint8/int biased exponent) -> float32 ``2^(s-127)``.

    Bit-exact: ``s`` in 1..254 becomes the f32 with exponent field ``s``; ``s = 0`` is the subnormal
    ``2^-127``; ``s = 255`` is NaN.
    """
    b = _e8m0_bytes(s).to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def f32_to_e8m0(x: torch.Tensor, *, rounding: str = "ceil") -> torch.Tensor:
    """Positive scale(s) -> ``float8_e8m0fnu``.

    A power of two maps exactly.  Otherwise ``rounding='ceil'`` (default) takes the next power of two
    up (the convention of all quantizers here), ``'floor'`` the one below, ``'exact'`` raises.  Results
    saturate to ``[2^-127, 2^127]``.  Non-positive or non-finite input raises ``ValueError``.
    """
    if rounding not in ("ceil", "floor", "exact"):
        raise ValueError(f"rounding must be 'ceil', 'floor' or 'exact', got {rounding!r}")
    x = x.to(torch.float64) if x.dtype == torch.float64 else x.to(torch.float32)
    if x.numel() and not bool(((x > 0) & torch.isfinite(x)).all()):
        raise ValueError("f32_to_e8m0: scales must be positive and finite")
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    exact = m == 0.5
    if rounding == "exact" and not bool(exact.all()):
        raise ValueError("f32_to_e8m0(rounding='exact'): input is not a power of two")
    exp = e.to(torch.int32) - 1  # floor(log2 x)
    if rounding == "ceil":
        exp = exp + (~exact).to(torch.int32)
    biased = (exp + 127).clamp(0, 254).to(torch.uint8)
    return biased.view(torch.float8_e8m0fnu)


def _pow2_exponent_for(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Exact ``ceil(log2(amax / qmax))`` as int32 (amax > 0), i.e. the smallest ``e`` with
    ``amax <= qmax * 2^e``.  Zero amax -> 0 (scale 1).  Clamped to the e8m0 range [-127, 127]."""
    a = amax.to(torch.float64)
    zero = a == 0
    a = torch.where(zero, torch.full_like(a, qmax), a)
    e = torch.ceil(torch.log2(a / qmax))
    # fix possible off-by-one of log2 rounding: exact comparisons in float64 (qmax * 2^e is exact)
    e = torch.where(a > qmax * torch.exp2(e), e + 1, e)
    e = torch.where(a <= qmax * torch.exp2(e - 1), e - 1, e)
    e = torch.where(zero, torch.zeros_like(e), e)
    return e.clamp(-127, 127).to(torch.int32)


def _exp_to_e8m0(e: torch.Tensor) -> torch.Tensor:
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


# ----------------------------------------------------------------------------------------------------
# E2M1 (FP4)
# ----------------------------------------------------------------------------------------------------


def e2m1_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibble codes (any integer dtype, values 0..15; only the low 4 bits are used) -> float32.

    Code 8 is -0.0.
    """
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"e2m1_to_f32 expects integer codes, got {codes.dtype}")
    idx = (codes.to(torch.int32) & 0xF).long()
    return _E2M1_LUT.to(codes.device)[idx]


def f32_to_e2m1_codes(x: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round to the nearest E2M1 value, returning uint8 codes 0..15.

    ``ties='even'`` (default, IEEE / hardware ``cvt.rn``): a value exactly between two grid points
    takes the one with the even code (mantissa bit 0): 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0,
    2.5->2.0, 3.5->4.0, 5->4.0.  ``ties='away'``: away from zero.  Magnitudes above 6 saturate to 6
    (including inf).  The sign bit follows ``signbit(x)`` (so tiny negatives give code 8 = -0.0).
    NaN gives (+/-) 0.
    """
    if ties not in ("even", "away"):
        raise ValueError(f"ties must be 'even' or 'away', got {ties!r}")
    a = x.abs().to(torch.float32)
    # midpoints between consecutive grid values; the lower code k is even for k = 0, 2, 4, 6
    mids = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for k, m in enumerate(mids):
        up = (a >= m) if (ties == "away" or k % 2 == 1) else (a > m)
        mag += up.to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return mag | sign


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack nibble codes ``[..., I]`` (I even) into int8 ``[..., I/2]``: low nibble = even column."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 0xF
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 ``[..., I/2]`` -> uint8 nibble codes ``[..., I]`` (inverse of :func:`pack_e2m1`)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"unpack_e2m1 expects int8/uint8, got {packed.dtype}")
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------------
# FP8 block (dense weights) and FP8 rows (Engram tables)
# ----------------------------------------------------------------------------------------------------


def _block_dim(n: int, ns: int, preferred: tuple[int, ...] = (32, 128)) -> int:
    """Block size b along one dim with ``ceil(n / b) == ns``.

    Among powers of two the answer is unique whenever ``ns > 1``; when ``ns == 1`` every ``b >= n``
    gives the same mapping, so the choice does not matter.  Preferred sizes are tried first.
    """
    if ns <= 0 or n <= 0:
        if n == 0 and ns == 0:
            return preferred[0]
        raise ValueError(f"cannot infer block size: {n} elements vs {ns} scales")
    for b in preferred:
        if -(-n // b) == ns:
            return b
    b = 1
    while b <= max(n, 1) * 2:
        if -(-n // b) == ns:
            return b
        b *= 2
    raise ValueError(f"cannot infer a power-of-two block size: {n} elements vs {ns} scales")


def infer_block_size(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """Block ``(bo, bi)`` of an FP8-block weight from its shape and its scale's shape (32 or 128 first)."""
    if len(shape) != 2 or len(scale_shape) != 2:
        raise ValueError(f"expected 2-D weight and scale, got {tuple(shape)} and {tuple(scale_shape)}")
    return _block_dim(shape[0], scale_shape[0]), _block_dim(shape[1], scale_shape[1])


def _check_float(w: torch.Tensor, what: str) -> torch.Tensor:
    if not w.dtype.is_floating_point:
        raise TypeError(f"{what} expects a floating tensor, got {w.dtype}")
    w = w.to(torch.float32)
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: input has inf/NaN")
    return w


def quantize_fp8_block(
    w: torch.Tensor, block: int | tuple[int, int] = (32, 32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """f32 ``[O, I]`` -> ``(q float8_e4m3fn [O, I], scale float8_e8m0fnu [ceil(O/bo), ceil(I/bi)])``.

    Per block: ``scale = 2^ceil(log2(amax / 448))`` (all-zero block: 1.0), ``q = rne_e4m3(w / scale)``.
    Ragged edge blocks use the amax of their valid elements.
    """
    bo, bi = (block, block) if isinstance(block, int) else block
    w = _check_float(w, "quantize_fp8_block")
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block expects a 2-D weight, got shape {tuple(w.shape)}")
    O, I = w.shape
    no, ni = -(-O // bo), -(-I // bi)
    wp = torch.nn.functional.pad(w, (0, ni * bi - I, 0, no * bo - O))
    blocks = wp.reshape(no, bo, ni, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    e = _pow2_exponent_for(amax, E4M3_MAX)
    inv = torch.exp2(-e.to(torch.float32))  # exact powers of two (2^127 fits f32)
    q = (blocks * inv[:, None, :, None]).reshape(no * bo, ni * bi)[:O, :I]
    return q.to(torch.float8_e4m3fn), _exp_to_e8m0(e)


def dequantize_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, block: int | tuple[int, int] | None = None
) -> torch.Tensor:
    """``(q e4m3 [..., O, I], scale e8m0 [..., ceil(O/bo), ceil(I/bi)])`` -> f32 ``[..., O, I]``.

    The block size is inferred from the shapes (:func:`infer_block_size`: 32x32 for V4.1, 128x128 for
    V4; ragged edges fine) unless given.  Leading dims (stacked experts) must match.
    """
    if q.dim() < 2 or scale.dim() != q.dim() or q.shape[:-2] != scale.shape[:-2]:
        raise ValueError(f"dequantize_fp8_block: weight {tuple(q.shape)} and scale {tuple(scale.shape)} do not pair")
    O, I = q.shape[-2:]
    if block is None:
        bo, bi = infer_block_size(tuple(q.shape[-2:]), tuple(scale.shape[-2:]))
    else:
        bo, bi = (block, block) if isinstance(block, int) else block
        if tuple(scale.shape[-2:]) != (-(-O // bo), -(-I // bi)):
            raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} / block {(bo, bi)}")
    s = e8m0_to_f32(scale)
    no, ni = s.shape[-2:]
    lead = q.shape[:-2]
    qf = q.to(torch.float32)
    if no * bo != O or ni * bi != I:
        qf = torch.nn.functional.pad(qf, (0, ni * bi - I, 0, no * bo - O))
    out = qf.reshape(*lead, no, bo, ni, bi) * s[..., :, None, :, None]
    return out.reshape(*lead, no * bo, ni * bi)[..., :O, :I].contiguous()


def quantize_fp8_rows(table: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table f32 ``[rows, W]`` -> ``(q e4m3 [rows, W], scale e8m0 [rows, W/block])``."""
    if table.dim() != 2 or table.shape[1] % block:
        raise ValueError(f"quantize_fp8_rows expects [rows, W] with W % {block} == 0, got {tuple(table.shape)}")
    return quantize_fp8_block(table, (1, block))


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(q e4m3 [rows, W], scale e8m0 [rows, W/b])`` -> f32 ``[rows, W]`` (also works on gathered rows)."""
    if q.dim() != 2 or scale.dim() != 2 or q.shape[0] != scale.shape[0] or scale.shape[1] == 0 or q.shape[1] % scale.shape[1]:
        raise ValueError(f"dequantize_fp8_rows: weight {tuple(q.shape)} and scale {tuple(scale.shape)} do not pair")
    return dequantize_fp8_block(q, scale, (1, q.shape[1] // scale.shape[1]))


# ----------------------------------------------------------------------------------------------------
# MXFP4 (routed experts)
# ----------------------------------------------------------------------------------------------------


def quantize_mxfp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """f32 ``[O, I]`` (I % 32 == 0) -> ``(packed int8 [O, I/2], scale e8m0 [O, I/32])``.

    Per row and 32 columns: ``scale = 2^ceil(log2(amax / 6))`` (all-zero block: 1.0), codes =
    round-to-nearest-even E2M1 of ``w / scale``.
    """
    w = _check_float(w, "quantize_mxfp4")
    if w.dim() != 2 or w.shape[1] % block or block % 2:
        raise ValueError(f"quantize_mxfp4 expects [O, I] with I % {block} == 0, got {tuple(w.shape)}")
    O, I = w.shape
    blocks = w.reshape(O, I // block, block)
    e = _pow2_exponent_for(blocks.abs().amax(dim=2), E2M1_MAX)
    inv = torch.exp2(-e.to(torch.float32))
    codes = f32_to_e2m1_codes((blocks * inv[..., None]).reshape(O, I))
    return pack_e2m1(codes), _exp_to_e8m0(e)


def unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(packed int8 [..., O, I/2], scale e8m0 [..., O, I/b])`` -> f32 ``[..., O, I]`` (b inferred from
    the shapes, 32 in practice; leading dims = stacked experts)."""
    if packed.dim() < 2 or scale.dim() != packed.dim() or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"unpack_mxfp4: weight {tuple(packed.shape)} and scale {tuple(scale.shape)} do not pair")
    I = packed.shape[-1] * 2
    nb = scale.shape[-1]
    if nb == 0 or I % nb:
        raise ValueError(f"unpack_mxfp4: {I} columns not divisible into {nb} scale blocks")
    vals = e2m1_to_f32(unpack_e2m1(packed)).reshape(*packed.shape[:-1], nb, I // nb)
    return (vals * e8m0_to_f32(scale)[..., None]).reshape(*packed.shape[:-1], I)
