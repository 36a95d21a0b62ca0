"""kernels/triton sparse attention with sink (sparse_attn, sparse_attn_q) vs the reference.

Runs on a CUDA GPU, or on the CPU under the Triton interpreter (`TRITON_INTERPRET=1 pytest
tests/kernels/attention/test_triton_attention.py`, small sizes only); skipped otherwise.

Every check draws fresh random inputs and poisons the outputs (NaN) before the launch, so an
unwritten element fails. Layouts: the ragged, padded step of test_capturable_ops (pad requests on a
shared scratch slot, an empty request row, prefill chunks next to decode rows, contexts that start
mid-ring); on the GPU also V4.1's real dims (64 heads x 512, window 128, top-512) at contexts from
1 token to 128K with positions at compression-group boundaries.

Error bounds (outputs vs the reference's fp32 math on the same inputs, upcast):
* fp32 inputs: exact fp32 products -> |err| <= 1e-5 (1 + max|ref|);
* bf16 inputs: bf16 tensor-core products with the softmax weights rounded to bf16 (2^-9) and a
  bf16 output -> ||err|| <= 1e-2 ||ref|| and |err| <= 2e-2 max|ref| per token;
* sparse_attn_q (rounded to q's dtype before and after the inverse RoPE, like the reference, then
  quantized): per element |dequant - ref| <= (2^-4 + 2^-8) |ref| + 2^-9 s + e_attn * amax(block),
  ref the fp32 reference, s the block scale (E4M3 half-ulp + a bf16 rounding, subnormal step) and
  e_attn the attention bound above. Against the reference fused op on the same inputs, at least
  99% of the E4M3 codes and scales are equal with exact products (fp32 inputs, or the
  interpreter), 90% with the GPU's bf16 products.
"""
from __future__ import annotations


import pytest
import torch
from cuda_capture import capture
from test_capturable_ops import PADDED, REAL, real_rows
from triton_run import CUDA, DEV, INTERP, dev_meta, pytestmark, seed  # noqa: F401

from megagraph.kernels.attention.reference import sparse_attn as ref_sparse_attn
from megagraph.kernels.fused.reference import dequant_act, sparse_attn_q as ref_sparse_attn_q
from megagraph.kernels.dense.rope import rope as ref_rope

ROPE = dict(rope_dim=64, theta=160000.0, yarn_factor=16.0, yarn_original=65536, yarn_beta_fast=32.0,
            yarn_beta_slow=1.0)
S, W, H, D, C, K = 6, 8, 16, 128, 20, 6


def ta():
    from megagraph.kernels.attention import triton as attention

    return attention


