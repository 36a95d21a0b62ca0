"""What every Triton family here shares: whether Triton is importable, whether a tensor is
somewhere its kernels run, the GPU's multiprocessor count (grid sizing), and the output-dtype
codes of the kernels that round to the input's dtype.

INTERPRET is the process-level switch of Triton's CPU interpreter (configs.process): under it the
kernels take CPU tensors, and they pick the exact ("ieee", manual FP8) paths the interpreter
implements. It is a property of the process, not a kernel choice, so it is not in any family's
config.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from megagraph.configs.process import triton_interpret

INTERPRET = triton_interpret()
RDT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # rounding dtype codes


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def on_device(t: Tensor) -> bool:
    """Whether the Triton kernels take `t` (a CUDA tensor, or any tensor under the interpreter)."""
    return t.device.type == "cuda" or INTERPRET


_SM_COUNT: dict = {}


def sm_count(dev: torch.device) -> int:
    """Multiprocessors of `dev` (4 off the GPU: the interpreter's grids stay small)."""
    if dev.type != "cuda":
        return 4
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SM_COUNT[dev]


@functools.cache
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)  # FP8 tensor cores


def on_fp8_device(t: Tensor) -> bool:
    """Whether kernels that store E4M3 take `t`: a CUDA tensor on an sm_89+ device, or a CPU
    tensor under the interpreter."""
    if INTERPRET:
        return t.device.type == "cpu"
    return t.device.type == "cuda" and _fp8_capable(t.device.index or 0)
