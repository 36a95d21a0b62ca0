"""The warp-specialized Gluon prefill L2 (kernels/moe/gluon_l2_ws.py): loader (TMA of the
H box and the packed W2 rows) / upcast (the PRMT table into the fp16 B ring) / two MMA
warpgroups (m64n128k16 chained on one accumulator), persistent CTAs; moe_gluon_l2's numerics
and call.

GPU (CUDA sm_90 + Triton 3.6 Gluon, else skipped): every output is compared BIT FOR BIT with
moe_gluon_l2.l2_gluon on the same inputs (the same upcast, the same wgmma in the same K order on
one accumulator, the same epilogue: the same bits are expected) and with the fp32 math within
moe_gluon_l2's bounds (2e-3 relative for fp32 y, 1e-2 for bf16 / fp16); NaN-poisoned y (every
routed slot written and finite, every other slot still NaN); H padded with NaN rows past P (the
TMA box reads none of them: its shape ends at P); explicit rows per expert (tiles of 1..128 rows,
experts of several tiles, empty experts, odd token counts), ring depths and persistent grids of
1..3 CTAs (each walking many tiles, ring phases running on across them), the PTX upcast vs its
integer twin, isolated debug pieces (frames at the clamp and the flush), repeated launches and a
CUDA-graph capture, and routed_experts with the module flag on / off. A wrong mbarrier count
deadlocks: every GPU wait here goes through _sync, which ends the process with a message after
WATCHDOG_S seconds (a hung kernel leaves no usable CUDA context); run the file under `timeout`
anyway.

CPU: the launcher's checks; with Triton 3.6 (make sm90-h200) the kernel compiled ahead of time for
sm_90: no stack / local memory, REG = the launch cap, the partitions' setmaxnreg, the shared
memory (= shared_bytes + the barriers, within 227 KB), per partition K loop (one chunk each) the
pinned counts - MMA: 4 HGMMA.64x128x16 per warpgroup, ONE wgmma wait that leaves one group in
flight (gsb0, 0x1); upcast: 64 PRMT, 2 LDS.128, 8 STS.128, 2 exponent loads, one proxy fence;
loader: 3 UTMALDG (two 64-row H boxes, the second predicated; the W2 words) on one of two
predicated expects - and the release order before every arrive.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest
import torch
from gluon_cases import check_l2_out, check_repeats_and_graph, dbg_bank, dbg_l2_case, diagnose
from gluon_cases import explicit_rows, gluon_build, gluon_gpu, l2_arg_case, l2_case, l2_debug_pieces
from gluon_cases import L2_PREFILL_CASES, l2_reference, rel
from megagraph.kernels.moe import gluon_l2 as mgl
from megagraph.kernels.moe import gluon_l2_ws as mlw
from sm90_build import count, gluon_sm90, usage_and_sass
from sm90_build import partition_loops as sm90_partition_loops

gpu = gluon_gpu(mlw)
build = gluon_build(mlw)
# seconds a GPU wait may take before the process is ended (a deadlocked kernel never returns)
WATCHDOG_S = float(os.environ.get("MEGAGRAPH_TEST_WATCHDOG_S", "60"))


def _sync(what: str = "l2_gluon_ws"):
    """torch.cuda.synchronize with a deadline: a launch that has not finished after WATCHDOG_S
    (a wrong mbarrier count or phase deadlocks the persistent CTAs) ends the whole process with
    a message (os._exit: the hung kernel keeps the device; every later test would hang too)."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > WATCHDOG_S:
            print(f"\nFATAL: {what} did not finish in {WATCHDOG_S:.0f} s (a deadlock: mbarrier "
                  "counts / phases?); ending the test process", flush=True)
            os._exit(3)
        time.sleep(1e-3)
    torch.cuda.synchronize()


def _max_tiles(P, E):
    """routed_experts' bound on the row tiles of 128 rows."""
    return min(P, P // mlw.BM + E)


def _bits(y):
    """y's bits as integers (NaN poison included: torch.equal on floats says NaN != NaN)."""
    return y.view({4: torch.int32, 2: torch.int16}[y.element_size()])


def _run(fn, h, w2, counts, srt, wts, ks, dtype, **kw):
    """fn (l2_gluon_ws or l2_gluon) into a NaN-poisoned y [T, ks, d] of dtype; waited for."""
    T, k = wts.shape
    y = torch.full((T, ks, w2.n), float("nan"), dtype=dtype, device="cuda")
    fn(h, w2, counts, srt, wts, y, topk=k, ks=ks,
       max_tiles=_max_tiles(srt.numel(), counts.numel()), **kw)
    _sync(getattr(fn, "__name__", "launch"))
    return y


def _check_same_as_l2(h, w2, counts, srt, wts, ks, dtype, tol, routed=None, **kw):
    """l2_gluon_ws (kw: rings, ctas, use_asm) against l2_gluon bit for bit and the fp32 math
    within tol; the routed slots (`routed`: a [T, ks] mask, default the first k slots) finite,
    every other slot still NaN. Returns y."""
    T, k = wts.shape
    y = _run(mlw.l2_gluon_ws, h, w2, counts, srt, wts, ks, dtype, **kw)
    base = _run(mgl.l2_gluon, h, w2, counts, srt, wts, ks, dtype,
                use_asm=kw.get("use_asm", True))
    if routed is None:
        routed = torch.zeros(T, ks, dtype=torch.bool, device=y.device)
        routed[:, :k] = True
    assert torch.isfinite(y[routed].float()).all(), "a routed slot was not written / not finite"
    assert torch.isnan(y[~routed].float()).all(), "an unrouted slot was written"
    same = torch.equal(_bits(y), _bits(base))
    ref = l2_reference(h, w2, counts, srt, wts, ks)
    err = rel(y[routed], ref[routed])
    assert same, (f"other bits than l2_gluon: rel {rel(y[routed], base[routed]):.3e} to it, "
                  f"{err:.3e} to the fp32 math")
    assert err < tol, f"vs fp32 math: {err:.3e}"
    return y


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("T,E,k,subset,ks,dtype,d,F", L2_PREFILL_CASES)
def test_l2_ws_matches(T, E, k, subset, ks, dtype, d, F):
    """test_moe_gluon_l2's prefill cases (a partial tile; 6 loop trips of 3 chunks; 7 of 16
    experts at 441 rows each into bf16 y with ks 7 > topk; fp16 y; one token; the real F = 2304,
    36 chunks): the bits of l2_gluon, within its bounds of the fp32 math and the Triton L2
    (check_l2_out), every routed slot written, no other."""
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=T + E + ks, subset=subset,
                                      wts_lo=0.25)
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    y = _check_same_as_l2(h, w2, counts, srt, wts, ks, dtype, tol)
    check_l2_out(y, h, w2, counts, srt, wts, ks, tol)