def make_inputs(g, reqs, mode, dtype, *, s=S, w=W, h=H, d=D, c=C, k=K, ratio=2):
    m = dev_meta(reqs)
    T = m["positions"].shape[0]
    rn = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEV)  # noqa: E731
    q, kv, ring = rn(T, h, d) * 2, rn(T, d), rn(s, w, d)
    ckv = rn(s, c, d) if mode != "window" else None
    topk = torch.randint(-1, c, (T, k), generator=g).to(DEV) if mode == "topk" else None
    sink = torch.randn(h, generator=g).to(DEV)
    args = (q, kv, ring, ckv, topk, sink, m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"])
    kw = dict(window=w, scale=d ** -0.5, ratio=ratio if mode != "window" else 0,
              attend_all_compressed=mode == "all")
    return args, kw


def upcast(args):
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def run(args, kw, *, quant=None, splits=0, act_fmt="fp8_1x128", pipe=False):
    """Launch with NaN-poisoned outputs; returns the outputs (checked fully written)."""
    A = ta()
    q = args[0]
    T, h, d = q.shape
    if quant:
        o = torch.full((T, h * d), float("nan"), device=DEV).to(torch.float8_e4m3fn)
        nb = h * d // A.ACT_BLOCKS[act_fmt]
        sc = torch.full((T, nb), 255, dtype=torch.uint8, device=DEV) if act_fmt == "mxfp8" else \
            torch.full((T, nb), float("nan"), device=DEV)
        out = (o, sc)
    else:
        out = (torch.full((T, h, d), float("nan"), dtype=q.dtype, device=DEV),)
    res = A.launch(*args, window=kw["window"], scale=kw["scale"], ratio=kw["ratio"],
                   attend_all=kw["attend_all_compressed"],
                   quant=(act_fmt, ROPE) if quant else None, 
                   launch_shape=A.AttnLaunch(splits=splits, pipe=pipe),
                   out=out)
    if quant:
        o, sc = res
        assert not torch.isnan(o.float()).any(), "unwritten o_q"
        if sc.dtype == torch.float8_e8m0fnu:
            assert not (sc.view(torch.uint8) == 255).any(), "unwritten scales"
        else:
            assert not torch.isnan(sc).any(), "unwritten scales"
        return o, sc
    assert not torch.isnan(res.float()).any(), "unwritten output"
    return res


def attn_bound(dtype, ref):
    return 1e-5 * (1 + ref.abs().max().item()) if dtype == torch.float32 else 2e-2 * ref.abs().max().item()


def check_plain(got, want, dtype):
    got, want = got.float().cpu(), want.float().cpu()
    err = (got - want).abs()
    if dtype == torch.float32:
        assert err.max().item() <= 1e-5 * (1 + want.abs().max().item())
    else:
        assert (got - want).norm() <= 1e-2 * want.norm() + 1e-6
        per_tok = err.flatten(1).amax(1) <= 2e-2 * want.flatten(1).abs().amax(1) + 1e-6
        assert per_tok.all()


def check_quant(o, sc, want_rot, dtype, act_fmt):
    """want_rot: fp32 reference attention output after the inverse RoPE, [T, H*D]."""
    b = 128 if act_fmt == "fp8_1x128" else 32
    deq = dequant_act(o.cpu(), sc.cpu(), act_fmt=act_fmt)
    ref = want_rot.float().cpu()
    s = (dequant_act(torch.ones_like(o.cpu(), dtype=torch.float32).to(torch.float8_e4m3fn), sc.cpu(),
                     act_fmt=act_fmt))
    amax = ref.reshape(ref.shape[0], -1, b).abs().amax(-1, keepdim=True).expand(-1, -1, b).reshape(ref.shape)
    e_attn = 1e-5 if dtype == torch.float32 else 2e-2
    bound = (2.0 ** -4 + 2.0 ** -8) * ref.abs() + 2.0 ** -9 * s + e_attn * amax + 1e-6
    assert ((deq - ref).abs() <= bound).all()


@pytest.mark.parametrize("mode", ["window", "topk", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pipe", [False, True])
def test_sparse_attn_matches_reference(mode, dtype, splits, pipe):
    """pipe: the top-k loop without its empty-tile skip (AttnLaunch.pipe); the cases' top-k rows
    hold -1 and out-of-range entries, so whole empty tiles run through the products."""
    g = torch.Generator().manual_seed(seed(mode, dtype, splits))
    args, kw = make_inputs(g, PADDED, mode, dtype)
    got = run(args, kw, splits=splits, pipe=pipe)
    want = ref_sparse_attn(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in upcast(args)], **kw)
    check_plain(got, want, dtype)


@pytest.mark.parametrize("mode", ["window", "topk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_fmt", ["fp8_1x128", "mxfp8"])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("pipe", [False, True])
def test_sparse_attn_q_matches_reference(mode, dtype, act_fmt, splits, pipe):
    g = torch.Generator().manual_seed(seed(mode, dtype, act_fmt, splits))
    args, kw = make_inputs(g, PADDED, mode, dtype)
    o, sc = run(args, kw, quant=True, splits=splits, act_fmt=act_fmt, pipe=pipe)
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in upcast(args)]
    want = ref_sparse_attn(*cpu, **kw)
    want_rot = ref_rope(want, cpu[6], inverse=True, **ROPE).reshape(want.shape[0], -1)
    check_quant(o, sc, want_rot, dtype, act_fmt)
    # vs the reference fused op on the same (not upcast) inputs: same rounding points, so the codes
    # agree except where the kernel's bf16 products move a value across a rounding midpoint
    rq, rs = ref_sparse_attn_q(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], **kw,
                               **ROPE, act_fmt=act_fmt)
    exact = dtype == torch.float32 or INTERP
    assert (o.cpu().float() == rq.float()).float().mean() >= (0.99 if exact else 0.9)
    same_s = sc.cpu().view(torch.uint8) == rs.view(torch.uint8) if act_fmt == "mxfp8" else sc.cpu() == rs
    assert same_s.float().mean() >= (0.99 if exact else 0.9)


def test_public_entry_points_match_launch():
    """sparse_attn / sparse_attn_q (the registered functions) route to the kernel."""
    A = ta()
    g = torch.Generator().manual_seed(7)
    args, kw = make_inputs(g, PADDED, "topk", torch.bfloat16)
    plain = A.sparse_attn(*args, **kw)
    check_plain(plain, ref_sparse_attn(*[a.cpu() if isinstance(a, torch.Tensor) else a
                                         for a in upcast(args)], **kw), torch.bfloat16)
    o, sc = A.sparse_attn_q(*args, **kw, **ROPE, act_fmt="fp8_1x128")
    assert o.shape == (args[0].shape[0], H * D) and o.dtype == torch.float8_e4m3fn
    assert sc.shape == (args[0].shape[0], H * D // 128) and sc.dtype == torch.float32


@pytest.mark.parametrize("quant", [False, True])
def test_pad_requests_do_not_change_real_rows(quant):
    """The real requests' rows are the same with and without pad requests on the scratch slot."""
    g = torch.Generator().manual_seed(11)
    args_p, kw = make_inputs(g, PADDED, "topk", torch.float32)
    rows, rrows = real_rows(PADDED, REAL)
    rows, rrows = rows.to(DEV), rrows.to(DEV)
    m = dev_meta(REAL)
    args_r = (args_p[0][rows], args_p[1][rows], args_p[2], args_p[3], args_p[4][rows], args_p[5],
              m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"])
    a = run(args_p, kw, quant=quant, splits=2)
    b = run(args_r, kw, quant=quant, splits=2)
    if quant:
        assert torch.equal(a[0][rows].float(), b[0].float()) and torch.equal(a[1][rows], b[1])
    else:
        torch.testing.assert_close(a[rows], b, rtol=1e-6, atol=1e-6)


def test_no_tokens():
    A = ta()
    g = torch.Generator().manual_seed(3)
    args, kw = make_inputs(g, [(0, 5, 0)], "topk", torch.bfloat16)
    assert A.sparse_attn(*args, **kw).shape == (0, H, D)
    o, sc = A.sparse_attn_q(*args, **kw, **ROPE, act_fmt="fp8_1x128")
    assert o.shape == (0, H * D) and sc.shape == (0, H * D // 128)


# ---------------------------------------------------------------------------------------------
# GPU only: V4.1 dims, long contexts, CUDA-graph capture
# ---------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
V41 = dict(h=64, d=512, w=128, k=512)


def long_context_case(g, ratio, contexts, prefill=0, k=512, c_cap=131072):
    """Decode rows at the given cached contexts (+ one prefill chunk of `prefill` tokens), each
    slot's top-k = a sorted random subset of its visible entries (-1 padded)."""
    reqs = [(i, c, 1) for i, c in enumerate(contexts)]
    if prefill:
        reqs.append((len(contexts), 8000, prefill))
    m = dev_meta(reqs)
    T = m["positions"].shape[0]
    s, C = len(reqs), c_cap // ratio
    q = torch.randn(T, 64, 512, generator=g).bfloat16().to(DEV) * 2
    kv = torch.randn(T, 512, generator=g).bfloat16().to(DEV)
    ring = torch.randn(s, 128, 512, generator=g).bfloat16().to(DEV)
    ckv = torch.randn(s, C, 512, device=DEV, dtype=torch.bfloat16)
    vis = ((m["positions"] + 1) // ratio).clamp(max=C)
    r = torch.rand(T, C, device=DEV)
    r = torch.where(torch.arange(C, device=DEV)[None, :] < vis[:, None], r, -1.0)
    vals, idx = r.topk(k, dim=-1)
    topk = torch.where(vals >= 0, idx, -1)
    perm = torch.randperm(k, generator=g).to(DEV)
    topk = topk[:, perm]  # unsorted rows: the kernel wrapper sorts
    sink = torch.randn(64, generator=g).to(DEV)
    args = (q, kv, ring, ckv, topk, sink, m["positions"], m["token_req"], m["seq_slots"], m["seq_cached"])
    return args, dict(window=128, scale=512 ** -0.5, ratio=ratio, attend_all_compressed=False)


@gpu
@pytest.mark.parametrize("ratio", [1, 2])
def test_real_dims_long_contexts(ratio):
    """1 token .. 128K contexts, positions at and next to group boundaries, plus a 300-token
    prefill chunk; vs the capturable kernel (fp32 math; itself tested against the reference)."""
    from megagraph.kernels.attention.capturable import sparse_attn as cap
    from megagraph.kernels.dense.capturable import rope as cap_rope

    g = torch.Generator().manual_seed(ratio)
    ctx = [0, 1, 2, 126, 127, 128, 129, 1023, 1024, 8191, 32767, 65535, 65536, 131070, 131071]
    args, kw = long_context_case(g, ratio, ctx, prefill=300)
    want = cap(*upcast(args), **kw)
    for splits in (0, 1):
        got = run(args, kw, splits=splits)
        check_plain(got, want, torch.bfloat16)
        o, sc = run(args, kw, quant=True, splits=splits)
        want_rot = cap_rope(want, args[6], inverse=True, **ROPE).reshape(want.shape[0], -1)
        check_quant(o, sc, want_rot, torch.bfloat16, "fp8_1x128")


@gpu
def test_captures_in_cuda_graph():
    """sparse_attn_q captured at decode shapes and replayed on new metadata, inputs and state."""
    A = ta()
    g = torch.Generator().manual_seed(5)
    ctx = [3, 700, 4095, 9000]
    static, kw = long_context_case(g, 2, ctx, c_cap=16384)
    fn = lambda: A.sparse_attn_q(*static, **kw, **ROPE, act_fmt="fp8_1x128")  # noqa: E731
    graph, out = capture(fn)
    for seed, new_ctx in ((6, [10, 11, 12, 13]), (7, [5000, 1, 16000, 129])):
        new, _ = long_context_case(torch.Generator().manual_seed(seed), 2, new_ctx, c_cap=16384)
        for a, b in zip(static, new):
            if isinstance(a, torch.Tensor):
                a.copy_(b)
        graph.replay()
        torch.cuda.synchronize()
        o, sc = A.sparse_attn_q(*static, **kw, **ROPE, act_fmt="fp8_1x128")
        assert torch.equal(out[0].float(), o.float()) and torch.equal(out[1], sc)
