"""Hardware profiles: every shipped one loads; errors name the file, the field and the choices."""

import pytest

from megagraph.models.config import ConfigError
from megagraph.passes.hw import known_hw, load_hw_profile


def test_shipped_profiles():
    assert known_hw() == ["b200", "b300", "cpu", "gb300", "h200"]
    for name in known_hw():
        p = load_hw_profile(name)
        assert p.name == name and p.profile_hash().startswith("sha256:")
        if p.cuda_graphs:
            assert p.graph_token_limit == 8192 and p.prefill_token_buckets()[-1] == 8192
            assert p.replay_buckets() == list(range(128, 2049, 128))
        else:
            assert p.prefill_token_buckets() == [] and not p.fusions
    gb, h = load_hw_profile("gb300"), load_hw_profile("h200")
    assert gb.has_format("mxfp8") and not h.has_format("mxfp8") and h.has_format("fp8_e4m3")
    assert gb.fusion("mega_moe") and "Triton" in h.fusion("mega_moe") and h.fusion("attn_epilogue") is None
    assert "sm_100f" in gb.capabilities and "sm_90" in h.capabilities
    assert gb.tflops("fp4") > gb.tflops("fp8") > gb.tflops("bf16") > 0 and h.tflops("fp4") == 0


def test_unknown_profile_lists_known():
    with pytest.raises(ConfigError, match=r"unknown hardware 'gb200'; known: b200, b300, cpu, gb300, h200"):
        load_hw_profile("gb200")


@pytest.mark.parametrize("text,match", [
    ("name: x\n: [", "malformed YAML"),
    ("- 1\n", "expected a mapping"),
    ("name: x\nbogus: 1\n", r"unknown field\(s\) \['bogus'\]"),
    ("name: x\n", "missing field"),
])
def test_bad_profile_files(tmp_path, text, match):
    p = tmp_path / "mine.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        load_hw_profile(p)
    assert str(p) in str(e.value)


def test_bad_field_values(tmp_path):
    base = (load_hw_profile("gb300").source)
    text = open(base).read().replace("formats: [fp8_e4m3, mxfp8, mxfp4, nvfp4]", "formats: [fp6]")
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=r"field 'formats': unknown format\(s\) \['fp6'\]"):
        load_hw_profile(p)
