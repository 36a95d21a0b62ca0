"""The Triton CSA2 kernels off the GPU: modules import without CUDA (and without triton: the
Triton code is imported only at launch), the registry offers them on sm_90 + triton only and loads
them by name, and on CPU tensors (outside the Triton interpreter) every entry point returns exactly
what the capturable kernel returns."""
from __future__ import annotations


import pytest
import torch
from test_capturable_ops import PADDED, meta

from megagraph.configs.process import triton_interpret
from megagraph.kernels import registry
from megagraph.kernels.capturable_table import CAPTURABLE

ENTRIES = {"sparse_attn": "triton.sparse_attn", "sparse_attn_q": "triton.sparse_attn_q",
           "index_scores": "triton.index_scores", "compressor": "triton.compressor",
           "ring_update_batched": "triton.ring_copy_batched", "ring_update": "triton.ring_update",
           "engram_hash": "triton.engram_hash", "engram_gate": "triton.engram_gate",
           "candidate_mask": "triton.candidate_mask", "topk_select": "triton.topk_select"}
H200 = frozenset({"sm_90", "fp8_e4m3", "deepgemm", "flashmla", "deepep", "triton", "cuda"})


@pytest.mark.parametrize("op", sorted(ENTRIES))
def test_registered_for_hopper_and_loadable(op, monkeypatch):
    # validated on an H200 (registry status "available"): picked without opting in
    name, _ = registry.choose_kernel(op, {}, H200, "sm_90")
    assert name == ENTRIES[op]
    fn = registry.load_impl(name, op)
    assert fn is not None and fn.capturable
    assert registry.choose_kernel(op, {}, frozenset({"cpu"}), "cpu")[0] == "reference"
    # without triton (another CUDA build): the capturable kernel, not a Triton one
    no_triton = H200 - {"triton"}
    assert registry.choose_kernel(op, {}, no_triton, "sm_90")[0] in ("capturable", "reference")


@pytest.mark.skipif(triton_interpret(), reason="CPU tensors run the interpreter")
def test_cpu_tensors_fall_back_to_capturable():
    from test_triton_attention import ROPE, make_inputs

    g = torch.Generator().manual_seed(0)
    args, kw = make_inputs(g, PADDED, "topk", torch.float32)
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]  # CPU even where CUDA is
    for op, extra in (("sparse_attn", {}), ("sparse_attn_q", dict(ROPE, act_fmt="fp8_1x128"))):
        fn = registry.load_impl(ENTRIES[op], op)
        for a, b in zip(fn(*args, **kw, **extra) if extra else (fn(*args, **kw),),
                        CAPTURABLE[op](*args, **kw, **extra) if extra else (CAPTURABLE[op](*args, **kw),)):
            assert torch.equal(a.float(), b.float()), op
    m = meta(PADDED)
    T = m["positions"].shape[0]
    qi, w, ikey = torch.randn(T, 16, 32, generator=g), torch.randn(T, 16, generator=g), torch.randn(6, 16, 32, generator=g)
    a = registry.load_impl(ENTRIES["index_scores"], "index_scores")(
        qi, w, ikey, m["positions"], m["token_req"], m["seq_slots"], ratio=2, weight_scale=0.1)
    b = CAPTURABLE["index_scores"](qi, w, ikey, m["positions"], m["token_req"], m["seq_slots"], ratio=2,
                                   weight_scale=0.1)
    assert torch.equal(a, b)
    ring, kv = torch.randn(6, 8, 32, generator=g), torch.randn(T, 32, generator=g)
    meta3 = (m["positions"], m["token_req"], m["seq_slots"])
    a = registry.load_impl(ENTRIES["ring_update_batched"], "ring_update_batched")(*meta3, ring, kv, window=8)
    assert torch.equal(a[0], CAPTURABLE["ring_update"](ring, kv, *meta3, window=8))
