"""The few process-level settings megagraph reads from the environment, in one place.

Everything that decides what a step computes or which kernel runs is in the plan (plan.yaml,
resolved by the compiler); the environment only says where this process keeps its caches and
whether Triton runs its interpreter (a property of the process, set by Triton's own variable).
"""

from __future__ import annotations

import os


def triton_interpret() -> bool:
    """Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, Triton's own switch)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cache_root() -> str | None:
    """Where compiled-kernel caches live (MEGAGRAPH_CACHE); None: the default location."""
    return os.environ.get("MEGAGRAPH_CACHE") or None
