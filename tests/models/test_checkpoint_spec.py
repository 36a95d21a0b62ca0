"""WeightSpec, stacking, scale pairing, byte accounting."""

import pytest

from megagraph.models.checkpoint import (
    SpecError,
    WeightSpec,
    bytes_needed,
    expand_spec,
    fp4_expert_specs,
    fp8_linear_specs,
    validate_specs,
    with_scales,
)
from megagraph.models.checkpoint.testing import tiny_v41_specs


def test_weightspec_basics():
    s = WeightSpec("layers.3.ffn.experts.*.w1.weight", [4, 64, 32], "fp4x2")
    assert s.shape == (4, 64, 32) and s.stacked and s.num_stacked == 4 and s.member_shape == (64, 32)
    assert s.member_names()[0] == "layers.3.ffn.experts.0.w1.weight"
    assert s.nbytes == 4 * 64 * 32
    assert [m.name for m in s.expand()] == [f"layers.3.ffn.experts.{e}.w1.weight" for e in range(4)]
    assert all(m.shape == (64, 32) and m.dtype == "fp4x2" for m in s.expand())
    assert hash(s) == hash(WeightSpec("layers.3.ffn.experts.*.w1.weight", (4, 64, 32), "fp4x2"))


@pytest.mark.parametrize("args", [
    ("x", (2,), "float32"),                 # unknown dtype
    ("a.*.*.w", (2, 2), "bf16"),            # two stars
    ("a.e*.w", (2, 2), "bf16"),             # star not a whole segment
    ("a.*.w", (), "bf16"),                  # stacked scalar
    ("x", (-1,), "bf16"),
    ("", (1,), "bf16"),
])
def test_weightspec_rejects(args):
    with pytest.raises(SpecError):
        WeightSpec(*args)


def test_expand_spec_duplicates():
    a = WeightSpec("l.experts.*.w1.weight", (2, 4, 4), "bf16")
    b = WeightSpec("l.experts.1.w1.weight", (4, 4), "bf16")
    assert len(expand_spec([a])) == 2
    with pytest.raises(SpecError, match="duplicate"):
        expand_spec([a, b])


def test_validate_specs_pairs_and_errors():
    specs = fp8_linear_specs("l.wq", 48, 64) + fp4_expert_specs("l.experts.*.w1", 3, 64, 64)
    pairs = validate_specs(specs)
    assert pairs["l.wq.weight"].name == "l.wq.scale" and pairs["l.wq.weight"].shape == (2, 2)
    assert pairs["l.experts.*.w1.weight"].shape == (3, 64, 2)
    with pytest.raises(SpecError, match="no l.wq.scale"):
        validate_specs([specs[0]] + specs[2:])
    with pytest.raises(SpecError, match="has no quantized"):
        validate_specs([specs[1]])
    with pytest.raises(SpecError, match="tile"):
        validate_specs([specs[0], WeightSpec("l.wq.scale", (4, 2), "e8m0")])
    with pytest.raises(SpecError, match="e8m0"):
        validate_specs([specs[0], WeightSpec("l.wq.scale", (2, 2), "f32")])
    with pytest.raises(SpecError, match="mxfp4"):
        validate_specs([specs[2], WeightSpec("l.experts.*.w1.scale", (3, 64, 3), "e8m0")])
    with pytest.raises(SpecError, match="stacking"):
        validate_specs([specs[2], WeightSpec("l.experts.*.w1.scale", (2, 64, 2), "e8m0")])
    # V4 128x128 blocks and Engram rows also pair
    validate_specs(fp8_linear_specs("v4.wq", 300, 130, block=128))
    validate_specs([WeightSpec("engram.embed.weight", (40, 256), "fp8e4m3"),
                    WeightSpec("engram.embed.scale", (40, 8), "e8m0")])


def test_with_scales_matches_builders():
    specs = tiny_v41_specs()
    bare = [s for s in specs if s.dtype != "e8m0"]
    assert sorted(with_scales(bare), key=lambda s: s.name) == sorted(specs, key=lambda s: s.name)


def test_bytes_needed():
    specs = fp8_linear_specs("a", 48, 64) + fp4_expert_specs("e.*.w1", 2, 64, 64) + [WeightSpec("n.weight", (64,), "bf16")]
    assert bytes_needed(specs) == 48 * 64 + 2 * 2 + 2 * 64 * 32 + 2 * 64 * 2 + 128
    assert bytes_needed(specs, dequantize=True) == 48 * 64 * 4 + 2 * 64 * 64 * 4 + 128
