"""Shared set-up of the kernel tests: the helper modules here on the import path.

The MoE tests pin routed_experts' H format through their configs (test_triton_moe.FP16_H):
fp16 H unless a test asks for FP8 H, whose own tests pass MoeConfig(fp8_h=True) or use the
default's prefill FP8 H.
"""
from __future__ import annotations

import sys
from pathlib import Path

# the shared helpers here (sm90_build, gluon_cases, poisoned_alloc, ...) import by their plain
# names from the test modules of every family folder below
sys.path.insert(0, str(Path(__file__).resolve().parent))

