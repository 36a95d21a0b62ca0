"""quantize-epilogues: the stated error bound, per element and per quantized GEMM, and where the
pass fires (MXFP8 on Blackwell, FP8 1x128 on Hopper, nothing on CPU)."""

import pytest
import torch

from megagraph.graph.interp import interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.kernels.fused.reference import dequant_act, grouped_linear_q, linear_q, quantize_act
from megagraph.kernels.gemm.reference import dequantize_weight, grouped_linear, linear
from megagraph.models.session import initial_state, step_metadata
from megagraph.passes import load_hw_profile
from megagraph.passes.quantize_epilogues import QuantizeEpilogues
from tests.passes.helpers import compiled_f32, model_params
from tests.tiny import SeqChunk, random_tokens, tiny

# |x - dequant(quantize(x))| <= REL * |x| + SUB * scale  (E4M3: 3 mantissa bits, subnormal step 2^-9)
REL, SUB = 2.0**-4, 2.0**-10


def _scales(q, s, act_fmt):
    block = 32 if act_fmt == "mxfp8" else 128
    sf = dequant_act(torch.ones_like(q, dtype=torch.float32).to(torch.float8_e4m3fn), s, act_fmt=act_fmt)
    return sf, block


def elementwise_bound(x: torch.Tensor, act_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(|error|, bound) of quantizing x."""
    q, s = quantize_act(x, act_fmt=act_fmt)
    scale, _ = _scales(q, s, act_fmt)
    err = (dequant_act(q, s, act_fmt=act_fmt) - x.float()).abs()
    return err, REL * x.float().abs() + SUB * scale


@pytest.mark.parametrize("act_fmt,d", [("mxfp8", 64), ("mxfp8", 4096), ("fp8_1x128", 64),
                                       ("fp8_1x128", 640)])
def test_quantize_act_error_bound(act_fmt, d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(37, d, generator=g) * torch.logspace(-6, 3, d)  # wide dynamic range per row
    x[0] = 0.0  # an all-zero row: scale floor, no NaN
    x[1, :5] = torch.tensor([448.0, -1e-9, 3e4, 1e-30, -7.5])
    err, bound = elementwise_bound(x, act_fmt)
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max()}"
    q, s = quantize_act(x, act_fmt=act_fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    if act_fmt == "mxfp8":
        assert s.dtype == torch.float8_e8m0fnu and s.shape == (37, d // 32)
    else:
        assert s.dtype == torch.float32 and s.shape == (37, -(-d // 128))
        m, _ = torch.frexp(s)
        assert bool((m == 0.5).all()), "fp8_1x128 scales are powers of two"


def _all_values(cfg, g, w, consts):
    """Every value of a prefill step (two requests) of graph g."""
    chunks = [SeqChunk(0, random_tokens(20, 5)), SeqChunk(1, random_tokens(7, 6))]
    inputs = {**step_metadata(chunks, {}), **initial_state(g, slots=2, capacity=128), **consts}
    names = tuple(o for n in g.nodes for o in n.outputs)
    return interpret(g, inputs, w, reference_impls(), keep=names)


@pytest.mark.parametrize("hw", ("gb300", "h200"))
@pytest.mark.parametrize("model", model_params())
def test_every_quantized_gemm_within_bound(model, hw):
    """On the values of the unquantized graph, each quantize epilogue errs within the elementwise
    bound, and each quantized linear / grouped linear within sum_k |W_jk| * bound_k."""
    cfg, w, consts, stages = compiled_f32(model, hw)
    names = [n for n, _ in stages]
    i = names.index("quantize-epilogues")
    before, after = stages[i - 1][1], stages[i][1]
    vals = _all_values(cfg, before, w, consts)
    gemms = 0
    for n in after.nodes:
        if not n.op.endswith("_q") or n.op == "sparse_attn_q":
            continue
        act = n.attr("act_fmt")
        v = n.inputs[0].removesuffix(".q")
        x = vals[v]
        err, bound = elementwise_bound(x, act)
        assert bool((err <= bound).all()), f"%{v}: quantization error above the bound"
        if n.op not in ("linear_q", "grouped_linear_q"):
            continue
        q, s = quantize_act(x, act_fmt=act)
        wt, ws = (w[n.inputs[2]], w[n.inputs[3]] if n.inputs[3] else None)
        fmt = n.attr("fmt")
        wabs = dequantize_weight(wt, ws, fmt).abs()
        if n.op == "linear_q":
            y_q = linear_q(q, s, wt, ws, fmt=fmt, act_fmt=act, out_dtype="f32")
            lim = linear(bound, wabs, None, fmt="dense") + 1e-5 * linear(x.abs(), wabs, None, fmt="dense")
        else:
            gr = n.attr("groups")
            y_q = grouped_linear_q(q, s, wt, ws, groups=gr, fmt=fmt, act_fmt=act, out_dtype="f32")
            lim = (grouped_linear(bound, wabs, None, groups=gr, fmt="dense")
                   + 1e-5 * grouped_linear(x.abs(), wabs, None, groups=gr, fmt="dense"))
        y = vals[n.outputs[0]].float()
        assert bool(((y_q - y).abs() <= lim + 1e-6).all()), f"{n.op} -> %{n.outputs[0]} above the bound"
        gemms += 1
    assert gemms > 10


def test_fires_per_profile():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    cpu = QuantizeEpilogues(load_hw_profile("cpu")).run(g)
    assert cpu.graph is g and cpu.skipped and "no FP8 tensor cores" in cpu.note
    gb = QuantizeEpilogues(load_hw_profile("gb300")).run(g)
    ops = gb.graph.op_counts()
    assert "mxfp8" in gb.note and ops["sparse_attn_q"] == 9 and "sparse_attn" not in ops
    assert "grouped_linear" not in ops and ops["grouped_linear_q"] == 9
    h = QuantizeEpilogues(load_hw_profile("h200")).run(g)
    ops = h.graph.op_counts()
    assert "fp8_1x128" in h.note and "no MXFP8 tensor cores" in h.note
    assert ops["sparse_attn"] == 9 and "sparse_attn_q" not in ops  # standalone quantize on Hopper
    # dense (bf16) GEMMs keep their unquantized input: the router and the compressor projections
    assert ops["route"] == 9 and all(n.inputs[0].endswith(".q") is False
                                     for n in h.graph.nodes if n.op in ("route", "linear"))


def test_targets_option_restricts_sites():
    _, g, _, _ = tiny("v4.1-flash-tiny", "bf16")
    r = QuantizeEpilogues(load_hw_profile("gb300"), targets=("grouped_linear",)).run(g)
    ops = r.graph.op_counts()
    assert ops["grouped_linear_q"] == 9 and "linear_q" not in ops and "quantize_act" not in ops
