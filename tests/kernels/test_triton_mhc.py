"""Mega-mHC's split-K projection is deterministic (kernels/triton/mhc.py): each split writes its
own partial sums and mhc_reduce adds them in split order, where atomic adds used to make decode
logits differ from run to run on the H200 (3e-5 on the full-width slice).

Without CUDA this module runs under the Triton interpreter (test_triton_interp.py); the run-to-run
test only has teeth on the GPU (the interpreter is sequential), the ordered-sum test on both."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megagraph.kernels.triton import mhc as tmhc  # noqa: E402
from megagraph.kernels.triton import moe as tm  # noqa: E402

RUNNABLE = torch.cuda.is_available() or tm.INTERPRET
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="runs in the interpreter child process")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("S,T", [(2, 3), (7, 17), (80, 8)])
def test_reduce_partials_adds_in_split_order(S, T):
    """Bitwise the sequential fp32 sum s = 0, 1, ...; the partials span 12 decades, so another
    order gives other bits (checked where S > 2: the reversed sum differs; two terms commute)."""
    g = torch.Generator().manual_seed(S * 100 + T)
    mag = torch.pow(10.0, torch.empty(S, T, 32).uniform_(-4, 8, generator=g))
    part = (torch.randn(S, T, 32, generator=g) * mag).float()
    sqp = (torch.rand(S, T, generator=g) * mag[:, :, 0]).float()
    want_m, want_sq = torch.zeros(T, 32), torch.zeros(T)
    for s in range(S):
        want_m, want_sq = want_m + part[s], want_sq + sqp[s]
    m, sq = tmhc.reduce_partials(part.to(DEV), sqp.to(DEV))
    assert torch.equal(m.cpu(), want_m) and torch.equal(sq.cpu(), want_sq)
    rev = torch.zeros(T, 32)
    for s in reversed(range(S)):
        rev = rev + part[s]
    assert S == 2 or not torch.equal(rev, want_m)


def test_mega_mhc_split_path_gives_the_same_bits_every_run():
    """Decode-sized T (the split-K path) twice on the same inputs: every output bitwise equal."""
    g = torch.Generator().manual_seed(5)
    T, n, d = 3, 4, 256
    streams = torch.randn(T, n, d, generator=g).to(torch.bfloat16).to(DEV)
    fn = (torch.randn((2 + n) * n, n * d, generator=g) * 0.02).to(DEV)
    base = torch.randn((2 + n) * n, generator=g).to(DEV)
    scale = torch.rand(3, generator=g).to(DEV)
    nw = (1 + 0.1 * torch.randn(d, generator=g)).to(DEV)
    kw = dict(eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-20, act_fmt="fp8_1x128")
    runs = [tmhc.mega_mhc(streams, fn, base, scale, None, nw, **kw) for _ in range(3)]
    for out in runs[1:]:
        for a, b in zip(out, runs[0], strict=True):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)
