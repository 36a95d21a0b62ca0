"""benchmarks/decode.py --smoke: the tiny model compiled for the H200 profile (fused MegaMoE,
Mega-mHC, quantized GEMMs, Triton kernels falling back to torch off the GPU) run on the CPU with
balanced routing: megagraph / capturable / reference rows through padded buckets, the per-node
split, the roofline bytes, the 40-layer extrapolation, decode.md / .json / .png."""
from __future__ import annotations

import json


def test_decode_smoke(tmp_path, run_bench, measured_rows, check_png):
    run_bench("decode.py", "--smoke", "--hw", "h200", "--routing", "balanced", "--modes",
              "megagraph,capturable,reference", "--out", str(tmp_path))
    res = json.loads((tmp_path / "decode.json").read_text())
    batches = res["args"]["batches"]
    assert batches == [2, 4] and res["model"]["hw_profile"] == "h200"
    rows = measured_rows(res, ("megagraph", "capturable", "reference"), lambda B: B)
    for (mode, B), r in rows.items():
        assert r["path"] == ("eager" if mode == "reference" else f"padded bucket {B} (uncaptured)")
    for B in batches:
        c = res["costs"][str(B)]
        assert 0 < c["bytes"] < c["bytes40"] and 0 < c["flops"] < c["flops40"]
        assert c["touched_experts"] == min(8, 2 * B)  # balanced routing: top-2 of 8
        ops = res["split"][str(B)]["ops"]
        assert {"mega_moe", "mega_mhc", "sparse_attn", "index_scores"} <= {o["op"] for o in ops}
        assert {o["cls"] for o in ops if o["op"] == "mega_moe"} == {"moe"}
    md = (tmp_path / "decode.md").read_text()
    assert "| B (requests) |" in md and "roofline ms" in md and "Routing: balanced" in md
    assert "## Extrapolated to 40 layers (not measured)" in md
    for B in batches:
        assert f"\n| {B} | padded bucket {B}" in md
    check_png(md, tmp_path / "decode.png")
