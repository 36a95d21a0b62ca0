"""`megagraph compile` end to end: artifact layout, determinism, atomic replace, the loader the
runtime uses, and the clear errors."""

import os
import subprocess
import sys

import pytest
import yaml

from megagraph.main import main as cli
from megagraph.passes.artifacts import SCHEMA_VERSION, ArtifactError, load_artifacts, render
from tests.passes.helpers import compiled

TINY = "v4.1-flash-tiny"


def _compile(tmp_path, *extra, out="art", model=TINY, hw="gb300"):
    return cli(["compile", "--model", model, "--hw", hw, "--out", str(tmp_path / out), *extra])


def test_compile_writes_the_artifact_layout(tmp_path, capsys):
    assert _compile(tmp_path, "--bounded-replay") == 0
    out = tmp_path / "art"
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["graph/00-built.mgir", "graph/01-fold-constants.mgir", "graph/02-cse.mgir",
                     "graph/03-fuse-compressor.mgir", "graph/04-quantize-epilogues.mgir",
                     "graph/05-mega-moe-fusion.mgir", "graph/06-mega-mhc-fusion.mgir",
                     "graph/07-batch-window-copies.mgir", "graph/08-indexer-products.mgir",
                     "graph/09-dead-code.mgir", "graph/10-partition-prefill.mgir",
                     "graph/11-bounded-replay.mgir", "graph/12-encoder-replay.mgir",
                     "graph/13-dspark-draft.mgir", "graph/dspark-draft.mgir",
                     "graph/dspark-verify.mgir",
                     "graph/encoder-replay.mgir",
                     "graph/prefill-prefix.mgir", "graph/prefill-suffix.mgir", "manifest.yaml",
                     "model.yaml", "plan.yaml"]
    m = yaml.safe_load((out / "manifest.yaml").read_text())
    assert m["schema_version"] == SCHEMA_VERSION and m["hardware"]["name"] == "gb300"
    assert m["model"]["config_hash"].startswith("sha256:") and m["options"]["keep"] == 14
    assert [p["name"] for p in m["passes"]][:3] == ["fold-constants", "cse", "fuse-compressor"]
    assert m["passes"][4]["stats"] == {"fused": 9, "sites": 9}
    assert m["passes"][5]["stats"] == {"fused": 9, "sites": 9}  # the attention sites' mHC
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    assert "mega-moe-fusion" in capsys.readouterr().out


def test_rendering_is_deterministic_except_timing():
    a = render(compiled(TINY, "h200"))
    b = render(compiled(TINY, "h200"))
    strip = lambda t: {k: v for k, v in yaml.safe_load(t).items() if k != "timing"}  # noqa: E731
    assert a.keys() == b.keys()
    for k in a:
        if k == "manifest.yaml":
            assert strip(a[k]) == strip(b[k])
        else:
            assert a[k] == b[k], k


def test_load_artifacts_for_the_runtime(tmp_path):
    assert _compile(tmp_path, "--bounded-replay", "--logits", "last") == 0
    arts = load_artifacts(tmp_path / "art")
    assert set(arts.graphs) == {"step", "prefill-prefix", "prefill-suffix", "encoder-replay",
                                "dspark-draft", "dspark-verify"}
    step = arts.graphs["step"]
    assert step.meta_value("logits") == "last" and step.op_counts()["mega_moe"] == 9
    assert arts.plan["segments"][1]["kind"] == "eager" and arts.model["name"] == TINY
    assert arts.stage("built").op_counts()["moe_experts"] == 9 and arts.stage(5).op_counts()["mega_moe"] == 9


def test_existing_output_needs_force(tmp_path, capsys):
    assert _compile(tmp_path, hw="cpu") == 0
    assert _compile(tmp_path, hw="gb300") == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert load_artifacts(tmp_path / "art").manifest["hardware"]["name"] == "cpu"
    assert _compile(tmp_path, "--force", hw="gb300") == 0
    assert load_artifacts(tmp_path / "art").manifest["hardware"]["name"] == "gb300"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize("args,msg", [
    (["--model", "v5-flash", "--hw", "gb300"], "unknown model 'v5-flash'; known: v4-flash, v4-flash-tiny, v4.1-flash"),
    (["--model", TINY, "--hw", "gb200"], "unknown hardware 'gb200'; known: b200, b300, cpu, gb300, h200"),
    (["--model", TINY, "--hw", "gb300", "-p", "cse,fuse-everything"], "unknown pass(es) ['fuse-everything']"),
])
def test_clear_errors(tmp_path, capsys, args, msg):
    assert cli(["compile", *args, "--out", str(tmp_path / "x")]) == 2
    assert msg in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_unwritable_output_dir(tmp_path, capsys, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    assert _compile(tmp_path) == 2
    assert f"directory {tmp_path} is not writable" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli(["compile", "--model", TINY, "--hw", "cpu", "--out", str(tmp_path / "file")]) == 2


def test_pass_list_runs_exactly_those(tmp_path):
    assert _compile(tmp_path, "-p", "quantize-epilogues,mega-moe-fusion") == 0
    m = load_artifacts(tmp_path / "art").manifest
    assert [p["name"] for p in m["passes"]] == ["quantize-epilogues", "mega-moe-fusion"]
    assert m["stages"][-1]["ops"]["mega_moe"] == 9


def test_schema_version_and_tampering_are_caught(tmp_path, capsys):
    assert _compile(tmp_path, hw="cpu") == 0
    art = tmp_path / "art"
    g = art / "graph" / "11-bounded-replay.mgir"
    g.write_text(g.read_text().replace("rms_norm", "rms_norm", 1) + "\n")
    with pytest.raises(ArtifactError, match="does not match the manifest's hash"):
        load_artifacts(art)
    man = art / "manifest.yaml"
    m = yaml.safe_load(man.read_text())
    m["schema_version"] = 0
    man.write_text(yaml.safe_dump(m))
    with pytest.raises(ArtifactError, match=r"schema version 0 .* reads schema version 1; recompile"):
        load_artifacts(art)
    assert cli(["inspect", str(art)]) == 2
    assert "schema version 0" in capsys.readouterr().err
    with pytest.raises(ArtifactError, match="no manifest.yaml"):
        load_artifacts(tmp_path)


def test_console_script_in_a_subprocess(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "megagraph")
    r = subprocess.run([exe, "compile", "--model", TINY, "--hw", "h200", "--out", str(tmp_path / "a")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([exe, "inspect", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "fp8_1x128" in r.stdout
