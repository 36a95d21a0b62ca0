"""Inputs, fp32 reference and diagnostics shared by the Gluon L1 tests (test_moe_gluon_decode.py,
test_moe_gluon_ws.py) and the Gluon L2 tests (test_moe_gluon_l2.py: prefill,
test_moe_gluon_decode_l2.py: decode; l2_case, l2_reference), and the SASS check of their K
loops' proxy-fence order (proxy_fence_problems).

Why one module: the L1 kernels compute the same SwiGLU of W1 / W3 on MXFP4 weights and gathered
E4M3 activations, and both L2 kernels the same weighted scatter of H W2^T, so each pair is held
to the same exact dequantization, the same fp32 math and the same failure report; one copy keeps
the two tests' yardsticks identical. Imported as a sibling (`from gluon_cases import ...`:
pytest puts tests/kernels on sys.path).
"""
from __future__ import annotations

import re

import pytest
import torch
from cuda_capture import capture
from sm90_build import count

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# the argument types of both L1 kernels (l1_kernel, l1_decode_kernel) for the sm_90 build tests
TYPES = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", aidx_ptr="*i32", b1_ptr="*i8", bs1_ptr="*u8",
             b2_ptr="*i8", bs2_ptr="*u8", c_ptr="*fp16", work_ptr="*i32", MT="i32", N="i32",
             G="i32", P="i32", K="i32", limit="fp32", stride_am="i32", stride_as="i32",
             stride_bg="i32", stride_bn="i32", stride_bsg="i32", stride_bsn="i32",
             stride_cm="i32")


def gluon_gpu(kernels):
    """The `gpu` decorator of the GPU tests of a Gluon kernel module: pytest.mark.gpu, and
    skipped unless kernels.available() (CUDA sm_90 and Triton 3.6's Gluon)."""
    ok = kernels.available()

    def gpu(test):
        return pytest.mark.gpu(pytest.mark.skipif(not ok, reason="needs CUDA sm_90 and "
                                                  "Triton 3.6 Gluon")(test))
    return gpu


def gluon_build(kernels):
    """The `build` mark of the tests that compile a Gluon kernel module's kernels ahead of time
    for sm_90 on the CPU: skipped unless kernels._IMPORT_OK (Triton 3.6's Gluon importable)."""
    return pytest.mark.skipif(not kernels._IMPORT_OK, reason="needs Triton 3.6 with Gluon "
                              "(make sm90-h200)")


def mxfp4_f32(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[E, N, K/2] int8 codes (low nibble = even column) x E8M0 [E, N, K/32] -> fp32 [E, N, K]."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], device=w.device)
    b = w.view(torch.uint8).long()
    v = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)
    sc = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, dim=-1)
    return v * sc


