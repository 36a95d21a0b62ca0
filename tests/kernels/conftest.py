"""The kernel tests pin routed_experts' H format: fp16 H unless a test asks for FP8 H.

Why: since the fifteenth session routed_experts quantizes H to E4M3 by default at prefill sizes on
sm_90 (moe.FP8_H_PREFILL: the vendor's numerics, ~3.4% relative to fp16 H). The fp16-H kernels'
tests compare prefill-size calls with fp16-H references and bounds; they keep testing those
kernels. The FP8-H path has its own tests (test_moe_gluon_l2_fp8.py, test_triton_moe_fp8h.py),
which pass fp8_h=True or set FP8_H_PREFILL themselves.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the shared helpers here (sm90_build, gluon_cases, poisoned_alloc, ...) import by their plain
# names from the test modules of every family folder below
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _fp16_h(monkeypatch):
    from megagraph.kernels.moe import triton as moe

    monkeypatch.setattr(moe, "FP8_H_PREFILL", False)
