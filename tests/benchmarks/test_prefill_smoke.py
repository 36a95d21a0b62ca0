"""benchmarks/prefill.py --smoke: the tiny model on the CPU, every row kind (megagraph through a
padded bucket and eagerly, capturable, reference, torch.compile with the eager backend), the
per-node split, the 40-layer extrapolation, prefill.md / .json / .png; then --replot."""
from __future__ import annotations

import json


def test_prefill_smoke(tmp_path, run_bench, measured_rows, check_png):
    run_bench("prefill.py", "--smoke", "--out", str(tmp_path))
    res = json.loads((tmp_path / "prefill.json").read_text())
    batches = res["args"]["batches"]
    assert batches == [16, 32] and res["model"]["model"] == "v4.1-flash-tiny"
    rows = measured_rows(res, ("megagraph", "capturable", "reference"), lambda B: B // 16)
    assert rows[("megagraph", 16)]["path"].startswith("padded bucket 16")
    assert rows[("megagraph", 32)]["path"] == "eager"
    assert rows[("compile", 16)]["ms"] > 0 and "skipped" in rows[("compile", 32)]
    for B in batches:
        assert res["costs"][str(B)]["flops"] > 0 and res["costs"][str(B)]["flops40"] > 0
        ops = res["split"][str(B)]["ops"]
        assert ops and all(o["ms"] >= 0 for o in ops) and sum(o["ms"] for o in ops) > 0
        assert {o["cls"] for o in ops} == {"attention", "moe", "mhc", "other"}
    assert res["mapping"]["layers"] == [40, 9] and sum(res["mapping"]["counts"].values()) == 40
    md = (tmp_path / "prefill.md").read_text()
    assert "set as state, not prefilled" in md and "| B (new tok/step) |" in md
    assert "## Extrapolated to 40 layers (not measured)" in md
    assert "### Per layer, B = 32" in md and "DeepGEMM" in md and "FlashMLA" in md
    for B in batches:
        assert f"\n| {B} | " in md
    check_png(md, tmp_path / "prefill.png")
    again = tmp_path / "again"
    run_bench("prefill.py", "--replot", str(tmp_path / "prefill.json"), "--out", str(again))
    assert (again / "prefill.md").read_text() == md
