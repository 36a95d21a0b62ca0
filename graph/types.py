"""Tensor types of the IR: dtypes (incl. fp8/fp4/e8m0) and shapes with symbolic dims.

A dim is an int or a symbolic expression string: a symbol (`T`), or a symbol scaled by an integer
(`N/2`, `T*4`). That is all the arithmetic step graphs need (capacities of compressed caches), and
it keeps types printable, parseable and comparable as plain text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .errors import IRError

# IR dtype name -> (bits per element as stored, description). fp4x2 packs two E2M1 values per byte.
DTYPES: dict[str, tuple[int, str]] = {
    "bf16": (16, "bfloat16"),
    "f16": (16, "float16"),
    "f32": (32, "float32"),
    "f64": (64, "float64"),
    "fp8e4m3": (8, "float8 E4M3 (fn)"),
    "e8m0": (8, "power-of-two scale, biased exponent (UE8M0)"),
    "fp4x2": (8, "two packed E2M1 values per byte, low nibble first"),
    "i8": (8, "int8"),
    "u8": (8, "uint8"),
    "i32": (32, "int32"),
    "i64": (64, "int64"),
    "bool": (8, "bool"),
}
# IR dtype name -> the torch dtype a tensor of it has (fp4x2 is stored as int8 bytes); the one
# table the interpreter, the kernels and the runtime read, kept here so that nothing above the
# IR has to be imported for it.
TORCH_DTYPES = {
    "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64,
    "fp8e4m3": torch.float8_e4m3fn, "e8m0": torch.float8_e8m0fnu, "fp4x2": torch.int8,
    "i8": torch.int8, "u8": torch.uint8, "i32": torch.int32, "i64": torch.int64, "bool": torch.bool,
}
assert set(TORCH_DTYPES) == set(DTYPES)
FLOAT_DTYPES = frozenset({"bf16", "f16", "f32", "f64"})
INT_DTYPES = frozenset({"i8", "u8", "i32", "i64"})

Dim = int | str
_DIM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:([/*])([0-9]+))?$")


def parse_dim(text: str) -> Dim:
    """'64' -> 64, 'T' -> 'T', 'N / 2' -> 'N/2' (canonical spelling, no spaces)."""
    text = text.replace(" ", "")
    if text.isdigit():
        return int(text)
    m = _DIM_RE.match(text)
    if not m:
        raise IRError(f"bad dim {text!r}: expected an int, SYMBOL, SYMBOL/k or SYMBOL*k")
    sym, op, k = m.groups()
    if op and int(k) == 1:
        return sym
    return text


def dim_symbol(d: Dim) -> str | None:
    """The symbol a dim depends on, or None for a constant."""
    if isinstance(d, int):
        return None
    return _DIM_RE.match(d).group(1)


def eval_dim(d: Dim, env: dict[str, int]) -> int:
    """Concrete value of a dim under symbol bindings (N/2 uses exact division)."""
    if isinstance(d, int):
        return d
    sym, op, k = _DIM_RE.match(d).groups()
    if sym not in env:
        raise IRError(f"dim {d!r}: symbol {sym!r} is not bound")
    v = env[sym]
    if op == "*":
        return v * int(k)
    if op == "/":
        if v % int(k):
            raise IRError(f"dim {d!r}: {sym}={v} is not divisible by {k}")
        return v // int(k)
    return v


def scale_dim(d: Dim, num: int, den: int = 1) -> Dim:
    """d * num / den, kept symbolic where possible (used by type rules)."""
    if isinstance(d, int):
        if (d * num) % den:
            raise IRError(f"dim {d} * {num} / {den} is not an integer")
        return d * num // den
    sym, op, k = _DIM_RE.match(d).groups()
    n, m = num, den
    if op == "*":
        n *= int(k)
    elif op == "/":
        m *= int(k)
    from math import gcd

    g = gcd(n, m)
    n, m = n // g, m // g
    if n == 1 and m == 1:
        return sym
    if m == 1:
        return f"{sym}*{n}"
    if n == 1:
        return f"{sym}/{m}"
    raise IRError(f"dim {d} * {num} / {den} is not expressible as SYMBOL*k or SYMBOL/k")


@dataclass(frozen=True, slots=True)
class TensorType:
    """dtype[shape]; shape entries are ints or symbolic dims (see module docstring)."""

    dtype: str  # an IR dtype name, key of DTYPES
    shape: tuple[Dim, ...]  # e.g. ('T', 4, 5120)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise IRError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(dtype, self.shape)

    def with_shape(self, *shape: Dim) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def concrete(self, env: dict[str, int]) -> tuple[int, ...]:
        return tuple(eval_dim(d, env) for d in self.shape)

    def nbytes(self, env: dict[str, int]) -> int:
        n = 1
        for d in self.concrete(env):
            n *= d
        return n * DTYPES[self.dtype][0] // 8

    @staticmethod
    def parse(text: str) -> "TensorType":
        m = re.fullmatch(r"\s*([a-z0-9]+)\[(.*)\]\s*", text)
        if not m:
            raise IRError(f"bad tensor type {text!r}: expected dtype[d0, d1, ...]")
        body = m.group(2).strip()
        dims = tuple(parse_dim(p) for p in body.split(",")) if body else ()
        return TensorType(m.group(1), dims)


def T(dtype: str, *shape: Dim) -> TensorType:
    """Shorthand used by type rules and builders: T('bf16', 'T', 4, 5120)."""
    return TensorType(dtype, tuple(parse_dim(d) if isinstance(d, str) else d for d in shape))
