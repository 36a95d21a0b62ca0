"""The torch.compile diagnostics (benchmarks/probes/compile_parity.py, compile_bisect.py,
compile_subsystem.py) on the CPU: they run, compare what they claim to, and flag a difference when
there is one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

PROBES = Path(__file__).resolve().parents[2] / "benchmarks" / "probes"

TINY = ["--device", "cpu", "--hw", "h200", "--batch", "2", "--context", "8"]


def test_parity_and_bisect_run(run_bench, tmp_path):
    run_bench("probes/compile_parity.py", "--out", str(tmp_path), *TINY, "--steps", "1",
              "--variants", "aot_eager")
    parity = json.loads((tmp_path / "compile_parity.json").read_text())["variants"]["aot_eager"]
    rows = parity["steps"]
    assert [r["step"] for r in rows] == ["prefill", "decode 1"]
    assert all(r["max_abs_diff"] == 0 and r["argmax_agree"] == 1 for r in rows)  # exact
    states = parity["state"]
    assert [r["after"] for r in states] == ["start-up", "prefill", "decode 1"]
    assert not any(r["differing_pools"] for r in states)
    run_bench("probes/compile_bisect.py", "--out", str(tmp_path), *TINY, "--chunk", "400",
              "--backend", "aot_eager", "--every", "--no-refine", "--engine-fn")
    res = json.loads((tmp_path / "compile_bisect.json").read_text())
    segs = res["segments"]
    assert [s["name"] for s in segs] == ["0:graph", "2:graph"]
    assert all(s["every"] and not s["differing"] for s in segs)
    assert {(r["check"], r["segment"]) for r in res["engine_fn"]} == {
        (c, s) for c in ("engine fn", "fresh wrap") for s in ("0:graph", "2:graph")}
    assert not any(r["bad"] for r in res["engine_fn"])


def test_state_diffs_name_the_pool():
    if str(PROBES) not in sys.path:
        sys.path.insert(0, str(PROBES))
    from compile_parity import state_diffs

    g = torch.Generator().manual_seed(4)
    a = {"kv": torch.randn(3, 8, generator=g), "ids": torch.randint(0, 9, (5,), generator=g)}
    b = {k: v.clone() for k, v in a.items()}
    b["ids"][2] += 1
    rows = state_diffs([a, a, b], [a, a, a])
    assert [sorted(r["differing_pools"]) for r in rows] == [[], [], ["ids"]]


def test_compare_flags_differences():
    if str(PROBES) not in sys.path:
        sys.path.insert(0, str(PROBES))
    from compile_bisect import compare

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g)
    assert not compare(x.clone(), x)["bad"]
    assert compare(x + 0.05 * x.abs().max(), x)["bad"]
    q = (x * 50).to(torch.float8_e4m3fn)
    flipped = q.view(torch.uint8).clone()
    flipped[0, 0] ^= 1
    assert compare(flipped.view(torch.float8_e4m3fn), q)["mismatch"] == 1 / q.numel()
    i = torch.randint(0, 9, (40,), generator=g)
    assert not compare(i.clone(), i)["bad"] and compare(i + (i == i[0]), i)["bad"]
    y = x.clone()
    y[1, 1] = float("nan")
    assert compare(y, x)["nan_mismatch"]


def test_subsystem_bisect_can_be_restricted():
    """compile_subsystem.py --only: torch's bisector sees Inductor with just those subsystems,
    and its table is restored afterwards; an unknown name is refused."""
    import pytest
    from torch._inductor import compiler_bisector as cb

    if str(PROBES) not in sys.path:
        sys.path.insert(0, str(PROBES))
    from compile_subsystem import only_subsystems

    before = {k: [s.name for s in v] for k, v in cb.BACKENDS.items()}
    with only_subsystems("lowerings"):
        assert {k: [s.name for s in v] for k, v in cb.BACKENDS.items()} == {
            "inductor": ["lowerings"]}
    assert {k: [s.name for s in v] for k, v in cb.BACKENDS.items()} == before
    with pytest.raises(ValueError, match="unknown Inductor subsystem"), only_subsystems("nope"):
        pass
