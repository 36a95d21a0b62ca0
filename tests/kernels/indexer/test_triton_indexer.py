"""kernels/triton lightning-indexer scores vs the reference, and the on-device selection that
follows them (capturable candidate_mask / topk_select on the kernel's scores).

CUDA GPU, or the CPU under TRITON_INTERPRET=1 (small sizes); skipped otherwise. Outputs are
poisoned (NaN) before each launch. Error bound: the reference multiplies in fp32; the kernel's
default tf32x3 products (exact fp32 "ieee" under the interpreter) keep |err| <= 2e-5 (1 + max_row
|ref|); the -inf pattern (visibility) is exact. Selections: identical index sets, except where the
reference's scores at the differing entries tie the k-th best within that bound.
"""
from __future__ import annotations

import pytest
import torch
from cuda_capture import capture
from test_capturable_ops import PADDED
from triton_run import CUDA, DEV, dev_meta, pytestmark, seed  # noqa: F401

from megagraph.kernels.indexer.capturable import candidate_mask, topk_select
from megagraph.kernels.indexer.config import IndexerConfig
from megagraph.kernels.indexer.reference import index_scores as ref_index_scores
from megagraph.kernels.dense.quant import fake_quant

S, HI, DI = 6, 16, 32


def tk():
    from megagraph.kernels.indexer import triton as indexer

    return indexer


