"""Small helpers shared by type rules."""

from ..registry import expect
from ..types import FLOAT_DTYPES, TensorType

META = ("positions", "token_req", "seq_slots")  # per-step metadata most stateful ops read


def is_float(t: TensorType) -> bool:
    return t.dtype in FLOAT_DTYPES


def expect_meta(positions: TensorType, token_req: TensorType, seq_slots: TensorType) -> None:
    expect(positions.dtype == "i64" and positions.rank == 1, f"positions must be i64[T], got {positions}")
    expect(token_req.shape == positions.shape, f"token_req must be {positions}, got {token_req}")
    expect(seq_slots.dtype == "i64" and seq_slots.rank == 1, f"seq_slots must be i64[R], got {seq_slots}")


def expect_rows(x: TensorType, positions: TensorType, what: str) -> None:
    expect(x.shape[:1] == positions.shape[:1], f"{what} must have one row per token ({positions.shape[0]}), got {x}")


def expect_mqa(q: TensorType, kv: TensorType, ring: TensorType, sink: TensorType,
               positions: TensorType, token_req: TensorType, seq_slots: TensorType,
               window: int) -> int:
    """The operands every sink-softmax MQA over a ring shares (q [T, H, D], kv [T, D], ring
    [S, window, D], sink f32[H], the step metadata); returns D."""
    expect_meta(positions, token_req, seq_slots)
    expect(q.rank == 3, f"q must be [T, H, D], got {q}")
    expect_rows(q, positions, "q")
    d = q.shape[2]
    expect(kv.shape == (q.shape[0], d), f"kv must be [T, {d}], got {kv}")
    expect(ring.rank == 3 and ring.shape[1:] == (window, d),
           f"ring must be [S, {window}, {d}], got {ring}")
    expect(sink.shape == (q.shape[1],) and sink.dtype == "f32",
           f"sink must be f32[{q.shape[1]}], got {sink}")
    return d
