"""torch.compile (Inductor) of the runtime's segments gives the eager segments' logits (CPU).

Inductor once turned quantize_act's zero-padded partial block into NaN E4M3 codes (the h200 plan
quantizes activations to FP8 1x128 and the tiny model's widths are not multiples of 128); on the
H200 the compiled tiny model's tokens then disagreed with eager. Here the whole h200 plan of the
tiny V4.1 runs on the CPU (Triton kernels fall back to the capturable ones, kept opaque as on the
GPU), compiled and not: the logits must agree to fp32 summation order (1e-4), and a fast op-level
check pins quantize_act bitwise. Compiling the tiny step takes about a minute on two cores."""

from __future__ import annotations

import pytest
import torch

from megagraph.kernels.fused.capturable import quantize_act
from tests.runtime.conftest import make_engine
from tests.tiny import SeqChunk, random_tokens

STEPS = [[SeqChunk(0, random_tokens(11, 1)), SeqChunk(1, random_tokens(7, 2))],
         [SeqChunk(0, (17,)), SeqChunk(1, (23,))],
         [SeqChunk(0, (5,)), SeqChunk(1, (6,))]]


@pytest.mark.parametrize("width", [192, 256, 40, 300])
def test_quantize_act_compiles_bitwise(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(18, width, generator=g) * 3
    torch._dynamo.reset()
    got = torch.compile(lambda t: quantize_act(t, act_fmt="fp8_1x128"))(x)
    want = quantize_act(x, act_fmt="fp8_1x128")
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def test_compiled_engine_equals_eager(compiled):
    model = "v4.1-flash-tiny"
    path = compiled(model, hw="h200")
    torch._dynamo.reset()
    outs = {}
    for backend in ("none", "inductor"):
        eng = make_engine(path, model, allow_fallback=True, compile=backend, buckets=(4, 32))
        outs[backend] = [eng.step(c) for c in STEPS]
    for a, b in zip(outs["none"], outs["inductor"], strict=True):
        assert not torch.isnan(b).any()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_numerics_options_ask_inductor_for_eager_rounding():
    """`eager` numerics (the default) ask Inductor for correctly rounded fp32 division and eager's
    bf16 casts wherever this torch has the knobs (Triton's `/` is approximate on CUDA: docs/
    compile.md); `fast` and non-Inductor backends ask for nothing; the options are ones
    torch.compile accepts."""
    from megagraph.runtime.compile import check_numerics, numerics_options

    eager = numerics_options("inductor", "eager")
    cfg = torch._inductor.config
    has_div = hasattr(getattr(cfg, "eager_numerics", None), "division_rounding") or \
        hasattr(cfg, "emulate_divison_rounding")
    assert has_div == any("divi" in k for k in eager)
    assert eager.get("emulate_precision_casts", False) == hasattr(cfg, "emulate_precision_casts")
    assert numerics_options("inductor", "fast") == {}
    assert numerics_options("eager", "eager") == {}
    with pytest.raises(ValueError, match="unknown compile numerics 'exact'"):
        check_numerics("exact")
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: a / b, backend="inductor", options=eager or None)
    a, b = torch.randn(64), torch.randn(64) + 5
    assert torch.equal(f(a, b), a / b)


def test_cli_passes_compile_numerics():
    import argparse

    from megagraph.runtime.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["generate", "art", "--prompt", "x", "--compile", "inductor",
                         "--compile-numerics", "fast"])
    assert args.compile_numerics == "fast" and args.compile == "inductor"
    assert p.parse_args(["generate", "art", "--prompt", "x"]).compile_numerics == "eager"
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "art", "--prompt", "x", "--unverified-compile"])


@pytest.mark.parametrize("trace_loops", [False, True])
def test_tile_loop_kernels_stay_untraced(compiled, monkeypatch, trace_loops):
    """torch.compile calls the capturable tile-loop kernels (attention, indexer, MoE) as they are
    unless `compile_tile_loops`: Dynamo would unroll hundreds of chunks at V4.1 sizes; the ops
    Inductor miscompiles on CUDA (topk_select) always so. (The cpu
    plan's one segment is marked `graph` so that it is wrapped; `wrap` itself is recorded.)"""
    import dataclasses

    from megagraph.kernels.capturable_table import INDUCTOR_UNSAFE_OPS, TILE_LOOP_OPS
    from megagraph.runtime import compile as rc
    from megagraph.runtime.engine import Engine, EngineConfig
    from megagraph.runtime.plan import RunPlan, SegmentPlan

    plan = RunPlan.from_artifacts(compiled("v4.1-flash-tiny"))
    plan = dataclasses.replace(plan, segments=(
        SegmentPlan(0, "graph", tuple(range(len(plan.graph.nodes)))),))
    seen = []
    monkeypatch.setattr(rc, "wrap", lambda fn, *a, **k: seen.append(set(a[-1])) or fn)
    Engine(plan, None, EngineConfig(max_slots=2, capacity=64, buckets=(4,), compile="eager",
                                    kernels="capturable", progress=False,
                                    compile_tile_loops=trace_loops))
    loops = {n.outputs[0] for n in plan.graph.nodes if n.op in TILE_LOOP_OPS}
    unsafe = {n.outputs[0] for n in plan.graph.nodes if n.op in INDUCTOR_UNSAFE_OPS}
    assert loops and unsafe and len(seen) == 1
    assert loops <= seen[0] if not trace_loops else not (loops & seen[0])
    assert unsafe <= seen[0]  # never traced, whatever the flag


def test_recompile_inside_capture_is_named():
    """GraphRunner.capture runs compiled segments under _no_recompiles: a recompile there (which
    would break the CUDA-graph capture with an opaque CUDA error) raises a RecompileError that
    names the failing guard; uncompiled runners are not affected."""
    from megagraph.runtime.cuda_graphs import RecompileError, _no_recompiles

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    f(torch.ones(3))
    with _no_recompiles(False):
        f(torch.ones(5))
    with pytest.raises(RecompileError, match="size mismatch"), _no_recompiles(True):
        f(torch.ones(4))


def test_each_engine_adds_its_own_recompile_allowance(compiled):
    """Dynamo's recompile limit counts per frame over the whole process: a second engine in the
    same process must not push shared frames past it (they would run uncompiled, silently)."""
    path = compiled("v4.1-flash-tiny", hw="h200")  # the cpu plan has no graph segments
    cfg = torch._dynamo.config
    conf = dict(allow_fallback=True, compile="eager", buckets=(4,))
    with cfg.patch(recompile_limit=8):
        make_engine(path, "v4.1-flash-tiny", **conf)
        first = cfg.recompile_limit
        make_engine(path, "v4.1-flash-tiny", **conf)
        assert first > 8 and cfg.recompile_limit - first == first - 8