def case(g, reqs, ratio, dtype, *, s=S, hi=HI, di=DI, cap=32, mxfp4=False):
    m = dev_meta(reqs)
    T = m["positions"].shape[0]
    qi = torch.randn(T, hi, di, generator=g)
    ikey = torch.randn(s, cap // ratio, di, generator=g)
    if mxfp4:
        qi, ikey = fake_quant(qi, fmt="mxfp4", block=32), fake_quant(ikey, fmt="mxfp4", block=32)
    qi = qi.to(dtype).to(DEV)
    w = torch.randn(T, hi, generator=g).to(dtype).to(DEV)
    return (qi, w, ikey.to(DEV), m["positions"], m["token_req"], m["seq_slots"]), \
        dict(ratio=ratio, weight_scale=(di ** -0.5) * (hi ** -0.5))


def run(args, kw, *, variant=None, precision=None, **opt):
    """index_scores into a poisoned output; variant: the kernel for either kind of products,
    precision: the fp32 products' mode (None: IndexerConfig's defaults)."""
    T, C = args[0].shape[0], args[2].shape[1]
    out = torch.full((T, C), float("nan"), device=DEV)
    over = dict(index_kernel_bf16=variant, index_kernel_fp32=variant) if variant else {}
    if precision:
        over["index_precision"] = precision
    cfg = IndexerConfig(**over)
    got = tk().index_scores(*args, **kw, out=out, kernel_config=cfg, **opt)
    assert not torch.isnan(got).any(), "unwritten scores"
    return got


def check_scores(got, want, tol=2e-5):
    got, want = got.cpu(), want.cpu()
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and (got[~fin] == float("-inf")).all()
    rowmax = torch.where(fin, want.abs(), 0).amax(1, keepdim=True)
    err = torch.where(fin, (got - want).abs(), 0)
    assert (err <= tol * (1 + rowmax)).all()


def check_selection(sel_got, sel_want, scores_ref, tol=2e-5):
    """Same index sets, or differing only in entries whose reference scores tie the k-th best."""
    for r in range(sel_got.shape[0]):
        a = set(sel_got[r].tolist()) - {-1}
        b = set(sel_want[r].tolist()) - {-1}
        if a == b:
            continue
        assert len(a) == len(b)
        row = scores_ref[r]
        kth = row[list(b)].min()
        scale = tol * (1 + row[torch.isfinite(row)].abs().max())
        for j in a ^ b:
            assert (row[j] - kth).abs() <= 2 * scale, (r, j)


def cpu(args):
    return [a.cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else
            (a.cpu() if isinstance(a, torch.Tensor) else a) for a in args]


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_tile", [None, 1, 4])
@pytest.mark.parametrize("variant", ["stream", "tile"])
def test_index_scores_match_reference(ratio, dtype, token_tile, variant):
    g = torch.Generator().manual_seed(seed(ratio, dtype, token_tile, variant))
    args, kw = case(g, PADDED, ratio, dtype)
    got = run(args, kw, token_tile=token_tile, variant=variant)
    check_scores(got, ref_index_scores(*cpu(args), **kw))


# (bt, bc, keys_m, span): spans shorter than a slot's entries, spans not a multiple of the block,
# both MMA orientations, token tiles 1..8 (the long class's 8 included)
STREAM_CONFIGS = [(1, 16, True, 16), (2, 16, False, 48), (4, 32, True, 40), (8, 16, False, 32),
                  (8, 32, True, 1024)]


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("bt,bc,keys_m,span", STREAM_CONFIGS)
def test_stream_launches_match_reference(ratio, bt, bc, keys_m, span):
    """The query-stationary kernel at explicit launches of its long class (the short class at its
    default): several programs per slot (span), the partial last block of a span and of the
    visible prefix, both orientations of the product, two requests in one tile."""
    g = torch.Generator().manual_seed(seed("stream", ratio, bt, bc, keys_m, span))
    # long (>= 8 tokens) and short requests; requests 4 and 3 (13 and 9 tokens) meet inside one
    # tile of 4 or 8 consecutive tokens (the kernel's second pass)
    reqs = [(0, 100, 40), (5, 0, 0), (1, 7, 1), (2, 0, 3), (4, 60, 13), (3, 130, 9), (5, 0, 0)]
    args, kw = case(g, reqs, ratio, torch.float32, cap=160)
    cfg = tk().StreamConfig(bt, bc, keys_m, 4, 2, span)
    got = run(args, kw, variant="stream", config=cfg)
    check_scores(got, ref_index_scores(*cpu(args), **kw))


def test_stream_classes_padded_bucket():
    """The default launches on a captured-bucket layout: two long requests and a decode request
    among many empty request rows (T / R says nothing of the requests' lengths): the long and
    short classes together write every row, each exactly once."""
    g = torch.Generator().manual_seed(seed("classes"))
    reqs = [(0, 60, 24), (1, 3, 1)] + [(5, 0, 0)] * 20 + [(2, 90, 17), (3, 0, 7)]
    args, kw = case(g, reqs, 1, torch.bfloat16, cap=128)
    long, short = tk().stream_configs(args[0].shape[0], len(reqs), 128, "ieee", 1)
    assert (long.bt, short.bt) == (4, 1)
    check_scores(run(args, kw, variant="stream"), ref_index_scores(*cpu(args), **kw))


def test_stream_configs_follow_precision_and_grid():
    """bf16 products take 8-token tiles, others 4; spans never exceed index_span_keys entries in
    the long class and shrink until the grid has index_programs_per_sm programs per SM; both
    follow the config."""
    I, d = tk(), IndexerConfig()
    long, short = I.stream_configs(8192, 8192, 135168, "bf16", 132)
    assert long.bt == 8 and short.bt == 1 and long.span <= d.index_span_keys
    assert long.span % long.bc == 0 and short.span % short.bc == 0
    _, short64 = I.stream_configs(64, 64, 32768, "bf16", 132)
    assert 64 * -(-32768 // short64.span) >= d.index_programs_per_sm * 132
    assert I.stream_configs(4096, 1, 65536, "tf32x3", 132)[0].bt == 4
    narrow = IndexerConfig(index_span_keys=1024)
    assert I.stream_configs(8192, 8192, 135168, "bf16", 132, narrow)[0].span <= 1024 < long.span
    wide = IndexerConfig(index_programs_per_sm=16)
    assert I.stream_configs(64, 64, 32768, "bf16", 132, wide)[1].span < short64.span


@pytest.mark.parametrize("ratio", [1, 2])
def test_selection_on_kernel_scores(ratio):
    """candidate blocks + top-k on the kernel's scores select what the reference selects."""
    g = torch.Generator().manual_seed(seed("sel", ratio))
    args, kw = case(g, PADDED, ratio, torch.bfloat16)
    got = run(args, kw)
    want = ref_index_scores(*cpu(args), **kw)
    mask_g = candidate_mask(got, block=2, topk_blocks=3)
    mask_w = candidate_mask(want.to(DEV), block=2, topk_blocks=3)
    check_selection(topk_select(got, k=5).cpu(), topk_select(want, k=5), want)
    if torch.equal(mask_g.cpu(), mask_w.cpu()):
        check_selection(topk_select(got, mask_g, k=5).cpu(), topk_select(want, mask_w.cpu(), k=5),
                        want.masked_fill(~mask_w.cpu(), float("-inf")))


def test_bf16_precision_exact_on_mxfp4_values():
    """With MXFP4-representable queries and keys (V4.1's quantize_kv) the bf16 mode is exact."""
    g = torch.Generator().manual_seed(9)
    args, kw = case(g, PADDED, 2, torch.bfloat16, mxfp4=True)
    check_scores(run(args, kw, precision="bf16"), ref_index_scores(*cpu(args), **kw), tol=1e-6)


gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@gpu
def test_node_attr_products_bf16_selects_the_bf16_mode():
    """`products="bf16"` (the indexer-products pass's attr) runs the bf16 mode: bitwise the
    explicit index_precision="bf16" result; "fp32" runs the default tf32x3 mode."""
    g = torch.Generator().manual_seed(19)
    args, kw = case(g, PADDED, 2, torch.bfloat16, mxfp4=True)
    assert torch.equal(run(args, kw, products="bf16"), run(args, kw, precision="bf16"))
    assert torch.equal(run(args, kw, products="fp32"), run(args, kw, precision="tf32x3"))


def long_case(g, ratio, contexts, prefill=0, cap=131072):
    reqs = [(i, c, 1) for i, c in enumerate(contexts)] + ([(len(contexts), 8000, prefill)] if prefill else [])
    m = dev_meta(reqs)
    T = m["positions"].shape[0]
    qi = fake_quant(torch.randn(T, 32, 128, generator=g), fmt="mxfp4", block=32).bfloat16().to(DEV)
    ikey = fake_quant(torch.randn(len(reqs), cap // ratio, 128, device=DEV), fmt="mxfp4", block=32)
    w = torch.randn(T, 32, generator=g).bfloat16().to(DEV)
    return (qi, w, ikey, m["positions"], m["token_req"], m["seq_slots"]), \
        dict(ratio=ratio, weight_scale=128 ** -0.5 * 32 ** -0.5)


@gpu
@pytest.mark.parametrize("ratio", [1, 2])
def test_real_dims_long_contexts(ratio):
    """V4.1 dims (32 heads x 128), contexts 1 token .. 128K at group boundaries, a 200-token
    prefill chunk (the stream kernel's long class; the decode rows its short class); both
    kernels vs the capturable kernel (fp32), then the top-512 selections."""
    from megagraph.kernels.indexer.capturable import index_scores as cap

    g = torch.Generator().manual_seed(ratio)
    ctx = [0, 1, 2, 127, 128, 1023, 1024, 8191, 65535, 65536, 131071]
    args, kw = long_case(g, ratio, ctx, prefill=200)
    want = cap(*[a.float() if a.is_floating_point() else a for a in args], **kw)
    for prec in ("tf32x3", "bf16", "ieee"):
        for variant in ("stream", "tile"):
            got = run(args, kw, precision=prec, variant=variant)
            check_scores(got, want)
            check_selection(topk_select(got, k=512).cpu(), topk_select(want, k=512).cpu(),
                            want.cpu())


@gpu
def test_captures_in_cuda_graph():
    g = torch.Generator().manual_seed(4)
    static, kw = long_case(g, 2, [5, 900, 16000, 3], cap=32768)
    fn = lambda: topk_select(tk().index_scores(*static, **kw), k=512)  # noqa: E731
    graph, out = capture(fn)
    new, _ = long_case(torch.Generator().manual_seed(5), 2, [30000, 2, 77, 12345], cap=32768)
    for a, b in zip(static, new):
        a.copy_(b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn())


def test_stream_token_tile_above_long_request_is_an_error():
    g = torch.Generator().manual_seed(3)
    args, kw = case(g, PADDED, 1, torch.float32)
    with pytest.raises(ValueError, match="index_long_request"):
        run(args, kw, variant="stream", token_tile=IndexerConfig().index_long_request * 2)
