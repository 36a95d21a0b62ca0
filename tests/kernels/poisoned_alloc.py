"""poisoned(): every torch.empty inside the block returns NaN (floats, fp8 too), 0xFF (uint8 /
e8m0) or a huge index (ints), so a kernel output element nobody wrote shows up as NaN / garbage
(tensors from torch.zeros, e.g. arrival counters, are not touched).

Why one module: the MoE and Mega-mHC kernel tests (test_triton_moe.py, test_triton_mhc.py) both
check that every output element is written the same way. A test imports it as a sibling (pytest
puts tests/kernels on sys.path)."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def poisoned():
    real = torch.empty

    def empty(*size, dtype=None, device=None, **kw):
        t = real(*size, dtype=dtype, device=device, **kw)
        dt = t.dtype
        if dt.is_floating_point:
            t.view(torch.uint8).fill_(0xFF) if t.element_size() == 1 else t.fill_(float("nan"))
        elif dt == torch.uint8:
            t.fill_(0xFF)
        elif dt in (torch.int32, torch.int64):
            t.fill_(1 << 30)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real