def case(T, E, d, F, k, seed, subset=None, exps=(119, 125), distinct=False):
    """Random E4M3 activations (power-of-two scales per 128), MXFP4 W1 / W3 (exponents in
    [exps[0], exps[1])), random top-k routing from `subset` if given (the other experts stay
    empty): with replacement (a token may pick an expert twice), or `distinct` experts per
    token (the top-k of random scores, as a router). On the GPU: (xq, xs, w1, w3, counts, srt)."""
    from megagraph.kernels.moe import triton as moe

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    xb = x.view(T, d // 128, 128)
    sc = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1).clamp_min(1e-4) / 448)))
    xq = (xb / sc[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(T, d).cuda()
    xs = sc.float().cuda()

    def bank():
        w = torch.randint(-128, 128, (E, F, d // 2), dtype=torch.int8, generator=g)
        s = torch.randint(*exps, (E, F, d // 32), dtype=torch.uint8, generator=g)
        return moe.bank(w.cuda(), s.view(torch.float8_e8m0fnu).cuda(), "mxfp4")

    w1, w3 = bank(), bank()
    pool = torch.tensor(subset) if subset else torch.arange(E)
    if distinct:
        ids = pool[torch.rand(T, len(pool), generator=g).topk(k, dim=1).indices].cuda()
    else:
        ids = pool[torch.randint(0, len(pool), (T, k), generator=g)].cuda()
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    srt = moe.permute(ids.flatten(), counts, E)
    return xq, xs, w1, w3, counts, srt


def explicit_rows(rows, T, k, seed):
    """Sorted-row pairs for EXPLICIT rows per expert (`rows`, zeros = empty experts): sorted row
    r is pair idx[r] of T tokens x top-k, a random choice of distinct pairs. On the GPU:
    (idx int32 [sum(rows)], counts int32 [len(rows)])."""
    P = sum(rows)
    assert P <= T * k
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randperm(T * k, generator=g)[:P].to(torch.int32).cuda()
    return idx, torch.tensor(rows, dtype=torch.int32, device="cuda")


def rows_case(rows, T, k, d, F, seed, exps=(119, 125)):
    """case()'s data with explicit rows per expert (explicit_rows): sorted row r gathers A row
    a_idx[r] // k. On the GPU: (xq, xs, w1, w3, counts, a_idx)."""
    xq, xs, w1, w3, _, _ = case(T, len(rows), d, F, k, seed=seed, exps=exps)
    a_idx, counts = explicit_rows(rows, T, k, seed)
    return xq, xs, w1, w3, counts, a_idx


def reference(xq, xs, w1, w3, counts, srt, topk, limit):
    """fp32 H of the sorted rows: swiglu(A W1^T, A W3^T) on the exactly dequantized operands."""
    a = (xq.float().view(xq.shape[0], -1, 128) * xs[..., None]).view(xq.shape[0], -1)
    W1, W3 = mxfp4_f32(w1.w, w1.s), mxfp4_f32(w3.w, w3.s)
    rows = a[srt.long() // topk]
    out = torch.empty(rows.shape[0], W1.shape[1], device=xq.device)
    r0 = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            gt = rows[r0:r0 + c] @ W1[e].T
            up = (rows[r0:r0 + c] @ W3[e].T).clamp(-limit, limit)
            gt = gt.clamp(max=limit)
            out[r0:r0 + c] = gt * torch.sigmoid(gt) * up
        r0 += c
    return out


def rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


def sort_pairs(ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The expert-sorted pair list: moe.permute on the GPU, a stable argsort elsewhere (the same
    groups; the order inside a group may differ, which no output depends on)."""
    if ids.is_cuda:
        from megagraph.kernels.moe import triton as moe

        return moe.permute(ids.flatten(), counts, counts.numel())
    return torch.argsort(ids.flatten(), stable=True).to(torch.int32)


def l2_case(T, E, d, F, k, seed, subset=None, exps=(119, 125), device="cuda", scale=2.0,
            wts_lo=0.0):
    """The L2 tests' inputs: random fp16 H [T k, F] (N(0, scale^2), sorted rows), an MXFP4 W2
    bank [E, d, F / 2] (exponents in [exps[0], exps[1])), top-k routing of distinct experts per
    token from `subset` (the other experts stay empty), pair weights in [wts_lo, wts_lo + 1):
    (h, w2, counts, srt, wts [T, k]) on `device`. One generator, one draw order: a case's data
    does not depend on the device."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T * k, F, generator=g) * scale).to(torch.float16).to(device)
    w = torch.randint(-128, 128, (E, d, F // 2), dtype=torch.int8, generator=g)
    s = torch.randint(*exps, (E, d, F // 32), dtype=torch.uint8, generator=g)
    w2 = dbg_bank(w, s, device)
    pool = torch.tensor(subset) if subset else torch.arange(E)
    ids = pool[torch.rand(T, len(pool), generator=g).topk(k, dim=1).indices].to(device)
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    srt = sort_pairs(ids, counts)
    wts = (torch.rand(T, k, generator=g) + wts_lo).to(device)
    return h, w2, counts, srt, wts


def l2_reference(h, w2, counts, srt, wts, ks):
    """fp32 y [T, ks, d] (NaN in the unrouted slots): wts[p] x (H[r] @ W2[g]^T) at slot
    (p // k) ks + p % k of sorted row r of expert g, p = srt[r], on H's fp16 values and the
    exactly dequantized W2."""
    T, k = wts.shape
    W = mxfp4_f32(w2.w, w2.s)
    y = torch.full((T * ks, W.shape[1]), float("nan"), device=h.device)
    r0 = 0
    for e, c in enumerate(counts.tolist()):
        p = srt[r0:r0 + c].long()
        y[(p // k) * ks + p % k] = wts.reshape(-1)[p, None].float() * \
            (h[r0:r0 + c].float() @ W[e].T)
        r0 += c
    return y.view(T, ks, -1)


def check_l2_out(y, h, w2, counts, srt, wts, ks, tol):
    """An L2 kernel's y [T, ks, d] (its routed slots: the first k = wts.shape[1]) against the
    fp32 math (l2_reference) and against moe.triton_l2 (the Triton L2 as routed_experts
    launches it) on the same inputs: relative (Frobenius) error < tol for both."""
    from megagraph.kernels.moe import triton as moe

    k = wts.shape[1]
    ref = l2_reference(h, w2, counts, srt, wts, ks)
    assert rel(y[:, :k], ref[:, :k]) < tol, f"vs fp32 math: {rel(y[:, :k], ref[:, :k]):.3e}"
    y_tr = torch.full_like(y, float("nan"))
    moe.triton_l2(h, w2, counts, srt, wts, y_tr)
    if y_tr.is_cuda:
        torch.cuda.synchronize()
    assert rel(y[:, :k], y_tr[:, :k]) < tol, \
        f"vs the Triton L2: {rel(y[:, :k], y_tr[:, :k]):.3e}"


def dbg_bank(codes: torch.Tensor, exps: torch.Tensor, device="cuda"):
    """An MXFP4 bank on `device` (the GPU unless said) from given codes [E, N, K/2] and E8M0
    exponents [E, N, K/32] (the debug tests' one-expert banks, the L2 tests' W2)."""
    from megagraph.kernels.moe import triton as moe

    return moe.bank(codes.to(torch.int8).to(device),
                    exps.to(torch.uint8).view(torch.float8_e8m0fnu).to(device), "mxfp4")


def dbg_case(x, xs, c1, e1, c3, e3, topk=1, a_idx=None, limit=None):
    """The debug tests' one-expert inputs on the GPU: x [T, d] (cast to E4M3), A scales xs, W1 /
    W3 from codes and exponents, sorted rows a_idx (default 0 .. T * topk - 1), and the fp32
    reference (no clamp for limit None): (xq, xs, w1, w3, counts, srt, ref)."""
    T = x.shape[0]
    a_idx = torch.arange(T * topk, dtype=torch.int32) if a_idx is None else a_idx
    P = a_idx.numel()
    xq = x.to(torch.float8_e4m3fn).cuda()
    xs = xs.float().cuda()
    w1, w3 = dbg_bank(c1, e1), dbg_bank(c3, e3)
    counts = torch.tensor([P], dtype=torch.int32, device="cuda")
    srt = a_idx.to(torch.int32).cuda()
    ref = reference(xq, xs, w1, w3, counts, srt, topk, float("inf") if limit is None else limit)
    return xq, xs, w1, w3, counts, srt, ref


def dbg_l2_case(x, codes, exps, k: int, ks: int, perm, g, device="cuda"):
    """The L2 debug tests' one-expert inputs on `device`: H = x [P, F] in fp16, W2 from codes
    [1, d, F/2] and exponents, the sorted pair list 0 .. P - 1 (or perm), pair weights 1 (with
    perm: random in [0.5, 1.5) from the generator g), and the fp32 reference rows
    [P / k * ks, d] (l2_reference; NaN in the unrouted slots): (h, w2, counts, srt,
    wts [P / k, k], ref)."""
    P = x.shape[0]
    h = x.to(torch.float16).to(device)
    w2 = dbg_bank(codes, exps, device)
    counts = torch.tensor([P], dtype=torch.int32, device=device)
    srt = (torch.arange(P) if perm is None else perm).to(torch.int32).to(device)
    wts = (torch.ones(P) if perm is None else torch.rand(P, generator=g) + 0.5).to(device)
    wts = wts.view(-1, k)
    ref = l2_reference(h, w2, counts, srt, wts, ks).view(-1, w2.n)
    return h, w2, counts, srt, wts, ref


# the prefill L2 launchers' cases (T, E, k, subset, ks, dtype, d, F), shared by their tests
# (test_moe_gluon_l2.test_l2_gluon_matches says what each covers)
L2_PREFILL_CASES = [
    (203, 8, 4, None, 4, torch.float32, 512, 384),
    (77, 4, 3, None, 5, torch.float32, 256, 1152),
    (515, 16, 6, [0, 3, 5, 6, 9, 12, 14], 7, torch.bfloat16, 512, 384),
    (300, 8, 6, None, 6, torch.float16, 384, 768),
    (1, 8, 6, None, 7, torch.float32, 256, 384),
    (1024, 16, 6, None, 7, torch.bfloat16, 1024, 2304)]


def l2_debug_pieces(K: int, bm: int, g: torch.Generator, names=None) -> list[tuple]:
    """The prefill L2 kernels' debug pieces at d = 256, F = K, rows of bm
    (test_moe_gluon_l2.test_l2_gluon_debug_pieces says what each checks): (name, H rows,
    W2 codes, exponents, topk, ks, pair order or None) for those in `names` (all by default),
    drawn from g in this order."""
    d, F = 256, K

    def codes():
        return torch.randint(0, 256, (1, d, F // 2), generator=g)

    def rexp(lo, hi):
        return torch.randint(lo, hi, (1, d, F // 32), generator=g)

    e127 = torch.full((1, d, F // 32), 127)
    eye = torch.zeros(bm, F)
    eye[torch.arange(bm), (torch.arange(bm) * (2 * K // 128 + 1)) % K] = 1.0
    col = torch.arange(F // 2)
    ramp = (((2 * col) % 16) | (((2 * col + 1) % 16) << 4)).expand(1, d, F // 2)
    pieces = {
        "ones": lambda: (torch.ones(bm, F), torch.full((1, d, F // 2), 0x22), e127, 1, 1, None),
        "onehot": lambda: (eye, codes(), e127, 1, 1, None),
        "col_ramp": lambda: (torch.where(torch.arange(F) % 16 < 8, 2.0, 1.0)[None], ramp, e127,
                             1, 1, None),
        "exps_flat": lambda: (torch.randn(bm, F, generator=g), codes(),
                              torch.full((1, d, F // 32), 120), 1, 1, None),
        "exps_wide": lambda: (torch.randn(bm, F, generator=g), codes(), rexp(108, 128), 1, 1,
                              None),
        "exps_flush": lambda: (torch.randn(bm, F, generator=g), codes(), rexp(60, 128), 1, 1,
                               None),
        "frame_lo": lambda: (torch.randn(64, F, generator=g) * 1024, codes(), rexp(2, 12), 1, 1,
                             None),
        "rows_37": lambda: (torch.randn(37, F, generator=g), codes(), e127 - 6, 1, 1, None),
        "rows_300": lambda: (torch.randn(300, F, generator=g), codes(), e127 - 4, 2, 3,
                             torch.randperm(300, generator=g))}
    return [(n, *piece()) for n, piece in pieces.items() if names is None or n in names]


def diagnose(name, out, ref):
    """'' when out matches ref (2e-3 relative, finite), else where it does not: the bad rows /
    columns, the first bad element, and the median ratio out / ref (a power of two: a scale
    bug)."""
    out, ref = out.float(), ref.float()
    fin = torch.isfinite(out)
    err = (out - ref).abs() > 2e-3 * ref.abs().amax().clamp_min(1e-30) + 1e-2 * ref.abs()
    bad = err | ~fin
    r_err = rel(torch.where(fin, out, 0), ref)
    if not bad.any() and r_err < 2e-3:
        return ""
    r, c = bad.nonzero()[0].tolist() if bad.any() else (0, 0)
    rows = bad.any(1).nonzero().flatten().tolist()
    cols = bad.any(0).nonzero().flatten().tolist()
    ok = fin & (ref.abs() > 1e-3)
    ratio = (out[ok] / ref[ok]).median().item() if ok.any() else float("nan")
    return (f"{name}: rel {r_err:.3e}, {int(bad.sum())}/{bad.numel()} bad, {int((~fin).sum())} "
            f"not finite; bad rows {rows[:8]}{'...' if len(rows) > 8 else ''} ({len(rows)}), "
            f"bad cols {cols[:8]}{'...' if len(cols) > 8 else ''} ({len(cols)}); first "
            f"({r}, {c}): {out[r, c].item():.6g} vs {ref[r, c].item():.6g}; median out/ref "
            f"{ratio:.6g}")


def debug_cases(T: int, eye_step: int, partial: int, gathered: int, ramp: bool = False,
                d: int = 256, F: int = 64):
    """The debug tests' pieces, one expert, K = d = 256 (2 chunks), N = F = 64, each isolating
    one part of a kernel, in order, as [(name, topk, limit, dbg_case(...))]:
      ones       A = 1, W1 = 1, W3 = 0.5, all scales 1 (T rows): g = 256, u = 128
      onehot     row r of A = e_(eye_step r), random W1 codes, exponents 127: g = one W1 column
      col_ramp   (ramp) one row, W1 code of column c = c % 16 (every code and sign), A = 2 on
                 the positive codes and 1 on the negative ones (A = 1 would cancel to g = 0)
      exps_flat  random A and codes, every exponent 120 (rel = 6)
      exps_wide  exponents 108 .. 127 (every offset, the clamp / flush)
      a_scales   a different A scale per (row, chunk)
      rows_<partial>    a partial row tile (masks, the store)
      rows_<2 gathered> 2 gathered rows with top-k 2 from `gathered` tokens in a shuffled order
    Random values come from one generator (seed 7) in this order, so a case's data does not
    depend on which kernel runs it."""
    g = torch.Generator().manual_seed(7)

    def codes():
        return torch.randint(0, 256, (1, F, d // 2), generator=g)

    def randx(T):
        return (torch.randn(T, d, generator=g) * 64).clamp(-448, 448)

    def rexp(lo, hi):
        return torch.randint(lo, hi, (1, F, d // 32), generator=g)

    one_s = torch.ones(T, d // 128)
    c_one = torch.full((1, F, d // 2), 0x22)  # E2M1 1.0 in both nibbles
    c_half = torch.full((1, F, d // 2), 0x11)  # 0.5
    e127 = torch.full((1, F, d // 32), 127)
    e120 = torch.full((1, F, d // 32), 120)
    eye = torch.zeros(T, d)
    eye[torch.arange(T), torch.arange(T) * eye_step] = 1.0
    cases = [("ones", torch.ones(T, d), one_s, c_one, e127, c_half, e127, {}),
             ("onehot", eye, one_s, codes(), e127, c_one, e127, {})]
    if ramp:
        col = torch.arange(d // 2)
        rmp = ((2 * col) % 16) | (((2 * col + 1) % 16) << 4)
        # A = 2 on the positive codes (c % 16 < 8), 1 on the negative ones: with A = 1 every
        # 16 columns cancel (g = 0, out = 0: no signal); here g = 18 d / 16 (288 at d = 256)
        a_ramp = torch.where(torch.arange(d) % 16 < 8, 2.0, 1.0)[None, :]
        cases.append(("col_ramp", a_ramp, one_s[:1], rmp.expand(1, F, d // 2).clone(),
                      e127, c_one, e127, {}))
    cases.append(("exps_flat", randx(T), one_s / 64, codes(), e120, codes(), e120, {}))
    cases.append(("exps_wide", randx(T), one_s / 64, codes(), rexp(108, 128), codes(),
                  rexp(108, 128), {}))
    sa = torch.exp2(torch.randint(-9, -3, (T, d // 128), generator=g).float())
    cases.append(("a_scales", randx(T), sa, codes(), rexp(119, 125), codes(), rexp(119, 125), {}))
    cases.append((f"rows_{partial}", randx(partial), one_s[:partial] / 64, codes(), e127 - 6,
                  codes(), e127 - 6, {}))
    perm = torch.randperm(2 * gathered, generator=g).to(torch.int32)
    cases.append((f"rows_{2 * gathered}", randx(gathered), torch.full((gathered, d // 128), 1 / 64),
                  codes(), rexp(119, 125), codes(), rexp(119, 125),
                  dict(topk=2, a_idx=perm, limit=10.0)))
    return [(name, kw.get("topk", 1), kw.get("limit"), dbg_case(*args, **kw))
            for name, *args, kw in cases]


def check_repeats_and_graph(launch, out, want, same, why=lambda o, w: "", launches: int = 20,
                            replays: int = 3) -> None:
    """`launch(out)` `launches` times into a NaN-refilled `out`, then captured in a CUDA graph
    (warmed up on a side stream, as torch asks) and replayed `replays` times: `same(out, want)`
    after every one (the Gluon kernels' run-to-run bit stability and capture; why(out, want)
    adds to the failure message)."""
    for i in range(launches):
        out.fill_(float("nan"))
        launch(out)
        torch.cuda.synchronize()
        assert same(out, want), f"launch {i} differs {why(out, want)}"
    graph, _ = capture(lambda: launch(out), warmup=1)
    for j in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same(out, want), f"graph replay {j} differs {why(out, want)}"


def l2_arg_case(bm: int = 128):
    """The small problem the prefill L2 launchers' argument tests share (moe_gluon_l2.l2_gluon
    and its warp-specialized twin run the same checks): (valid call kwargs, the calls each
    launcher must refuse with ValueError before any launch - CPU tensors suffice)."""
    E, d, F, k, T = 2, 128, 384, 2, 3
    w2 = dbg_bank(torch.zeros(E, d, F // 2), torch.full((E, d, F // 32), 127), "cpu")
    counts = torch.tensor([T * k, 0], dtype=torch.int32)
    srt = torch.arange(T * k, dtype=torch.int32)
    wts = torch.ones(T, k)
    h = torch.zeros(T * k, F, dtype=torch.float16)
    y = torch.zeros(T, k, d)
    base = dict(h=h, w2_bank=w2, counts=counts, srt=srt, wts=wts, y=y, topk=k, ks=k,
                max_tiles=min(T * k, T * k // bm + E))
    w2_k = dbg_bank(torch.zeros(E, d, 64), torch.full((E, d, 4), 127), "cpu")  # K = 128
    w2_n = dbg_bank(torch.zeros(E, 64, F // 2), torch.full((E, 64, F // 32), 127), "cpu")  # d 64
    wide = torch.zeros(E, d, F // 2 + 8, dtype=torch.int8)  # rows of 200 bytes: not 16-aligned
    w2_a = dbg_bank(wide[..., : F // 2], torch.full((E, d, F // 32), 127), "cpu")
    h_pad = torch.zeros(T * k, F + 4, dtype=torch.float16)[:, :F]  # row stride 388: not 16 B
    bad = [dict(h=h.float()), dict(h=torch.zeros(T * k, F - 192, dtype=torch.float16)),
           dict(h=h_pad), dict(h=h[: T * k - 1]), dict(w2_bank=w2_k, h=h[:, :128]),
           dict(w2_bank=w2_n, y=y[..., :64]), dict(w2_bank=w2_a),
           dict(ks=1), dict(y=torch.zeros(T * k - 1, d)), dict(y=y.to(torch.int32)),
           dict(y=y.double()), dict(srt=srt.long()), dict(counts=counts.long()),
           dict(wts=wts.reshape(-1)[:-1]), dict(wts=wts.to(torch.int32)),
           dict(counts=torch.zeros(E + 1, dtype=torch.int32))]
    return base, bad


def proxy_fence_problems(body: list[str], chunks: int) -> list[str]:
    """The proxy-fence order of a Gluon kernel's K loop (SASS, one instruction a line): for
    every chunk - a cp.async wait (DEPBAR.LE SB0) followed by the chunk's first wgmma (QGMMA /
    HGMMA) - the fence.proxy.async of the thread's own completed copies (SASS: MEMBAR.ALL.CTA +
    FENCE.VIEW.ASYNC.S) must come after the wait and BEFORE the last BAR.SYNC ahead of the
    wgmma (writer-side: every thread fences, then the CTA barrier the wgmma issuers wait at),
    and no fence may sit between that barrier and the wgmma (the old reader-side order:
    wait, barrier, fence, wgmma). [] when right, else what is wrong; also wrong when the
    number of chunks found is not `chunks`."""
    wait = re.compile(r"^(@!?U?P\w+\s+)?DEPBAR\.LE\s+SB0\b")
    mma = re.compile(r"\b[HQI]GMMA\.")
    bar = re.compile(r"\bBAR\.SYNC\b")
    fence = re.compile(r"\bFENCE\.VIEW\.ASYNC\b")
    waits = [i for i, t in enumerate(body) if wait.search(t)]
    mmas = [i for i, t in enumerate(body) if mma.search(t)]
    probs, found = [], 0
    for w in waits:
        g = next((i for i in mmas if i > w), None)
        if g is None or any(w < v < g for v in waits):
            continue  # no wgmma before the next wait (or the loop's end): not a chunk start
        found += 1
        bars = [i for i in range(w, g) if bar.search(body[i])]
        if not bars:
            probs.append(f"no BAR.SYNC between the cp.async wait ({w}) and the wgmma ({g})")
            continue
        if not any(fence.search(body[i]) for i in range(w, bars[-1])):
            probs.append(f"no FENCE.VIEW.ASYNC between the cp.async wait ({w}) and the barrier "
                         f"({bars[-1]}) before the wgmma ({g}): the fence is not writer-side")
        late = [i for i in range(bars[-1], g) if fence.search(body[i])]
        if late:
            probs.append(f"FENCE.VIEW.ASYNC at {late} after the barrier ({bars[-1]}) before the "
                         f"wgmma ({g}): reader-side")
    if found != chunks:
        probs.append(f"{found} chunks (cp.async wait -> wgmma) in the loop, expected {chunks}")
    return probs


def check_chunks(what: str, regs: int, shared: int, body: list[str], counts: dict, stages: int,
                 per_chunk: dict, **measured) -> None:
    """Print a Gluon kernel's sm_90 build (what, registers, shared memory, CTAs per SM, the K
    loop's instructions) and check its K loop, unrolled by the stage count: every per_chunk
    count (a name of the build's SASS counts -> its number per chunk) stands `stages` times,
    `measured` counts (found outside the build's counts, e.g. the wgmma at a tile's n) in place
    of theirs, and every chunk's proxy fence is writer-side (proxy_fence_problems)."""
    print(f"\nsm_90 {what} ({stages} stages): {regs} registers, {shared} B shared, "
          f"{ctas_per_sm(regs, shared)} CTAs per SM, K loop {len(body)} instructions "
          f"({len(body) / stages:.0f} per chunk)")
    got = dict({n: counts[n] for n in per_chunk}, **measured)
    assert got == {n: v * stages for n, v in per_chunk.items()}, got
    assert proxy_fence_problems(body, stages) == []


def decode_copies(load: str, tma: int, cp: int) -> dict:
    """A decode kernel's weight copies per K chunk at its load (check_bt_build's counts):
    `tma` UTMALDG, 1 mbarrier try-wait and 1 expect (the re-arm) for "tma", else `cp`
    LDGSTS.128 (cp.async); the other load's instructions counted as absent."""
    if load == "tma":
        return dict(UTMALDG=tma, TRYWAIT=1, EXPECT=1, LDGSTS128=0)
    return dict(UTMALDG=0, TRYWAIT=0, EXPECT=0, LDGSTS128=cp)


def check_bt_build(kernel: str, bt: int, stages: int, stats, mma: tuple[str, str],
                   per_chunk: dict) -> None:
    """A decode kernel's sm_90 build at the token tile bt (stats: build_stats'): check_chunks
    with the wgmma `mma` = (its name, its SASS pattern at n = bt) counted in place of the
    build's n = 16 count, and <= 255 registers."""
    regs, shared, body, c = stats
    name, pattern = mma
    check_chunks(f"{kernel} bt {bt}", regs, shared, body, c, stages, per_chunk,
                 **{name: count(body, pattern)})
    assert regs <= 255, regs

def check_same_chunk_math(what: str, tma, ns: int, cp, cp_ns: int, names) -> None:
    """Print a decode kernel's TMA build (`what`, at ns stages) and its cp.async build (at
    cp_ns), each (registers, shared bytes, K loop, counts) from build_stats, and check that one
    K chunk of either holds the same count of every name in `names` (the math: the wgmma, the
    upcast), the loops being unrolled by their stage counts."""
    (regs, shared, body, c), (regs_cp, shared_cp, body_cp, c_cp) = tma, cp
    print(f"\nsm_90 {what} ({ns} stages): {regs} registers, {shared} B shared, K loop "
          f"{len(body)} instructions ({len(body) / ns:.0f} per chunk): {c}\nsm_90 cp.async "
          f"({cp_ns} stages): {regs_cp} registers, {shared_cp} B shared, K loop {len(body_cp)} "
          f"({len(body_cp) / cp_ns:.0f} per chunk): {c_cp}")
    for name in names:
        assert c[name] / ns == c_cp[name] / cp_ns, (name, c[name], c_cp[name])

def ctas_per_sm(regs: int, shared: int) -> int:
    """CTAs of one warpgroup an H100 / H200 SM holds: 64 K registers (allocated per thread in
    units of 8), 228 KB shared with 1 KB reserved per CTA."""
    return min(65536 // (-(-regs // 8) * 8 * 128), 228 * 1024 // (shared + 1024))


def bt_rows(bt: int) -> list[int]:
    """Rows per expert for the decode kernels' token tile bt: every tile size 1..bt (one expert
    each), experts of bt + 1, 2 bt + 7 and 3 bt rows (2-3 tiles, the last partial or full) and
    5 rows between empty experts."""
    return list(range(1, bt + 1)) + [0, bt + 1, 2 * bt + 7, 0, 3 * bt, 5, 0]


def check_load_and_stages(kernels) -> None:
    """A Gluon decode module's launcher checks of load / stages (plain Python, before any
    launch): the default is the module's LOAD with TMA_STAGES; unknown loads, stages without
    load='tma' and rings under 3 stages are refused."""
    assert kernels._load_and_stages(None, None) == (kernels.LOAD, kernels.TMA_STAGES)
    assert kernels._load_and_stages("tma", 6) == ("tma", 6)
    for load, stages in (("tma2", None), ("cp.async", 4), ("tma", 2)):
        with pytest.raises(ValueError):
            kernels._load_and_stages(load, stages)


def check_weight_desc(kernels) -> None:
    """A Gluon decode module's host TMA descriptor of an MXFP4 bank of 3 experts of 128 rows x
    512 columns (CPU tensors: no launch): the packed bytes as one [3 x 128, 256] uint8 matrix
    with the row stride, [BW, BK / 2] boxes in W_TMA_LAYOUT; a bank whose experts are not one row
    stride apart does not fit (_tma_fits) and is refused."""
    from megagraph.kernels.moe import triton as moe

    E, rows, cols = 3, 128, 512
    w = torch.zeros(E, rows, cols // 2, dtype=torch.int8)
    s = torch.zeros(E, rows, cols // 32, dtype=torch.uint8)
    desc = kernels._weight_desc(moe.bank(w, s, "mxfp4"))
    assert list(desc.shape) == [E * rows, cols // 2] and list(desc.strides) == [cols // 2, 1]
    assert list(desc.block_shape) == [kernels.BW, kernels.BK // 2]
    assert desc.layout == kernels.W_TMA_LAYOUT
    assert desc.base.dtype == torch.uint8 and desc.base.data_ptr() == w.data_ptr()
    gapped = moe.bank(torch.zeros(E, rows + 64, cols // 2, dtype=torch.int8)[:, :rows], s,
                      "mxfp4")
    assert kernels._tma_fits(moe.bank(w, s, "mxfp4")) and not kernels._tma_fits(gapped)
    with pytest.raises(ValueError):
        kernels._weight_desc(gapped)
