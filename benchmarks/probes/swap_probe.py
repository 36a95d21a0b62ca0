"""Probe: which forms of the swapped decode MMA (C^T [BN, BM] = W [BN, K] @ A [BM, K]^T, BM = 16)
does this Triton compile correctly on this GPU? (Triton 3.6 on the H200 miscompiles some of the
GemmConfig.swap forms: fp16, and unsplit 128-column fp8 chunks.) Prints one JSON line per variant
with the relative error against torch."""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def probe(a_ptr, b_ptr, c_ptr, K, DT: tl.constexpr, AMODE: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, PART: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        b = tl.load(b_ptr + rn[:, None] * K + (k0 + rk)[None, :])
        if AMODE == 0:  # load [BM, BK], tl.trans
            at = tl.trans(tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :]))
        elif AMODE == 1:  # load [BK, BM] directly
            at = tl.load(a_ptr + rm[None, :] * K + (k0 + rk)[:, None])
        else:  # load [BM, BK] and go through a float round trip (a computed register tensor)
            a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
            at = tl.trans((a.to(tl.float32) * 1.0).to(a.dtype))
        if DT == 1:
            b = b.to(tl.float16)
            at = at.to(tl.float16)
        if PART:
            part = tl.dot(b, at)
            acc += part * 1.0
        else:
            acc = tl.dot(b, at, acc)
    tl.store(c_ptr + rn[:, None] * BM + rm[None, :], acc)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for dt in (0, 1):
        for bk in (32, 64, 128):
            for amode in (0, 1, 2):
                for part in (1, 0):
                    for stages in (1, 3):
                        K, BM, BN = 2 * bk, 16, 128
                        a = (torch.randn(BM, K, device="cuda") * 2).to(torch.float8_e4m3fn)
                        b = (torch.randn(BN, K, device="cuda") * 2).to(torch.float8_e4m3fn)
                        c = torch.full((BN, BM), float("nan"), device="cuda")
                        row = dict(dtype=["fp8", "fp8->fp16"][dt], bk=bk,
                                   amode=["trans", "loadT", "computed"][amode], part=part,
                                   stages=stages)
                        try:
                            probe[(1,)](a, b, c, K, dt, amode, BM, BN, bk, part, num_warps=4,
                                        num_stages=stages)
                            ref = b.float() @ a.float().T
                            row["rel"] = float((c - ref).norm() / ref.norm())
                        except Exception as e:  # noqa: BLE001 - a probe: report every failure
                            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if args.out:
        import os
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "swap_probe.json"), "w") as f:
            json.dump(dict(triton=triton.__version__, torch=torch.__version__, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