def _rows_case(rows, T, k, d, F, seed, exps=(119, 125), pad=64):
    """l2_case's data with EXPLICIT rows per expert (`rows`, zeros = empty experts): sorted row r
    is pair c_idx[r] of T tokens x top-k, a random choice of distinct pairs (the other pairs'
    slots stay unwritten); H [P + pad, F] with NaN rows past P (no kernel may read them). On the
    GPU: (h, w2, counts, c_idx, wts [T, k], the routed-slot mask [T, ks = k + 1])."""
    P = sum(rows)
    h, w2, _, _, wts = l2_case(T, len(rows), d, F, k, seed=seed, exps=exps, wts_lo=0.25)
    c_idx, counts = explicit_rows(rows, T, k, seed)
    hp = torch.full((P + pad, F), float("nan"), dtype=torch.float16, device="cuda")
    hp[:P] = h[:P]
    routed = torch.zeros(T * (k + 1), dtype=torch.bool, device="cuda")
    p = c_idx.long()
    routed[(p // k) * (k + 1) + p % k] = True
    return hp, w2, counts, c_idx, wts, routed.view(T, k + 1)


# (rows per expert, tokens, top-k, d, F, exponent range)
ROWS_CASES = {
    # every tile size 1..128 (one partial tile per expert), empty experts; 331 tokens (odd)
    "tiles_1_128": ([1, 2, 0, 3, 7, 16, 31, 33, 64, 65, 0, 100, 127, 128], 331, 3, 256, 384,
                    (119, 125)),
    # experts of > 128 rows (2-3 tiles, the last partial) between empty ones; 257 tokens
    "big_experts": ([0, 129, 300, 0, 256, 5, 0], 257, 3, 384, 768, (119, 125)),
    # the last expert's last tile ends at P (the H box past P: zero-filled, the NaN pad unread);
    # 20-binade exponent spreads (flushed weights: the frame)
    "tail_wide_exps": ([40, 0, 200], 97, 3, 128, 1152, (100, 128)),
}


@gpu
@pytest.mark.parametrize("stages,bstages,ctas", [
    (None, None, None), (None, None, 1), (None, None, 3), (2, 2, 2), (3, 3, None), (8, 3, 3),
    (4, 2, None), (5, 4, 2)])
@pytest.mark.parametrize("name", list(ROWS_CASES))
def test_l2_ws_rows(name, stages, bstages, ctas):
    """Explicit rows per expert into NaN-poisoned y with ks = topk + 1 (only the chosen pairs'
    slots written): the bits of l2_gluon at every ring depth and persistent grid (1..3 CTAs
    walking every work item: ring phases running on across tiles and experts), within 2e-3 of
    the fp32 math."""
    rows, T, k, d, F, exps = ROWS_CASES[name]
    h, w2, counts, c_idx, wts, routed = _rows_case(rows, T, k, d, F, seed=len(name), exps=exps)
    _check_same_as_l2(h, w2, counts, c_idx, wts, k + 1, torch.float32, 2e-3, routed=routed,
                      stages=stages, bstages=bstages, ctas=ctas)


@gpu
@pytest.mark.parametrize("stages,bstages,ctas", [(None, None, None), (5, 3, 2), (2, 2, 3),
                                                 (4, 3, 1)])
@pytest.mark.parametrize("case", ["tiles_1_128", "big_experts", "matches_2304", "one_token"])
def test_l2_ws_bn256(case, stages, bstages, ctas):
    """bn = 256 (two m64n128k16 accumulators per MMA warpgroup, each the same instruction
    sequence per output element as bn 128): the bits of l2_gluon, within 2e-3 / 1e-2 of the fp32
    math, every routed slot written and no other, at several ring depths and persistent grids
    (explicit rows 1..128 per expert and experts of 2-3 tiles; the real F = 2304 into bf16 y;
    one token)."""
    if case in ROWS_CASES:
        rows, T, k, d, F, exps = ROWS_CASES[case]
        h, w2, counts, c_idx, wts, routed = _rows_case(rows, T, k, 512, F, seed=len(case),
                                                       exps=exps)
        _check_same_as_l2(h, w2, counts, c_idx, wts, k + 1, torch.float32, 2e-3, routed=routed,
                          stages=stages, bstages=bstages, ctas=ctas, bn=256)
    else:
        T, E, k, d, F, dtype = ((1024, 16, 6, 1024, 2304, torch.bfloat16) if case ==
                                "matches_2304" else (1, 8, 6, 256, 384, torch.float32))
        h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=T + E, wts_lo=0.25)
        _check_same_as_l2(h, w2, counts, srt, wts, 7, dtype,
                          2e-3 if dtype == torch.float32 else 1e-2, stages=stages,
                          bstages=bstages, ctas=ctas, bn=256)


def _same_bits_as_default(case: str, **kw):
    """ROWS_CASES[case] (d 512 at bn 256) or the real F = 2304 into bf16 y ("matches_2304")
    launched with kw, persistent over 3 CTAs and with one CTA per work item, into NaN-poisoned
    y: every routed slot written and finite, no other, and the bits of the default
    one-partition launch (bn 128, upp 1; itself l2_gluon's bits, test_l2_ws_rows)."""
    bn = kw.get("bn", mlw.BN)
    if case in ROWS_CASES:
        rows, T, k, d, F, exps = ROWS_CASES[case]
        d = 512 if bn == 256 else d
        h, w2, counts, srt, wts, routed = _rows_case(rows, T, k, d, F, seed=len(case),
                                                     exps=exps)
        ks, dtype, P, E = k + 1, torch.float32, sum(rows), len(rows)
    else:
        T, E, k, d, F = 1024, 16, 6, 1024, 2304
        h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=T + E, wts_lo=0.25)
        ks, dtype, P = 7, torch.bfloat16, T * k
        routed = torch.zeros(T, ks, dtype=torch.bool, device="cuda")
        routed[:, :k] = True
    base = _run(mlw.l2_gluon_ws, h, w2, counts, srt, wts, ks, dtype, bn=128, upp=1)
    assert torch.isfinite(base[routed].float()).all(), "default launch: a routed slot unwritten"
    for ctas in (3, _max_tiles(P, E) * (d // bn)):  # a few persistent CTAs; one per work item
        y = _run(mlw.l2_gluon_ws, h, w2, counts, srt, wts, ks, dtype, ctas=ctas, **kw)
        tag = f"{case} {kw} ctas {ctas}"
        assert torch.isfinite(y[routed].float()).all(), f"{tag}: a routed slot not written"
        assert torch.isnan(y[~routed].float()).all(), f"{tag}: an unrouted slot was written"
        assert torch.equal(_bits(y), _bits(base)), \
            f"{tag}: other bits than the default launch (rel {rel(y[routed], base[routed]):.3e})"


@gpu
@pytest.mark.parametrize("bn,stages,bstages", [(256, None, None), (128, None, None),
                                               (256, 5, 3), (128, 2, 2)])
@pytest.mark.parametrize("case", [*ROWS_CASES, "matches_2304"])
def test_l2_ws_two_upcasts(case, bn, stages, bstages):
    """upp = 2 (two upcast partitions, each one half of the tile's W2 rows: 128-row halves at
    bn 256, 64-row halves at bn 128; 20 warps at launch cap 96): explicit rows 1..128 per
    expert, experts of 2-3 tiles, empty experts, the tail tile and the real F = 2304, at the
    default rings and others: the bits of the default one-partition launch, every routed slot
    written and no other, persistent over 3 CTAs and one CTA per work item."""
    _same_bits_as_default(case, bn=bn, upp=2, stages=stages, bstages=bstages)


@gpu
@pytest.mark.parametrize("stages,bstages", [(None, None), (5, 3), (4, 2)])
@pytest.mark.parametrize("case", [*ROWS_CASES, "matches_2304"])
def test_l2_ws_loader_upcast(case, stages, bstages):
    """lup (bn 256, two upcast partitions): the loader upcasts rows 96..127 / 224..255 of every
    chunk LUP_LAG chunks behind its loads - at a tile's first chunks still the previous tile's,
    after the last tile the last chunks' - with the cached row frames (row_frames), and the
    upcast partitions use those frames instead of their scans: the bits of the default
    one-partition launch, every routed slot written and no other, persistent over 3 CTAs and
    one CTA per work item, at several rings (4:2 - the fewest raw stages lup takes, LUP_LAG + 2,
    and two B stages)."""
    _same_bits_as_default(case, bn=256, upp=2, lup=True, stages=stages, bstages=bstages)


@gpu
def test_l2_ws_row_frames_match_the_scan():
    """row_frames (cached per weight: the same tensor back) equals the in-kernel scan's S0 =
    max(max_k e - REL_MAX, 1) over all of K."""
    rows, T, k, d, F, exps = ROWS_CASES[next(iter(ROWS_CASES))]
    _, w2, _, _, _, _ = _rows_case(rows, T, k, 512, F, seed=5, exps=exps)
    f = mlw.row_frames(w2)
    assert f is mlw.row_frames(w2) and f.dtype == torch.int32
    e = w2.s.view(torch.uint8).long()
    assert torch.equal(f.long(), (e.amax(-1) - mlw.REL_MAX).clamp_min(1))


@gpu
def test_l2_ws_asm_vs_arith_and_tiles():
    """Exponents 108 .. 127 (rel over [-6, 13]): the PTX table upcast and the arithmetic twin
    give the same bits (and l2_gluon's); a prebuilt tile list gives the bits of the one built in
    the call."""
    from megagraph.kernels.moe import triton as moe

    d, F, k, E, T = 256, 384, 3, 4, 171
    h, w2, counts, srt, wts = l2_case(T, E, d, F, k, seed=5, exps=(108, 128), wts_lo=0.25)
    asm = _check_same_as_l2(h, w2, counts, srt, wts, k, torch.float32, 2e-3, use_asm=True)
    arith = _check_same_as_l2(h, w2, counts, srt, wts, k, torch.float32, 2e-3, use_asm=False)
    assert torch.equal(asm, arith), f"PTX vs arithmetic upcast: rel {rel(asm, arith):.3e}"
    P = T * k
    pre = _run(mlw.l2_gluon_ws, h, w2, counts, srt, wts, k, torch.float32,
               tiles=moe.tile_list(counts, mlw.BM, _max_tiles(P, E)))
    assert torch.equal(asm, pre), "prebuilt tile list differs"


@gpu
@pytest.mark.parametrize("K", [384, 1152])
def test_l2_ws_debug_pieces(K):
    """One expert, d = 256 (two column tiles), fp32 y (test_moe_gluon_l2's debug pieces): each
    against the fp32 math (diagnose: where and how it is off) and l2_gluon's bits; launched
    into NaN-poisoned y with 1 and 2 CTAs.
      ones       H = 1, W2 = 1, exponents 127: y = K (the frame: weights 2^13 in fp16)
      onehot     H row r = e_(c(r)) (128 rows): y[r] = W2[:, c(r)] (B's order, the chunks)
      exps_wide  exponents 108 .. 127 (the per-(row, group) tables)
      exps_flush exponents 60 .. 127 (rel < -13 flushes, below 2^-26 of a row's largest)
      frame_lo   exponents 2 .. 11 (S0 clamps at 1: the frame 2^-126; compared x 2^100)
      rows_37    37 rows (a partial tile: the H box's rows past P zero-filled)
      rows_300   300 rows (3 row tiles), topk 2, ks 3, shuffled pairs, random weights"""
    d = 256
    g = torch.Generator().manual_seed(7)
    cases = l2_debug_pieces(K, mlw.BM, g, names=("ones", "onehot", "exps_wide", "exps_flush",
                                                 "frame_lo", "rows_37", "rows_300"))
    msgs = []
    for name, x, c, e, k, ks, perm in cases:
        h, w2, counts, srt, wts, ref = dbg_l2_case(x, c, e, k, ks, perm, g, "cuda")
        routed = torch.isfinite(ref[:, 0])
        base = _run(mgl.l2_gluon, h, w2, counts, srt, wts, ks, torch.float32).view(-1, d)
        sc = 2.0 ** 100 if name == "frame_lo" else 1.0
        for ctas in (1, 2):
            tag = f"{name} (K {K}, {ctas} CTAs)"
            try:
                y = _run(mlw.l2_gluon_ws, h, w2, counts, srt, wts, ks, torch.float32,
                         ctas=ctas).view(-1, d)
            except Exception as exc:  # noqa: BLE001  (a launch error names the case)
                msgs.append(f"{tag}: {exc!r}"[:400])
                continue
            msgs.append(diagnose(tag, y[routed] * sc, ref[routed] * sc))
            if torch.isfinite(y[~routed]).any():
                msgs.append(f"{tag}: an unrouted slot was written")
            if not torch.equal(_bits(y), _bits(base)):
                msgs.append(f"{tag}: other bits than l2_gluon (rel "
                            f"{rel(y[routed], base[routed]):.3e})")
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)


@gpu
@pytest.mark.parametrize("ctas,bn,upp,lup", [(None, 128, None, None), (2, 128, None, None),
                                             (2, 256, None, None), (2, 256, 2, False),
                                             (None, 128, 2, None), (2, 256, 2, True)])
def test_l2_ws_repeat_and_graph(ctas, bn, upp, lup):
    """20 eager launches give the bits of l2_gluon, and the launch captured in a CUDA graph (tile
    list built inside the capture, host TMA descriptors filled at capture) replays them into a
    re-poisoned y; ctas 2: two persistent CTAs over every work item; bn 256 and two upcast
    partitions too, with the loader's share (lup: its cached row frames built before the
    capture)."""
    rows, T, k, d, F = [5, 0, 128, 231, 1, 64, 0, 77], 199, 3, 256, 768
    h, w2, counts, c_idx, wts, _ = _rows_case(rows, T, k, d, F, seed=77)
    P = sum(rows)
    want = _run(mgl.l2_gluon, h, w2, counts, c_idx, wts, k + 1, torch.bfloat16)

    def launch(y):
        mlw.l2_gluon_ws(h, w2, counts, c_idx, wts, y, topk=k, ks=k + 1,
                        max_tiles=_max_tiles(P, len(rows)), ctas=ctas, bn=bn, upp=upp, lup=lup)

    y = torch.full_like(want, float("nan"))
    launch(y)
    _sync()  # a deadlock shows here, before check_repeats_and_graph's plain synchronizes
    assert torch.equal(_bits(y), _bits(want)), "other bits than l2_gluon"
    check_repeats_and_graph(launch, y, want, lambda o, w: torch.equal(_bits(o), _bits(w)),
                            lambda o, w: f"rel {rel(o.nan_to_num(0), w.nan_to_num(0)):.3e}")


@gpu
@pytest.mark.parametrize("on", [True, False])
def test_routed_experts_prefill_uses_l2_ws(on, monkeypatch):
    """routed_experts at a prefill size (300 tokens, top-2 of 8 experts: 75 rows per expert, d
    256, F 384) runs its L2 on l2_gluon_ws when MoeConfig.gluon_prefill_l2_ws is on (once; the
    default) and on l2_gluon when off; both within test_triton_moe's bound of the reference
    op."""
    from test_triton_moe import ACT, FP16_H, check_routed, routed_case

    cfg = dataclasses.replace(FP16_H, gluon_prefill_l2=True, gluon_prefill_l2_ws=on)
    calls = []
    real_ws, real = mlw.l2_gluon_ws, mgl.l2_gluon
    monkeypatch.setattr(mlw, "l2_gluon_ws",
                        lambda *a, **k: calls.append("ws") or real_ws(*a, **k))
    monkeypatch.setattr(mgl, "l2_gluon", lambda *a, **k: calls.append("l2") or real(*a, **k))
    xq, xs, ids, wts, bank = routed_case(300, 8, 256, 384, 2, seed=78)
    check_routed(xq, xs, ids, wts, bank, dict(fmt="mxfp4", swiglu_limit=10.0, act_fmt=ACT,
                                              out_dtype="f32"), cfg)
    _sync("routed_experts")
    assert calls == (["ws"] if on else ["l2"])


# ---------------------------------------------------------------------------------------------
# CPU: the launcher's checks, the wiring's choice, the ahead-of-time sm_90 build
# ---------------------------------------------------------------------------------------------


def test_l2_ws_consts_and_checks():
    """kernel_consts (upp 2: REGS_U2 / REGS_256_U2 at launch cap 96, the five warpgroups'
    registers filling 5 x 96, both MMA warpgroups alike); shared_bytes; the launcher runs
    moe_gluon_l2's checks (the same ValueErrors for the same calls) and its own before any
    launch (CPU tensors suffice): diag must be 0, rings >= 2 within the shared memory, upp 1 or
    2, W2's expert rows one stride apart (the TMA matrix); nothing to do (max_tiles 0) returns
    without a launch; where Gluon is missing a valid call raises RuntimeError."""
    assert mlw.kernel_consts(2304, upp=1) == dict(
        KGI=5, USE_ASM=True, BM=128, BN=128, BK=64, NS=mlw.NS, NU=mlw.NU, NB=1, UPP=1,
        R_MMA=mlw.REGS[0], R_UP=mlw.REGS[1], R_LD=mlw.REGS[2], LUP=False, LUPL=mlw.LUP_LAG)
    # upp None: UPP at bn 256 (two partitions, the default), one at bn 128 (measured slower)
    assert mlw.kernel_consts(2304)["UPP"] == 1
    assert mlw.kernel_consts(2304, bn=256)["UPP"] == mlw.UPP == 2
    assert mlw.kernel_consts(384, False, 8, 3)["NS"] == 8
    c256 = mlw.kernel_consts(2304, bn=256, upp=1)
    assert c256["NB"] == 2 and (c256["R_MMA"], c256["R_UP"], c256["R_LD"]) == mlw.REGS_256
    assert mlw.launch_maxnreg(c256) == mlw.MAXNREG == 128
    # two upcast partitions: 20 warps at a cap of 96, per warpgroup lane 5 x 96 = the default
    # MMA warpgroup (what Triton leaves it: the same as the other MMA warpgroup) + the workers
    for bn, regs in ((256, mlw.REGS_256_U2), (128, mlw.REGS_U2)):
        c2 = mlw.kernel_consts(2304, bn=bn, upp=2)
        assert c2["UPP"] == 2 and (c2["R_MMA"], c2["R_UP"], c2["R_LD"]) == regs
        assert mlw.launch_maxnreg(c2) == mlw.MAXNREG_U2 == 96 and 20 * 32 * 96 <= 65536
        assert 5 * 96 - (regs[0] + 2 * regs[1] + regs[2]) == regs[0]
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs)
    for kw in (dict(bn=192), dict(upp=3), dict(upp=0)):
        with pytest.raises(ValueError):
            mlw.kernel_consts(2304, **kw)
    assert mlw.shared_bytes(5, 3, 256) <= mlw.MAX_SHARED - 1024 < mlw.shared_bytes(6, 3, 256)
    assert mlw.shared_bytes(6, 3) == 6 * (16384 + 4096) + 3 * (16384 + 512)
    assert mlw.shared_bytes(8, 4) <= mlw.MAX_SHARED - 1024 < mlw.shared_bytes(9, 3)
    base, bad = l2_arg_case(mlw.BM)
    h, w2 = base["h"], base["w2_bank"]
    E, d, F = w2.w.shape[0], w2.n, w2.k

    def call(**kw):
        return mlw.l2_gluon_ws(**{**base, **kw})

    # expert rows NOT one stride apart (a padded expert stride): no [G N, K / 8] TMA matrix
    padded = torch.zeros(E, d + 16, F // 2, dtype=torch.int8)
    w2_p = dbg_bank(padded[:, :d], torch.full((E, d, F // 32), 127), "cpu")
    assert w2_p.w.stride(0) != d * w2_p.w.stride(1)
    assert mlw.args_problem(h, w2) is None and mlw.args_problem(h, w2_p)
    bad += [dict(w2_bank=w2_p), dict(diag=1), dict(stages=1), dict(bstages=1), dict(stages=9),
            dict(stages=12), dict(bn=192), dict(bn=256), dict(bn=256, stages=6, bstages=3),
            dict(upp=3), dict(upp=0)]
    for kw in bad:
        with pytest.raises(ValueError):
            call(**kw)
    assert call(max_tiles=0) is not None  # nothing to do: no launch, no Gluon needed
    y = base["y"]
    assert call(max_tiles=0).shape == (y.shape[0] * y.shape[1], d)  # the [T * ks, d] view of y
    if not mlw._IMPORT_OK:
        with pytest.raises(RuntimeError):
            call()


@build
def test_l2_ws_descriptors():
    """The launcher's host TMA descriptors on CPU tensors (Triton 3.6's checks: 16-byte base and
    strides): H [P, K] fp16 in [64, 64] boxes (one MMA warpgroup's rows; a row-strided H view
    too), W2 as [G N, K / 8] int32 words in [128, 8] boxes over the same bytes."""
    E, d, F, P = 3, 256, 384, 37
    g = torch.Generator().manual_seed(3)
    w2 = dbg_bank(torch.randint(-128, 128, (E, d, F // 2), generator=g),
                  torch.full((E, d, F // 32), 127), "cpu")
    h = torch.zeros(P + 5, F + 64, dtype=torch.float16)[:, :F]
    hd, wd = mlw.descriptors(h, w2, P)
    assert list(hd.shape) == [P, F] and list(hd.strides) == [F + 64, 1]
    assert list(hd.block_shape) == [mlw.BM // 2, mlw.BK] and hd.layout == mlw.H_TMA_LAYOUT
    assert mlw.H_BOX == mlw.BM // 2
    assert list(wd.shape) == [E * d, F // 8] and list(wd.strides) == [F // 8, 1]
    assert list(wd.block_shape) == [mlw.BN, mlw.BK // 8] and wd.layout == mlw.W_TMA_LAYOUT
    assert wd.base.dtype == torch.int32 and wd.base.data_ptr() == w2.w.data_ptr()
    # word j of W2 row r = its bytes 4 j .. 4 j + 3 (little-endian): the upcast's words
    words = wd.base.reshape(E * d, F // 8)
    b = w2.w.view(torch.uint8).reshape(E * d, F // 2).long()
    assert torch.equal(words[5, 3].long() & 0xFFFFFFFF,
                       b[5, 12] | (b[5, 13] << 8) | (b[5, 14] << 16) | (b[5, 15] << 24))


def test_gluon_l2_ws_choice(monkeypatch):
    """routed_experts' L2 is l2_gluon_ws instead of l2_gluon above 48 rows per expert exactly
    when MoeConfig.gluon_prefill_l2_ws is on (the default) and the call fits it (args_problem:
    W2 rows one stride apart); else l2_gluon (available() forced: the predicate's own logic, on
    any machine); the same 128-row tile (one tile list with the L1)."""
    from megagraph.kernels.moe import triton as moe
    from megagraph.kernels.moe.config import MoeConfig

    assert MoeConfig().gluon_prefill_l2_ws and MoeConfig().gluon_prefill_l2
    monkeypatch.setattr(mgl, "available", lambda device=None: True)
    monkeypatch.setattr(mlw, "available", lambda device=None: True)
    E, d, F = 4, 128, 384
    w2 = dbg_bank(torch.zeros(E, d, F // 2), torch.full((E, d, F // 32), 127), "cpu")
    padded = torch.zeros(E, d + 16, F // 2, dtype=torch.int8)
    w2_p = dbg_bank(padded[:, :d], torch.full((E, d, F // 32), 127), "cpu")
    h = torch.zeros(300, F, dtype=torch.float16)
    y = torch.empty(50, 7, d)

    def run(cfg, w2, rpg=75.0, yy=y):
        return moe._first_fit("L2", cfg.l2_candidates(rpg, False),
                              lambda n: moe._l2_kernel(n, h, None, w2, yy, cfg))

    def pick(w2, rpg=75.0, yy=y, cfg=MoeConfig()):
        name, fn, rows = run(cfg, w2, rpg, yy)
        return name if fn is None else (getattr(fn, "func", fn).__name__, rows)

    assert pick(w2, cfg=MoeConfig(gluon_prefill_l2_ws=False)) == ("l2_gluon", mgl.BM)
    assert pick(w2) == ("l2_gluon_ws", mlw.BM) and mlw.BM == mgl.BM
    assert pick(w2, yy=y.bfloat16()) == ("l2_gluon_ws", mlw.BM)
    assert pick(w2_p) == ("l2_gluon", mgl.BM)  # no TMA matrix: the plain prefill L2
    assert pick(w2, rpg=40.0) != ("l2_gluon_ws", mlw.BM)  # below the threshold: unchanged
    # d 128: no 256-column tile, the plain L2
    assert pick(w2, cfg=MoeConfig(ws_l2_bn=256)) == ("l2_gluon", mgl.BM)
    _, fn, _ = run(MoeConfig(ws_l2_bn=128, ws_l2_rings=(8, 3)), w2)
    assert fn.func is mlw.l2_gluon_ws and fn.keywords == dict(stages=8, bstages=3, bn=128)
    monkeypatch.setattr(mlw, "available", lambda device=None: False)
    assert pick(w2) == ("l2_gluon", mgl.BM)
    monkeypatch.setattr(mlw, "available", lambda device=None: True)
    # a variant of the Gluon prefill L2: off with it
    assert pick(w2, cfg=MoeConfig(gluon_prefill_l2=False)) == "triton"


TYPES = dict(bs_ptr="*u8", c_ptr="*bf16", cidx_ptr="*i32", w_ptr="*fp32", work_ptr="*i32",
             f_ptr="*i32", MT="i32", N="i32", K="i32", G="i32", P="i32", stride_bsg="i32", stride_bsn="i32",
             stride_cm="i32")


def _types(out: str = "*bf16", bn: int = mlw.BN) -> dict:
    """TYPES with the TMA descriptors (H boxes [BM / 2, BK] fp16, W2 word boxes [bn, BK / 8]:
    the launcher's, descriptors())."""
    return dict(TYPES, c_ptr=out,
                h_desc=f"tensordesc<fp16[{mlw.H_BOX}, {mlw.BK}],{mlw.H_TMA_LAYOUT!r}>",
                w_desc=f"tensordesc<i32[{bn}, {mlw.BK // 8}],{mlw.W_TMA_LAYOUT!r}>")


def _compile(out: str = "*bf16", **kw):
    """l2_ws_kernel ahead of time for sm_90 at V4.1-Flash's F = 2304 (mega_moe's y: bf16, ks 7
    slots of top-6), kw: kernel_consts'; the launcher's register cap (launch_maxnreg)."""
    consts = dict(TOPK=6, KS=7, **mlw.kernel_consts(2304, **kw))
    return gluon_sm90(mlw.l2_ws_kernel, _types(out, kw.get("bn", mlw.BN)), consts,
                      num_warps=mlw.NUM_WARPS, maxnreg=mlw.launch_maxnreg(consts))


def partition_loops(sass: str) -> dict:
    """The K loop of each partition (SASS text up to ';', one instruction a list item), by what
    only it runs: "mma" (both MMA warpgroups: HGMMA), "upcast" (STS.128: its frame-scan loops
    at bn 256 store nothing), "loader" (UTMALDG). A
    loop = the body of a conditional backward branch longer than 16 instructions (the mbarrier
    try-wait retries ptxas moves out of line are 2-3), innermost only (the persistent tile
    loops around the K loops contain them): sm90_build.partition_loops."""
    return sm90_partition_loops(sass, (("mma", "HGMMA"), ("upcast", r"\bSTS\.128\b"),
                                       ("loader", "UTMALDG")), innermost=True)


ARRIVE = r"SYNCS\.ARRIVE\.TRANS64\.A1T0"


def order_problems(loops: dict, nb: int = 1) -> list[str]:
    """The order every release needs (the module docstring), [] when right: upcast - its last
    st.shared, then its proxy fence (writer-side), then a partition BAR.SYNC, then the first
    arrive; MMA - the chunk's HGMMAs, then the wgmma wait that leaves nb groups (gsb0, 0x1 at bn
    128; 0x2 at bn 256: the chunk's two), then a BAR.SYNC, then the first arrive (the chunk
    before released only after it retired);
    loader - the free-stage wait, the (first) expect, then the 3 TMA copies (two H boxes, the
    W2 words)."""
    probs = []
    for body in loops["upcast"]:
        arr = next((i for i, t in enumerate(body) if re.search(ARRIVE, t)), None)
        if arr is None:
            probs.append("upcast: no arrive")
            continue
        w = max((i for i in range(arr) if re.search(r"\bSTS", body[i])), default=None)
        f = max((i for i in range(arr) if re.search(r"FENCE\.VIEW\.ASYNC\.S", body[i])),
                default=None)
        b = max((i for i in range(arr) if re.search(r"\bBAR\.SYNC\b", body[i])), default=None)
        if None in (w, f, b) or not w < f < b:
            probs.append(f"upcast: st.shared {w}, fence {f}, barrier {b}, arrive {arr}: not "
                         "store < fence < barrier < arrive")
    for body in loops["mma"]:
        arr = next((i for i, t in enumerate(body) if re.search(ARRIVE, t)), None)
        g = max((i for i, t in enumerate(body) if "HGMMA" in t), default=None)
        dep = next((i for i, t in enumerate(body)
                    if re.search(rf"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x{nb}\b", t)), None)
        if None in (arr, g, dep):
            probs.append(f"mma: arrive {arr}, HGMMA {g}, wait(1) {dep}")
            continue
        b = [i for i in range(dep, arr) if re.search(r"\bBAR\.SYNC\b", body[i])]
        if not (g < dep < arr and b):
            probs.append(f"mma: HGMMA {g}, wait(1) {dep}, barrier {b}, arrive {arr}")
    for body in loops["loader"]:
        wt = next((i for i, t in enumerate(body) if "SYNCS.PHASECHK" in t), None)
        ex = next((i for i, t in enumerate(body) if re.search(r"SYNCS\.ARRIVE\.TRANS64\s", t)),
                  None)
        tm = [i for i, t in enumerate(body) if "UTMALDG" in t]
        if None in (wt, ex) or len(tm) != 3 or not wt < ex < min(tm):
            probs.append(f"loader: wait {wt}, expect {ex}, TMA {tm}")
    return probs


def _fits(got: int, want) -> bool:
    """A pinned count: an int exactly, a (lo, hi) pair inclusive."""
    return lo_hi[0] <= got <= lo_hi[1] if isinstance(lo_hi := want, tuple) else got == want


# per chunk (each partition's K loop holds one chunk); the upcast's PRMT: 64 of the table upcast
# and its halves (32 per (row, group), as in moe_gluon_l2) + a few moving the prefetched exponent
# bytes between the loop's registers (3 in the Triton 3.6 build)
LOOP_COUNTS = {
    "mma": dict(HGMMA=(r"\bHGMMA\.64x128x16\.F32\b", 4), GMMA_any=(r"GMMA", 4),
                WG_ARRIVE=(r"WARPGROUP\.ARRIVE", 1), WG_DEPBAR=(r"WARPGROUP\.DEPBAR", 1),
                WG_DEPBAR_1=(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b", 1),
                TRYWAIT=(r"SYNCS\.PHASECHK", 2), ARRIVE=(ARRIVE, 2), STS=(r"\bSTS", 0),
                LDS=(r"\bLDS", 0), FENCE=(r"FENCE\.VIEW", 0), LDG=(r"\bLDG", 0),
                STG=(r"\bSTG", 0)),
    "upcast": dict(PRMT=(r"\bPRMT\b", (64, 68)), LDS128=(r"\bLDS\.128\b", 2), LDS=(r"\bLDS", 2),
                   STS128=(r"\bSTS\.128\b", 8), LDG_U8=(r"\bLDG\.E\.U8\b", 2),
                   LDG=(r"\bLDG", 2), TRYWAIT=(r"SYNCS\.PHASECHK", 2), ARRIVE=(ARRIVE, 2),
                   FENCE=(r"FENCE\.VIEW", 1), GMMA=(r"GMMA", 0), SHFL=(r"\bSHFL", 0)),
    "loader": dict(UTMALDG=(r"\bUTMALDG\b", 3), EXPECT=(r"SYNCS\.ARRIVE\.TRANS64\s", 2),
                   TRYWAIT=(r"SYNCS\.PHASECHK", 1), LDGSTS=(r"\bLDGSTS", 0),
                   ARRIVE=(ARRIVE, 0)),
}
# each K loop's instruction count when written (+- 10%): the upcast's is the work per chunk the
# MMA warpgroups' 8 HGMMA.64x128x16 (~550 clocks at the fp16 peak) must hide
LOOP_SIZES = {"mma": 66, "upcast": 181, "loader": 58}


def build_report(k, nb: int = 1) -> tuple[dict, list]:
    """(stats, problems) of a compiled l2_ws_kernel: registers, stack, local memory, shared,
    setmaxnreg values, per partition K-loop sizes and counts."""
    usage, sass = usage_and_sass(k)
    loops = partition_loops(sass)
    stats = dict(regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                 stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                 local=len(re.findall(r"\b(LDL|STL)\b", sass)), shared=k.metadata.shared,
                 setmaxnreg=sorted({int(r) for r in re.findall(
                     r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])}),
                 loops={n: [len(b) for b in v] for n, v in loops.items()},
                 counts={n: [{c: count(b, p) for c, (p, _) in LOOP_COUNTS[n].items()}
                             for b in v] for n, v in loops.items()})
    return stats, order_problems(loops, nb)


@build
def test_l2_ws_sm90_build():
    """Triton 3.6 sm_90 build at the defaults with one upcast partition (upp 1 pinned: NS = 6,
    NU = 3, bf16 y, F = 2304): no stack /
    local memory, REG = the launch cap (128: 16 warps fill the SM's 64K), the partitions'
    setmaxnreg (the default MMA warpgroup's 512 - sum(REGS) and REGS), the shared memory =
    shared_bytes + the barriers (< 1 KB) within 227 KB (one CTA per SM), one K loop per MMA
    warpgroup (2) / upcast / loader with the pinned per-chunk counts (LOOP_COUNTS: 4 HGMMA
    64x128x16 per warpgroup and chunk, one wait leaving one group in flight) and sizes
    (LOOP_SIZES), and the release order."""
    k = _compile(upp=1)
    stats, probs = build_report(k)
    print(f"\nsm_90 l2 ws build: {stats}")
    assert stats["stack"] == 0 and stats["local"] == 0, stats
    assert stats["regs"] == mlw.MAXNREG, stats
    assert {4 * mlw.MAXNREG - sum(mlw.REGS), *mlw.REGS} <= set(stats["setmaxnreg"]), stats
    assert 0 <= stats["shared"] - mlw.shared_bytes() < 1024, stats
    assert stats["shared"] <= mlw.MAX_SHARED, stats
    loops = partition_loops(usage_and_sass(k)[1])
    assert [len(loops[n]) for n in ("mma", "upcast", "loader")] == [2, 1, 1], stats["loops"]
    for kind, pats in LOOP_COUNTS.items():
        for body in loops[kind]:
            got = {n: count(body, p) for n, (p, _) in pats.items()}
            assert all(_fits(got[n], v) for n, (_, v) in pats.items()), (kind, got)
            assert abs(len(body) - LOOP_SIZES[kind]) <= 0.1 * LOOP_SIZES[kind], (kind, len(body))
    assert probs == [], probs


@build
@pytest.mark.parametrize("out,use_asm,stages,bstages", [
    ("*fp32", True, 6, 3), ("*fp16", True, 6, 3), ("*bf16", False, 6, 3),
    ("*bf16", True, 8, 3), ("*bf16", True, 8, 4), ("*bf16", True, 2, 2),
    ("*bf16", True, 5, 4)])
def test_l2_ws_sm90_build_variants(out, use_asm, stages, bstages):
    """The other y dtypes, the arithmetic upcast (a test aid) and other ring depths (8:3 and 8:4,
    the deepest that fit; 2:2, the shallowest): no stack / spills, within 227 KB, the same MMA and
    loader loops (the upcast's at use_asm only), the same release order."""
    k = _compile(out, use_asm=use_asm, stages=stages, bstages=bstages, upp=1)
    stats, probs = build_report(k)
    assert stats["stack"] == 0 and stats["local"] == 0, stats
    assert stats["shared"] <= mlw.MAX_SHARED, stats
    assert 0 <= stats["shared"] - mlw.shared_bytes(stages, bstages) < 1024, stats
    assert stats["loops"]["mma"] and len(stats["loops"]["mma"]) == 2, stats
    for c in stats["counts"]["mma"]:
        assert c["HGMMA"] == 4 and c["WG_DEPBAR_1"] == 1, c
    if use_asm:
        assert _fits(stats["counts"]["upcast"][0]["PRMT"], (64, 68)), stats
    assert probs == [], probs


@build
@pytest.mark.parametrize("stages,bstages", [(4, 2), (5, 3), (4, 3)])
def test_l2_ws_sm90_build_bn256(stages, bstages):
    """bn = 256 (two m64n128k16 accumulators a warpgroup, REGS_256): no stack / spills at the
    setmaxnreg of REGS_256, within 227 KB (= shared_bytes at bn 256), per MMA warpgroup and
    chunk 8 HGMMA.64x128x16 (4 per accumulator) and ONE wait leaving the chunk's two groups in
    flight (gsb0, 0x2), the upcast's K loop 128 PRMT-upcast words (2 halves) with 16 STS.128 and
    4 LDS.128, the loader's 3 UTMALDG, the release order."""
    k = _compile(stages=stages, bstages=bstages, bn=256, upp=1)
    stats, probs = build_report(k, nb=2)
    print(f"\nsm_90 l2 ws bn 256 {stages}:{bstages}: {stats}")
    assert stats["stack"] == 0 and stats["local"] == 0, stats
    assert 0 <= stats["shared"] - mlw.shared_bytes(stages, bstages, 256) < 1024, stats
    assert stats["shared"] <= mlw.MAX_SHARED, stats
    assert {4 * mlw.MAXNREG - sum(mlw.REGS_256), *mlw.REGS_256} <= set(stats["setmaxnreg"])
    assert [len(v) for v in stats["loops"].values()] == [2, 1, 1], stats["loops"]
    for c in stats["counts"]["mma"]:
        assert c["HGMMA"] == 8 and c["WG_ARRIVE"] == 2 and c["WG_DEPBAR"] == 1, c
        assert c["LDS"] == c["STS"] == c["LDG"] == c["STG"] == 0, c
    up = stats["counts"]["upcast"][0]
    assert 128 <= up["PRMT"] <= 136 and up["STS128"] == 16 and up["LDS128"] == 4, up
    assert up["LDG_U8"] == 4 and up["FENCE"] == 1 and up["ARRIVE"] == 2, up
    assert stats["counts"]["loader"][0]["UTMALDG"] == 3, stats
    assert probs == [], probs


@build
@pytest.mark.parametrize("bn,stages,bstages,out", [
    (256, mlw.NS_256, mlw.NU_256, "*bf16"), (128, mlw.NS, mlw.NU, "*bf16"),
    (256, 5, 3, "*bf16"), (256, 4, 2, "*fp16"), (128, 8, 4, "*fp32"), (128, 2, 2, "*bf16")])
def test_l2_ws_sm90_build_two_upcasts(bn, stages, bstages, out):
    """upp = 2: two upcast partitions, 20 warps at launch cap 96 (REG 96), no stack / spills,
    the setmaxnreg of REGS_256_U2 / REGS_U2 for the workers and the rest of 5 x 96 (= R_MMA) for
    the default MMA warpgroup (set by Triton: read from the PTX), one K loop per MMA warpgroup
    (unchanged: 4 NB HGMMA, one wait leaving NB groups) and per upcast partition - each about
    half the one-partition upcast loop of the same tile (PRMT, STS.128, LDS.128, exponent
    loads) -, the loader's 3 UTMALDG, the release order. (fp32 y is not built at bn 256: its
    MMA warpgroups spill at 176 with one upcast partition too.)"""
    k = _compile(out, stages=stages, bstages=bstages, bn=bn, upp=2)
    stats, probs = build_report(k, nb=bn // 128)
    one, _ = build_report(_compile(out, stages=stages, bstages=bstages, bn=bn, upp=1),
                          nb=bn // 128)
    print(f"\nsm_90 l2 ws upp 2 bn {bn} {stages}:{bstages} {out}: {stats}\n  upcast loops "
          f"{stats['loops']['upcast']} vs {one['loops']['upcast']} at upp 1")
    assert stats["stack"] == 0 and stats["local"] == 0, stats
    assert stats["regs"] == mlw.MAXNREG_U2, stats
    assert 0 <= stats["shared"] - mlw.shared_bytes(stages, bstages, bn) < 1024, stats
    ptx = k.asm["ptx"]
    dec = {int(r) for r in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)}
    inc = {int(r) for r in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    r_mma, r_up, r_ld = mlw.REGS_256_U2 if bn == 256 else mlw.REGS_U2
    default = (mlw.MAXNREG_U2 * 20 - 4 * (r_mma + 2 * r_up + r_ld)) // 4
    # the default partition drops to its share (dec); a worker goes from the idle level Triton
    # parks it at (its switch loop) up or down to its own
    assert default == r_mma and default in dec and {r_mma, r_up, r_ld} <= dec | inc, (dec, inc)
    assert [len(v) for v in stats["loops"].values()] == [2, 2, 1], stats["loops"]
    for c in stats["counts"]["mma"]:
        assert c["HGMMA"] == 4 * (bn // 128) and c["WG_DEPBAR"] == 1, c
        assert c["LDS"] == c["STS"] == c["LDG"] == c["STG"] == 0, c
    (up1,) = one["counts"]["upcast"]
    for up in stats["counts"]["upcast"]:
        assert abs(up["PRMT"] - up1["PRMT"] / 2) <= 4, (up, up1)
        for n in ("STS128", "LDS128", "LDG_U8"):
            assert 2 * up[n] == up1[n], (n, up, up1)
        assert up["FENCE"] == 1 and up["ARRIVE"] == 2 and up["TRYWAIT"] == 2, up
    assert stats["counts"]["loader"][0]["UTMALDG"] == 3, stats
    assert probs == [], probs


@build
def test_l2_ws_sm90_build_loader_upcast():
    """lup at bn 256 (NS_256:NU_256, REGS_256_U2_LUP): a few spilled registers (<= 8 B of stack)
    and none inside any K loop; each upcast partition's loop 3/4 of its two-partition rows (a
    64- and a 32-row block: PRMT ~3/4, the exponent loads of both blocks), the loader's loop its
    3 UTMALDG beside its share's two 32-row blocks and one more fence / r_free / b_ready per
    chunk; the MMA loops unchanged; lup refused where it does not apply."""
    k = _compile("*bf16", stages=mlw.NS_256, bstages=mlw.NU_256, bn=256, upp=2, lup=True)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= 8, usage
    loops = partition_loops(sass)
    assert all(count(b, r"\b(LDL|STL)\b") == 0 for v in loops.values() for b in v), \
        "local memory inside a K loop"
    two, _ = build_report(_compile("*bf16", stages=mlw.NS_256, bstages=mlw.NU_256, bn=256,
                                   upp=2, lup=False), nb=2)
    ups = [b for b in loops["upcast"] if count(b, r"\bUTMALDG\b") == 0]
    lds = [b for b in loops["upcast"] if count(b, r"\bUTMALDG\b") > 0] + loops["loader"]
    assert len(ups) == 2 and len(lds) == 1 and len(loops["mma"]) == 2, \
        {n: len(v) for n, v in loops.items()}
    prmt2 = two["counts"]["upcast"][0]["PRMT"]
    for b in ups:
        assert abs(count(b, r"\bPRMT\b") - 0.75 * prmt2) <= 4, (count(b, r"\bPRMT\b"), prmt2)
    (ld,) = lds
    assert count(ld, r"\bUTMALDG\b") == 3 and count(ld, r"\bPRMT\b") >= 0.4 * prmt2
    assert count(ld, r"FENCE\.VIEW\.ASYNC\.S") == 1 and \
        count(ld, r"SYNCS\.ARRIVE\.TRANS64\.A1T0") == 2, ld
    for kw in (dict(bn=128, upp=2), dict(bn=256, upp=1), dict(bn=256, upp=2, stages=3)):
        with pytest.raises(ValueError, match="lup"):
            mlw.kernel_consts(2304, lup=True, **kw)
    assert mlw.kernel_consts(2304, bn=256, upp=2, stages=4, lup=False)["LUP"] is False


def test_order_problems():
    """The order check on hand-written loops: the right order passes; a fence after the barrier
    (reader-side), an MMA release before its wgmma wait and a TMA before the expect fail."""
    good = {"upcast": [["STS.128 [R5], R20", "MEMBAR.ALL.CTA", "FENCE.VIEW.ASYNC.S",
                        "BAR.SYNC.DEFER_BLOCKING 0x3, 0x80",
                        "@!P6 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR38+0x2a720], RZ"]],
            "mma": [["HGMMA.64x128x16.F32 R24, gdesc[UR12], R24, gsb0",
                     "WARPGROUP.DEPBAR.LE gsb0, 0x1", "BAR.SYNC.DEFER_BLOCKING 0x2, 0x80",
                     "@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR7+0x2a720], RZ"]],
            "loader": [["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R6",
                        "SYNCS.ARRIVE.TRANS64 RZ, [UR4], R4", "UTMALDG.2D [UR8], [UR6]",
                        "@UP6 UTMALDG.2D [UR10], [UR12]", "UTMALDG.2D [UR16], [UR14]"]]}
    assert order_problems(good) == []
    reader = dict(good, upcast=[["STS.128 [R5], R20", "BAR.SYNC 0x3, 0x80",
                                 "FENCE.VIEW.ASYNC.S", "@!P6 SYNCS.ARRIVE.TRANS64.A1T0 RZ"]])
    assert order_problems(reader)
    early = dict(good, mma=[["HGMMA.64x128x16.F32 R24, gdesc[UR12], R24, gsb0",
                             "BAR.SYNC 0x2, 0x80", "@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ",
                             "WARPGROUP.DEPBAR.LE gsb0, 0x1"]])
    assert order_problems(early)
    tma_first = dict(good, loader=[["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R6",
                                    "UTMALDG.2D [UR8], [UR6]",
                                    "SYNCS.ARRIVE.TRANS64 RZ, [UR4], R4",
                                    "@UP6 UTMALDG.2D [UR10], [UR12]",
                                    "UTMALDG.2D [UR16], [UR14]"]])
    assert order_problems(tma_first)
