"""cuBLAS block-scaled FP8 GEMMs (kernels/gemm/cublas_fp8.py) against the Triton FP8-block GEMM at
V4.1-Flash's dense shapes, on one GPU: which call forms torch / cuBLAS accept, their error
against fp32 math (of the reblocked weight: the call's own math; of the source 32 x 32 weight:
what the model means), and times (CUDA-graph replays) next to moe.linear_q's Triton kernel.
Also whether torch's scaled_grouped_mm runs the routed experts' shapes on this GPU (rowwise /
blockwise FP8), timed, for the prefill MoE.

    python3 benchmarks/probes/scaled_mm_probe.py --out DIR   # DIR/scaled-mm-probe.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),  # probes/ and benchmarks/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from kernel_rows import time_ms  # noqa: E402

# (name, N, K) of the dense FP8 weights (../shared/reference/v41-flash-architecture.md)
SHAPES = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120),
          ("wo_b", 5120, 8192), ("shared w1|w3", 4608, 5120), ("shared w2", 5120, 2304),
          ("indexer wq_b", 4096, 1280)]
ROWS = [8, 64, 128, 1024, 8192]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def dense_rows(dev, budget_end, out_rows, write):
    from megagraph.kernels.gemm import cublas_fp8 as cb
    from megagraph.kernels.gemm.config import GemmConfig

    NO_CUBLAS = GemmConfig(cublas_fp8=False)  # the Triton FP8-block GEMM
    from megagraph.kernels import formats
    from megagraph.kernels.fused import reference as rf
    from megagraph.kernels.moe import triton as tm

    g = torch.Generator(device=dev).manual_seed(0)
    for name, N, K in SHAPES:
        w = torch.randn(N, K, device=dev, generator=g) * 0.02
        # sub-block scales spread over 2^-3..2^2, as trained weights' blocks differ
        w = w * torch.exp2(torch.randint(-3, 3, (N // 32, K // 32), device=dev, generator=g)
                           .float()).repeat_interleave(32, 0).repeat_interleave(32, 1)
        wq, ws = formats.quantize_fp8_block(w, 32)
        w_src = formats.dequantize_fp8_block(wq, ws)
        forms = {}
        for form in cb.FORMS:
            try:
                t0 = time.perf_counter()
                w2, s2, exact = cb.reblock(wq, ws, form)
                torch.cuda.synchronize()
                forms[form] = (cb.CublasWeight(w2, s2, form, exact),
                               1e3 * (time.perf_counter() - t0),
                               cb.dequant_reblocked(w2, s2, form))
            except ValueError as e:
                print(f"{name} {form}: {e}", flush=True)
        for M in ROWS:
            if time.perf_counter() > budget_end:
                return
            x = torch.randn(M, K, device=dev, generator=g)
            xq, xs = rf.quantize_act(x, act_fmt="fp8_1x128")
            xf = rf.dequant_act(xq, xs, act_fmt="fp8_1x128")
            want_src = xf @ w_src.t()
            kw = dict(fmt="fp8_block", act_fmt="fp8_1x128", out_dtype="bf16")
            tri = tm.linear_q(xq, xs, wq, ws, **kw, kernel_config=NO_CUBLAS)
            t_tri = time_ms(lambda: tm.linear_q(xq, xs, wq, ws, **kw, kernel_config=NO_CUBLAS),
                            device=dev)
            row = dict(name=name, N=N, K=K, M=M, triton_us=1e3 * t_tri,
                       triton_rel_src=rel(tri, want_src), flops=2 * M * N * K,
                       bytes=N * K + M * K + 2 * M * N)
            for form, (cw, prep_ms, w_re) in forms.items():
                try:
                    y = cb.matmul(xq, xs, cw, torch.bfloat16)
                    y32 = cb.matmul(xq, xs, cw, torch.float32)
                    t = time_ms(lambda: cb.matmul(xq, xs, cw, torch.bfloat16), device=dev)
                    want_re = xf @ w_re.t()
                    row[form] = dict(us=1e3 * t, rel_own_f32=rel(y32, want_re),
                                     rel_own_bf16=rel(y, want_re), rel_src=rel(y, want_src),
                                     exact=cw.exact, reblock_ms=prep_ms)
                except Exception as e:  # noqa: BLE001
                    row[form] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            out_rows.append(row)
            print(json.dumps(row), flush=True)
            write()


def grouped_rows(dev, budget_end, out_rows, write):
    """torch scaled_grouped_mm at the routed experts' L1 (N = 2 x 2304, K = 5120) with 128 rows
    per expert: rowwise and blockwise FP8, 2d (tokens) x 3d (experts)."""
    F = torch.nn.functional
    if not hasattr(F, "scaled_grouped_mm"):
        out_rows.append(dict(grouped="no F.scaled_grouped_mm"))
        return
    for G, rows in ((48, 128), (384, 128)):
        if time.perf_counter() > budget_end:
            return
        N, K = 4608, 5120
        Mt = G * rows
        a = (torch.randn(Mt, K, device=dev) * 0.5).to(torch.float8_e4m3fn)
        b = (torch.randn(G, N, K, device=dev) * 0.5).to(torch.float8_e4m3fn)
        offs = torch.arange(rows, Mt + 1, rows, device=dev, dtype=torch.int32)
        cases = {
            "rowwise": (torch.rand(Mt, device=dev) + 0.5, F.ScalingType.RowWise,
                        torch.rand(G, N, device=dev) + 0.5, F.ScalingType.RowWise),
            "blockwise 1x128 x 128x128": (
                (torch.rand(Mt, K // 128, device=dev) + 0.5).t().contiguous().t(),
                F.ScalingType.BlockWise1x128,
                torch.rand(G, N // 128, K // 128, device=dev) + 0.5,
                F.ScalingType.BlockWise128x128),
        }
        for cname, (sa, ra, sb, rb) in cases.items():
            row = dict(grouped=cname, G=G, rows=rows, N=N, K=K, flops=2 * Mt * N * K)
            try:
                def call():
                    return F.scaled_grouped_mm(a, b.transpose(-2, -1), sa, ra, sb, rb,
                                               offs=offs, output_dtype=torch.bfloat16)
                y = call()
                ref = (a[:rows].float() * (sa[:rows, None] if sa.dim() == 1 else 1.0)) @ \
                    b[0].float().t()
                if sb.dim() == 2:
                    ref = ref * sb[0][None, :]
                    row["rel_group0"] = rel(y[:rows], ref)
                t = time_ms(call, device=dev)
                row.update(ms=t, tflops=2 * Mt * N * K / t / 1e9)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out_rows.append(row)
            print(json.dumps(row), flush=True)
            write()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds")
    args = ap.parse_args()
    dev = torch.device("cuda")
    from megagraph.kernels.gemm import cublas_fp8 as cb

    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               cuda=torch.version.cuda, supported_form=cb.supported(0), dense=[], grouped=[])
    print("supported form:", res["supported_form"], flush=True)
    path = os.path.join(args.out, "scaled-mm-probe.json") if args.out else None
    if path:
        os.makedirs(args.out, exist_ok=True)

    def write():
        if path:
            with open(path + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(path + ".tmp", path)

    end = time.perf_counter() + args.budget
    dense_rows(dev, end - 25, res["dense"], write)
    grouped_rows(dev, end, res["grouped"], write)
    write()


if __name__ == "__main__":
    main()
