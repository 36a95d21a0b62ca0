"""benchmarks/harness: where the product benchmarks write (results/<hw>/, by default) and how (a
temporary file renamed over the old one, so that a run cut short leaves the last whole result)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from harness import report  # noqa: E402


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "decode.md"
    report.write_atomic(path, "old\n")
    with pytest.raises(TypeError):
        report.write_atomic(path, 123)  # not text, not bytes: fails inside the write
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["decode.md"]  # no temporary file left
    report.write_atomic(path, b"new\n")
    assert path.read_text() == "new\n"


def test_write_outputs_names_and_no_leftovers(tmp_path):
    res = {"rows": [1, 2]}
    md = report.write_outputs(res, tmp_path / "h200", False, name="prefill",
                              markdown=lambda r: f"# {len(r['rows'])} rows\n", plot=None)
    out = tmp_path / "h200"
    assert sorted(p.name for p in out.iterdir()) == ["prefill.json", "prefill.md"]
    assert json.loads((out / "prefill.json").read_text()) == res
    assert (out / "prefill.md").read_text() == md == "# 2 rows\n"


def test_plot_failure_keeps_the_tables(tmp_path):
    pytest.importorskip("matplotlib")

    def plot(plt, res, path):
        raise ValueError("no data")

    md = report.write_outputs({}, tmp_path, True, name="decode", markdown=lambda r: "# t\n",
                              plot=plot)
    assert "Plot not written: ValueError: no data" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.json", "decode.md"]


def test_results_default_to_the_hardware_folder():
    import decode
    import prefill

    assert Path(prefill.parse(["--smoke"]).out) == BENCH / "results" / "cpu"
    args = decode.parse(["--device", "cpu", "--hw", "h200"])
    assert Path(args.out) == BENCH / "results" / "h200"
    assert Path(decode.parse(["--out", "/tmp/x"]).out) == Path("/tmp/x")
