"""Core ops: embedding, linear layers in every weight format, norms, RoPE, quantization, glue."""

from ..registry import REQUIRED, expect, op
from ..types import TensorType, scale_dim
from ._util import is_float

WEIGHT_FORMATS = ("dense", "fp8_block", "mxfp4")


@op("embed", ("token_ids", "table"), cost="memory")
def embed(ids: TensorType, table: TensorType) -> TensorType:
    """Row gather: out[t] = table[token_ids[t]]."""
    expect(ids.dtype == "i64" and ids.rank == 1, f"token_ids must be i64[T], got {ids}")
    expect(table.rank == 2 and is_float(table), f"table must be float [V, d], got {table}")
    return TensorType(table.dtype, (ids.shape[0], table.shape[1]))


def _weight_in_features(w: TensorType, fmt: str) -> object:
    expect(fmt in WEIGHT_FORMATS, f"fmt must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    expect(w.rank == 2, f"weight must be [O, I], got {w}")
    if fmt == "mxfp4":
        expect(w.dtype == "fp4x2", f"mxfp4 weight must be fp4x2, got {w}")
        return scale_dim(w.shape[1], 2)
    if fmt == "fp8_block":
        expect(w.dtype == "fp8e4m3", f"fp8_block weight must be fp8e4m3, got {w}")
    else:
        expect(is_float(w), f"dense weight must be a float dtype, got {w}")
    return w.shape[1]


def _check_scale(w: TensorType, scale: TensorType | None, fmt: str) -> None:
    if fmt == "dense":
        expect(scale is None, "dense weights take no scale")
    else:
        expect(scale is not None and scale.dtype == "e8m0", f"{fmt} needs an e8m0 scale, got {scale}")


@op("linear", ("x", "weight", "scale?"), attrs={"fmt": "dense"}, cost="gemm")
def linear(x: TensorType, w: TensorType, scale, *, fmt) -> TensorType:
    """y = x @ dequant(weight)^T over the last dim (fp32 accumulate, x's dtype out)."""
    i = _weight_in_features(w, fmt)
    _check_scale(w, scale, fmt)
    expect(x.shape[-1] == i, f"x's last dim {x.shape[-1]} != weight's in-features {i}")
    return TensorType(x.dtype, (*x.shape[:-1], w.shape[0]))


@op("grouped_linear", ("x", "weight", "scale?"), attrs={"groups": REQUIRED, "fmt": "dense"},
    cost="gemm")
def grouped_linear(x: TensorType, w: TensorType, scale, *, groups, fmt) -> TensorType:
    """Block-diagonal linear: x [T, G*I] split in G groups, group g uses weight rows g*O..(g+1)*O."""
    i = _weight_in_features(w, fmt)
    _check_scale(w, scale, fmt)
    expect(x.rank == 2 and x.shape[1] == scale_dim(i, groups), f"x must be [T, {groups}*{i}], got {x}")
    return TensorType(x.dtype, (x.shape[0], w.shape[0]))


@op("rms_norm", ("x", "weight?"), attrs={"eps": REQUIRED}, cost="memory")
def rms_norm(x: TensorType, w, *, eps) -> TensorType:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, in fp32; weightless if absent."""
    expect(is_float(x), f"x must be float, got {x}")
    if w is not None:
        expect(w.shape == x.shape[-1:], f"weight must be [{x.shape[-1]}], got {w}")
    return x


@op("rope", ("x", "positions"),
    attrs={"rope_dim": REQUIRED, "theta": REQUIRED, "yarn_factor": 1.0, "yarn_original": 0,
           "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "offset": 0, "inverse": False},
    cost="memory")
def rope(x: TensorType, pos: TensorType, *, rope_dim, theta, yarn_factor, yarn_original,
         yarn_beta_fast, yarn_beta_slow, offset, inverse) -> TensorType:
    """Interleaved-pair rotary embedding on the last `rope_dim` channels at positions+offset."""
    expect(x.shape[:1] == pos.shape, f"x must have one row per position, got {x} vs {pos}")
    expect(isinstance(x.shape[-1], int) and rope_dim <= x.shape[-1] and rope_dim % 2 == 0,
           f"rope_dim {rope_dim} must be even and <= {x.shape[-1]}")
    return x


@op("fake_quant", ("x",), attrs={"fmt": REQUIRED, "block": REQUIRED}, cost="memory")
def fake_quant(x: TensorType, *, fmt, block) -> TensorType:
    """Quantize-dequantize along the last dim (fp8_e4m3 / mxfp4 / nvfp4 with per-block scales)."""
    expect(fmt in ("fp8_e4m3", "mxfp4", "nvfp4"), f"unknown fake_quant fmt {fmt!r}")
    last = x.shape[-1]
    expect(isinstance(last, int) and last % block == 0, f"last dim {last} is not a multiple of block {block}")
    return x


@op("add", ("a", "b"), cost="memory")
def add(a: TensorType, b: TensorType) -> TensorType:
    """Elementwise a + b (same type)."""
    expect(a == b, f"add needs equal types, got {a} and {b}")
    return a


@op("split_heads", ("x",), attrs={"heads": REQUIRED}, cost="view")
def split_heads(x: TensorType, *, heads) -> TensorType:
    """[T, H*D] -> [T, H, D] (a view)."""
    expect(x.rank == 2, f"x must be [T, H*D], got {x}")
    return TensorType(x.dtype, (x.shape[0], heads, scale_dim(x.shape[1], 1, heads)))


@op("merge_heads", ("x",), cost="view")
def merge_heads(x: TensorType) -> TensorType:
    """[T, H, D] -> [T, H*D] (a view)."""
    expect(x.rank == 3, f"x must be [T, H, D], got {x}")
    return TensorType(x.dtype, (x.shape[0], scale_dim(x.shape[2], x.shape[1])))


@op("cast", ("x",), attrs={"dtype": REQUIRED}, cost="memory")
def cast(x: TensorType, *, dtype) -> TensorType:
    """Elementwise dtype conversion."""
    return TensorType(dtype, x.shape)


@op("select_last", ("x", "seq_new"), cost="memory")
def select_last(x: TensorType, seq_new: TensorType) -> TensorType:
    """The row of each request's last new token: [T, ...] -> [R, ...]."""
    expect(seq_new.dtype == "i64" and seq_new.rank == 1, f"seq_new must be i64[R], got {seq_new}")
    return TensorType(x.dtype, (seq_new.shape[0], *x.shape[1:]))
