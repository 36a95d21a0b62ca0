"""CUDA-graph capture of the capturable kernels (skipped without CUDA).

* every op case of test_capturable_ops captured on its own in a CUDA graph and replayed: a kernel
  that syncs with the host or copies a host constant fails inside `torch.cuda.graph` and the test
  names the op; replay == eager on the GPU;
* whole tiny-model steps (decode and mixed shapes, V4.1 and V4) captured and replayed with new
  metadata and state copied into the static input buffers: replay == eager capturable on the
  GPU (1e-5), and == the CPU reference (1e-4, fp32 GEMM reduction order differs between devices);
* the in-place state table captured: replay updates the static state buffers, equal to the
  functional table's state outputs.
"""
from __future__ import annotations

import pytest
import torch
from cuda_capture import capture
from test_capturable_ops import ALL_META, ALL_PLAIN, as_tuple, op_case
from torch.utils._pytree import tree_map

from megagraph.graph.interp import interpret
from megagraph.kernels.reference_table import reference_impls
from megagraph.kernels.capturable_table import CAPTURABLE, capturable_impls
from megagraph.models.session import initial_state, step_metadata
from tests.tiny import SeqChunk, random_tokens, tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"


def to_dev(x):
    return tree_map(lambda a: a.to(DEV) if isinstance(a, torch.Tensor) else a, x)


def close(a, b, tol, what):
    for x, y in zip(as_tuple(a), as_tuple(b), strict=True):
        if x is None:
            assert y is None, what
            continue
        x, y = x.cpu(), y.cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, what
        if x.dtype.is_floating_point:
            torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol, equal_nan=True,
                                       msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(x, y), what


@pytest.mark.parametrize("name", sorted(ALL_PLAIN) + sorted(ALL_META))
def test_op_captures_in_cuda_graph(name):
    op, args, kw = op_case(name)
    static = to_dev(args)
    fn = CAPTURABLE[op]
    # functional kernels never write their inputs, so replay reads the same static args
    graph, out = capture(lambda: fn(*static, **kw))
    graph.replay()
    torch.cuda.synchronize()
    close(out, fn(*static, **kw), 1e-5, name)


V41, V4 = "v4.1-flash-tiny", "v4-flash-tiny"


def step_inputs(g, consts, cap, chunks, cached, seed):
    state = initial_state(g, slots=4, capacity=cap)
    gen_ = torch.Generator().manual_seed(seed)
    for k, v in state.items():  # arbitrary but valid-dtype state contents
        if v.dtype.is_floating_point:
            state[k] = torch.randn(v.shape, generator=gen_).to(v.dtype)
    return {**step_metadata(chunks, cached), **state, **consts}


@pytest.mark.parametrize("name", [V41, V4])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("inplace", [False, True])
def test_model_step_captures_and_replays(name, kind, inplace):
    _, g, w, consts = tiny(name, "f32", 0, **({} if name == V4 else {"quantize_kv": False}))
    cap = 64 if name == V41 else 256
    wd = to_dev(dict(w))
    impls = capturable_impls(inplace_state=inplace)
    cached = {0: 20, 1: 7, 2: 33, 3: 1}

    def chunks(seed):
        if kind == "decode":
            return [SeqChunk(s, random_tokens(1, seed + s)) for s in range(4)]
        return [SeqChunk(0, random_tokens(1, seed)), SeqChunk(2, random_tokens(9, seed + 1)),
                SeqChunk(3, random_tokens(1, seed + 2))]

    static = to_dev(step_inputs(g, consts, cap, chunks(0), cached, 0))
    graph, out = capture(lambda: interpret(g, static, wd, impls, check_types=False))
    for seed in (1, 2):
        new = step_inputs(g, consts, cap, chunks(10 * seed), cached, seed)
        for k in static:
            static[k].copy_(new[k].to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        want = interpret(g, to_dev(new), wd, CAPTURABLE)
        ref = interpret(g, new, w, reference_impls())
        for k in want:
            close(out[k], want[k], 1e-5, f"{k} vs eager")  # in place: out[k] is the static buffer
            close(out[k], ref[k], 1e-4, f"{k} vs CPU reference")
        if inplace:
            aliased = [k for k in g.state_labels if out[k] is static[k]]
            assert aliased and "engram_hist" not in aliased
