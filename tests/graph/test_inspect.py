"""`megagraph inspect`: the summary, the diff of two artifact dirs, Graphviz output, errors."""

import pytest

from megagraph.main import main as cli
from megagraph.passes.artifacts import write_artifacts
from tests.passes.helpers import compiled


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    for hw in ("gb300", "h200"):
        write_artifacts(compiled("v4.1-flash-tiny", hw, bounded_replay=hw == "gb300"), root / hw,
                        model_arg="v4.1-flash-tiny")
    return root


def test_summary(arts, capsys, text_snapshot):
    assert cli(["inspect", str(arts / "gb300")]) == 0
    out = capsys.readouterr().out
    assert "ops per kind after each stage" in out and "mega_moe" in out and "segments:" in out
    assert out == text_snapshot


def test_diff(arts, capsys, text_snapshot):
    assert cli(["inspect", str(arts / "gb300"), str(arts / "h200")]) == 0
    out = capsys.readouterr().out.replace(str(arts), "<tmp>")
    assert "sparse_attn_q: 9 -> 0" in out and "mxfp8" in out and "fp8_1x128" in out
    assert out == text_snapshot
    assert cli(["inspect", str(arts / "h200"), str(arts / "h200")]) == 0
    assert "(no differences)" in capsys.readouterr().out


def test_dot(arts, capsys):
    assert cli(["inspect", str(arts / "gb300"), "--dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('digraph "v4.1-flash-tiny/step" {') and out.rstrip().endswith("}")
    assert "subgraph cluster_1" in out and "color=red" in out and '"mega_moe\\nL0.ffn.streams"' not in out
    assert '"L0.attn.streams" -> "L0.ffn.xn";' in out


def test_errors(tmp_path, capsys):
    assert cli(["inspect", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert cli(["inspect", str(tmp_path)]) == 2
    assert "no manifest.yaml" in capsys.readouterr().err
