"""Suite-wide settings.

Tiny-model tests run many small ops: one intra-op thread is ~20x faster than two threads that
spin against each other (and against other processes) on a 2-core machine.
"""

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `from tests.tiny import ...` works from any working directory
    sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` is the one way a test says it needs a CUDA device: skipped without one."""
    import pytest

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
