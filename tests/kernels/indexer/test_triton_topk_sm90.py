"""The indexer top-k / candidate-mask kernels (kernels/indexer/triton_topk_jit.py) compile for
sm_90 ahead of time, without a GPU, at IndexerConfig's default knobs, with no stack and no local
memory (no spills), and the streaming kernels' score loads vectorized (LDG.E.128) where there is
no per-entry load mask.

Why: the stream kernels hold a step of the row and the candidate buffer's select in
one program; their registers decide how many programs (and bytes in flight) an SM holds, and a
spill would put local-memory traffic in the loop that reads the row. Registers are reported
(`-s`), not pinned: they differ between Triton 3.6 (the H200 image: `PYTHONPATH=.cache/triton36`,
as `make sm90-h200`) and 3.9. Skipped where triton, its ahead-of-time compile API or its
cuobjdump is missing, and under the interpreter.
"""
from __future__ import annotations

import importlib.util
import re

import pytest
from sm90_build import usage_and_sass

from megagraph.configs.process import triton_interpret

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or triton_interpret(),
    reason="needs triton (compiling, not the interpreter)")

STREAM = dict(s_ptr="*fp32", m_ptr="*fp32", buf_ptr="*i64", cnt_ptr="*i32", C="i32", KK="i32",
              S="i32", SEG="i32", CAP="i32", slack="i32", stride_s="i32", stride_m="i32")
CAND = dict(s_ptr="*fp32", buf_ptr="*i64", cnt_ptr="*i32", nv_ptr="*i32", C="i32", KB="i32",
            S="i32", SEGB="i32", CAP="i32", slack="i32", stride_s="i32")
# arguments the real shapes make 16-divisible (Triton specializes them at launch): pointers,
# row strides, C = 135168, the segment lengths (multiples of the step) and CAP = 4096
DIV = {"C", "SEG", "SEGB", "CAP"}


def cases():
    """name -> (kernel, types, constexprs, warps, vectorized score loads expected) at the
    launchers' defaults (topk_select at k = 512, candidate_mask at blocks of 8)."""
    from megagraph.kernels.indexer import triton_topk as tk
    from megagraph.kernels.indexer import triton_topk_jit as J
    from megagraph.kernels.indexer.config import IndexerConfig

    c = IndexerConfig()
    tb, mtb, w = c.stream_tb, c.stream_merge_tb, tk.WARPS
    nbb = max(1, c.cand_stream_elems // 8)
    return {
        "topk stream": (J.topk_stream_rows, STREAM, dict(HAS_MASK=False, MASKED_LOADS=False,
                                                        BLOCK=c.stream_block, TB=tb), w, True),
        "topk stream mask": (J.topk_stream_rows, dict(STREAM, m_ptr="*u8"),
                             dict(HAS_MASK=True, MASKED_LOADS=False, BLOCK=c.stream_block,
                                  TB=tb), w, True),
        "topk stream masked loads": (J.topk_stream_rows, dict(STREAM, m_ptr="*u8"),
                                     dict(HAS_MASK=True, MASKED_LOADS=True,
                                          BLOCK=c.stream_block, TB=tb), w, False),
        "topk merge": (J.topk_merge_rows, dict(out_ptr="*i64", buf_ptr="*i64", cnt_ptr="*i32",
                                               K="i32", KK="i32", S="i32", CAP="i32",
                                               stride_o="i32"),
                       dict(TB=mtb, BLOCK_K=tk.BLOCK_K), w, False),
        "cand stream": (J.cand_stream_rows, CAND, dict(BS=8, BLK=8, NBB=nbb, TB=tb), w, True),
        "cand merge": (J.cand_merge_rows, dict(buf_ptr="*i64", cnt_ptr="*i32", nv_ptr="*i32",
                                               par_ptr="*i64", KB="i32", S="i32", CAP="i32"),
                       dict(BS=8, TB=c.cand_merge_tb), w, False),
        "cand write": (J.cand_write_rows, dict(s_ptr="*fp32", par_ptr="*i64", out_ptr="*u8",
                                               C="i32", stride_s="i32", stride_o="i32"),
                       dict(BS=8, BLK=8, NBB=max(1, c.cand_write_elems // 8)), w, True),
    }


@pytest.mark.parametrize("name", ["topk stream", "topk stream mask", "topk stream masked loads",
                                  "topk merge", "cand stream", "cand merge", "cand write"])
def test_topk_kernels_compile_for_sm90_without_spills(name):
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    fn, types, consts, warps, vec = cases()[name]
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    div = [n for n in types if n.endswith("_ptr") or n.startswith("stride") or n in DIV]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps))
    usage, sass = usage_and_sass(k)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    print(f"{name}: triton {triton.__version__}, {regs} registers, {k.metadata.shared} B shared")
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, f"{name}: {usage.strip()}"
    assert not re.search(r"\b(LDL|STL)\b", sass), f"{name}: local memory (spills)"
    if vec:
        assert re.search(r"\bLDG\.E\.128\b", sass), f"{name}: no 128-bit score loads"
