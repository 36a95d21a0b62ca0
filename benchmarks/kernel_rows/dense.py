"""Benchmark rows of the token-parallel Triton kernels (kernels/dense/triton_rope.py, quant.py
fake_quant) at the V4.1-Flash slice's shapes: RoPE of the q heads [T, 64, 512] (YaRN, rope_dim
64), of the kv rows [T, 512] and of the index keys [T, 128]; fake quantization of the kv rows
(fp8_e4m3 per 32) and of the index keys (mxfp4 per 32). bf16 activations.

Per op and token count (256 = decode at 256 requests, 8192 = prefill): Triton vs the capturable
chain (what the plan runs on devices where the Triton kernels are not validated), time by
CUDA-graph replay;
rel_err vs the reference op on the same inputs, and in the notes whether the output is bitwise
the capturable version's (the kernels' claim; RoPE's table comes from torch on the device, so
against the reference it is bitwise only where torch's device frequencies equal the host's).
Bytes: x read once + the output written once (+ the [T, rope_dim/2] cos / sin table).
CPU / --smoke without a GPU: the capturable chain vs the reference at tiny shapes.
"""
from __future__ import annotations

import time
import traceback

import torch

from . import rel_err, row, time_ms, time_once_ms

YARN = dict(rope_dim=64, theta=160000.0, yarn_factor=16.0, yarn_original=65536,
            yarn_beta_fast=32.0, yarn_beta_slow=1.0)
V41 = dict(heads=64, d=512, di=128, rope=YARN)
TINY = dict(heads=4, d=32, di=32, rope=dict(YARN, rope_dim=16))
BUDGET_S = 120.0


def cases(dims: dict, T: int, dev, g) -> list[tuple]:
    """(kernel, case, triton fn, capturable fn, reference fn, args, kwargs, bytes)."""
    from megagraph.kernels.dense import capturable as cd
    from megagraph.kernels.dense.quant import fake_quant as ref_fq
    from megagraph.kernels.dense.rope import rope as ref_rope

    tr = tq = None
    if dev.type == "cuda" or _interpreting():
        from megagraph.kernels.dense import triton_quant as tq
        from megagraph.kernels.dense import triton_rope as tr

    H, d, di, rp = dims["heads"], dims["d"], dims["di"], dims["rope"]
    pos = torch.randint(0, 65536, (T,), device=dev, generator=g)

    def act(*shape):
        return (torch.randn(*shape, device=dev, generator=g) * 2).bfloat16()

    q, kv, ik = act(T, H, d), act(T, d), act(T, di)
    table = T * rp["rope_dim"] * 4
    out = []
    for name, x in ((f"q [T, {H}, {d}]", q), (f"kv [T, {d}]", kv), (f"ik [T, {di}]", ik)):
        out.append(("rope", f"T={T} {name}", tr and tr.rope, cd.rope, ref_rope, (x, pos), rp,
                    2 * x.numel() * 2 + table))
    for name, x, fmt in ((f"kv [T, {d}]", kv, "fp8_e4m3"), (f"ik [T, {di}]", ik, "mxfp4")):
        out.append(("fake_quant", f"T={T} {name} {fmt}/32", tq and tq.fake_quant, cd.fake_quant,
                    ref_fq, (x,), dict(fmt=fmt, block=32), 2 * x.numel() * 2))
    return out


def _interpreting() -> bool:
    from megagraph.configs.process import triton_interpret

    return triton_interpret()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32))


def device_rows(dev, dims: dict, Ts, budget_s: float) -> list[dict]:
    """Triton vs capturable for every case (also runs on the CPU under the Triton interpreter: the
    dry run of tests/kernels/dense/test_triton_dense.py)."""
    t_end = time.perf_counter() + budget_s
    out: list[dict] = []
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    for T in Ts:
        for op, case, fn, cap, ref, args, kw, by in cases(dims, T, dev, g):
            if time.perf_counter() > t_end:
                out.append({"kernel": f"triton.{op}", "case": case,
                            "error": "skipped: time budget"})
                continue
            try:
                got, want = fn(*args, **kw), cap(*args, **kw)
                same = same_bits(got, want)
                ms = time_ms(lambda: fn(*args, **kw), device=dev)
                base = time_ms(lambda: cap(*args, **kw), device=dev)
                out.append(row(f"triton.{op}", case, ms, bytes=by, baseline="capturable",
                               baseline_ms=base, rel_err=rel_err(got, ref(*args, **kw)),
                               bitwise_capturable=same,
                               notes="bitwise == capturable" if same
                               else "NOT bitwise equal to the capturable version"))
            except Exception as e:  # noqa: BLE001 (keep the other rows)
                out.append({"kernel": f"triton.{op}", "case": case,
                            "error": f"{type(e).__name__}: {e}",
                            "trace": traceback.format_exc(limit=6)})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def cpu_rows() -> list[dict]:
    dev = torch.device("cpu")
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    out = []
    for op, case, _, cap, ref, args, kw, by in cases(TINY, 8, dev, g):
        ms = time_ms(lambda: cap(*args, **kw), device=dev)
        out.append(row(f"capturable.{op}", f"{case} tiny", ms, bytes=by,
                       ref_ms=time_once_ms(lambda: ref(*args, **kw), device=dev),
                       rel_err=rel_err(cap(*args, **kw), ref(*args, **kw))))
    return out


def rows(device, smoke: bool = False) -> list[dict]:
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_rows()
    if smoke:
        return device_rows(device, TINY, (8, 64), 30.0)
    return device_rows(device, V41, (256, 8192), BUDGET_S)
