"""One MegaMoE layer call under Nsight Compute: the profiling target for `ncu`, which reads the
H200's hardware counters (the device's Firecracker runtime; benchmarks/probes/ncu_moe.sh runs it and
turns the report into text). Why: the warp-specialized kernels' DIAG runs (leave a part out, time
the difference) say which part costs time, not why a part is slow; ncu's warp-state sampling per
SASS instruction says where each partition's warps wait (mbarrier, wgmma wait, barrier, issue).

Real V4.1-Flash dims and the inputs of benchmarks/kernels.py's MoE rows; the layer is run
(compiled, autotuned, cached) --warm times before the profiled call, which alone sits between
cudaProfilerStart / Stop (ncu --profile-from-start off).

    ncu --profile-from-start off --set full -o OUT/moe python3 benchmarks/probes/ncu_moe.py --routing balanced
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),  # probes/ and benchmarks/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from kernel_rows import moe as m  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--routing", default="balanced", choices=("gate", "balanced"))
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--set", dest="sets", default="",
                    help="family.field=v,... kernel-config settings (moe.fp8_h_prefill=false), "
                         "as benchmarks/probes/moe_ab.py takes them")
    args = ap.parse_args()
    from moe_ab import parse_configs

    configs = parse_configs(f"x:{args.sets}")[0][2]
    dev = torch.device("cuda")
    w = m.make_weights(m.V41, dev)
    T = args.tokens
    call = m.layer_call(m.V41, w, T, dev, args.routing, configs)

    for _ in range(args.warm):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one mega_moe call: {T} tokens, {args.routing} routing", flush=True)


if __name__ == "__main__":
    main()
