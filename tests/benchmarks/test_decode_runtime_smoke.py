"""benchmarks/probes/decode_runtime.py --smoke runs on CPU in seconds and writes its table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def test_decode_runtime_smoke(tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "probes" / "decode_runtime.py"
    spec = importlib.util.spec_from_file_location("decode_runtime", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "decode_runtime.json").read_text())
    (model,) = res["models"]
    assert set(model["modes"]) == {"eager", "padded", "graphs"}
    assert all("error" not in row and set(row["ms_per_step"]) == {"1", "4"}
               for row in model["modes"].values())
    assert model["tokens"]["graphs vs padded"]["identical"]
    assert "| eager |" in (tmp_path / "decode_runtime.md").read_text()
