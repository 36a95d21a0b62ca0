"""Artifacts are what `compile` wrote, or refused: every file is checked against the manifest's
hash at load (an edited `model.yaml` used to start a server that refused every request, a
`plan.yaml` with a line commented out was served), with an explicit override for experiments;
and the staging dirs an interrupted compile leaves are removed by the next compile into that
parent, never a live compile's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from megagraph.main import main as cli
from megagraph.passes.artifacts import ArtifactError, load_artifacts
from megagraph.passes.staging import STALE_AFTER_S, _host, make_staging_dir

TINY = "v4.1-flash-tiny"


@pytest.fixture(scope="module")
def compiled_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "art"
    assert cli(["compile", "--model", TINY, "--hw", "cpu", "--out", str(out)]) == 0
    return out


@pytest.fixture
def art(compiled_dir, tmp_path):
    return shutil.copytree(compiled_dir, tmp_path / "art")


def edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_an_edited_model_or_plan_is_refused_naming_the_file(art):
    load_artifacts(art)  # as compiled: fine
    edit(art / "model.yaml", "\nvocab_size: 129408", "\nvocab_size: 1000")
    with pytest.raises(ArtifactError) as e:
        load_artifacts(art)
    msg = str(e.value)
    assert str(art / "model.yaml") in msg and "plan.yaml" not in msg
    assert f"megagraph compile --model {TINY} --hw cpu --out {art} --force" in msg
    assert "--allow-edited-artifacts" in msg
    edit(art / "plan.yaml", "  graph_token_limit: 0", "  # graph_token_limit: 0")  # a line out
    with pytest.raises(ArtifactError, match="plan.yaml"):
        load_artifacts(art)
    a = load_artifacts(art, allow_edited=True)  # the override: loaded, and it says what differs
    assert a.edited == ("model.yaml", "plan.yaml") and a.model["vocab_size"] == 1000


def test_a_missing_listed_file_is_refused_even_with_the_override(art):
    (art / "graph" / "00-built.mgir").unlink()
    with pytest.raises(ArtifactError, match="00-built.mgir: cannot read"):
        load_artifacts(art, allow_edited=True)


def test_serve_refuses_edited_artifacts_unless_told(art):
    from megagraph.runtime.plan import ArtifactsError, RunPlan

    edit(art / "plan.yaml", "segments:", "# served as edited\nsegments:")
    with pytest.raises(ArtifactsError, match="plan.yaml"):
        RunPlan.from_artifacts(art)
    assert RunPlan.from_artifacts(art, allow_edited=True).edited == ("plan.yaml",)
    r = subprocess.run([sys.executable, "-m", "megagraph.main", "runtime", "serve", str(art),
                        "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "plan.yaml: content does not match" in r.stderr, r.stderr


def test_the_next_compile_removes_stale_staging_dirs_only(tmp_path, capsys):
    parent = tmp_path
    # a compile SIGKILLed while writing: a real process made the dir and died
    code = ("import sys; from pathlib import Path; from megagraph.passes.staging import "
            "make_staging_dir; d = make_staging_dir(Path(sys.argv[1]), 'art', 'tmp'); "
            "(d / 'plan.yaml').write_text('half'); print(d); sys.stdout.flush(); "
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    r = subprocess.run([sys.executable, "-c", code, str(parent)], capture_output=True, text=True,
                       timeout=60)
    killed = parent / os.path.basename(r.stdout.strip())
    assert r.returncode == -9 and killed.is_dir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        concurrent = parent / f".art.tmp-{_host()}-{live.pid}-abcd1234"  # a compile in progress
        concurrent.mkdir()
        old_foreign = parent / ".art.old-otherhost-123-xyz"  # another host's, long untouched
        old_foreign.mkdir()
        os.utime(old_foreign, (time.time() - STALE_AFTER_S - 60,) * 2)
        recent_legacy = parent / ".art.tmp-k3j4h5g6"  # no owner in the name, recent
        recent_legacy.mkdir()
        other_name = parent / ".other.tmp-otherhost-1-x"  # another output's
        other_name.mkdir()
        os.utime(other_name, (time.time() - STALE_AFTER_S - 60,) * 2)
        assert cli(["compile", "--model", TINY, "--hw", "cpu", "--out", str(parent / "art")]) == 0
        err = capsys.readouterr().err
        assert not killed.exists() and not old_foreign.exists()
        assert f"removed {killed} (left by an interrupted compile)" in err
        assert concurrent.exists() and recent_legacy.exists() and other_name.exists()
        assert load_artifacts(parent / "art").edited == ()
        leftovers = sorted(p.name for p in parent.iterdir() if p.name.startswith(".art."))
        assert leftovers == sorted([concurrent.name, recent_legacy.name])  # its own are gone
    finally:
        live.kill()
        live.wait()
    assert make_staging_dir(parent, "art", "tmp").name.startswith(f".art.tmp-{_host()}-")
