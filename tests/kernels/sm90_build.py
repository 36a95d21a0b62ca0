"""Ahead-of-time sm_90 builds and their SASS, for the CPU tests that pin what the GPU kernels
compile to (test_triton_attention_sm90.py, test_moe_gluon.py, test_moe_gluon_decode.py).

Why one module: the pinned numbers (registers, stack, instructions per K loop) are only
comparable if every test reads them the same way - the same cuobjdump (the one in Triton's
bundle, so the SASS is that Triton's ptxas's), the same rule for "the K loop" (the body of the
last backward branch). A test imports it as a sibling (`from sm90_build import ...`: pytest
puts tests/kernels on sys.path, as for _reference_helpers).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest


def cuobjdump(cubin, *flags: str) -> str:
    """stdout of Triton's bundled cuobjdump with `flags` on the cubin file `cubin`; skips the
    test where this Triton ships none."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this triton")
    return subprocess.run([tool, *flags, str(cubin)], capture_output=True, text=True,
                          check=True).stdout


def usage_and_sass(kernel) -> tuple[str, str]:
    """(cuobjdump --dump-resource-usage, --dump-sass) of a compiled kernel's cubin (written to a
    temporary file: also usable outside pytest, e.g. test_moe_gluon.sass_stats)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return cuobjdump(cubin, "--dump-resource-usage"), cuobjdump(cubin, "--dump-sass")


def loop_instructions(sass: str) -> list[str]:
    """The instructions (text up to the ';', unstripped) of the last backward branch's body:
    the kernel's last loop (the GEMMs' K loop)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    span = None
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            span = (int(m.group(1), 16), addr)
    assert span is not None, "no loop in the SASS"
    return [t for a, t in ins if span[0] <= a <= span[1]]


def outer_loop_instructions(sass: str) -> list[str]:
    """The body of the widest CONDITIONAL backward branch: the K loop also where the kernel
    waits on mbarriers, whose try-wait retries ptxas places out of line after the function's
    end (a conditional self-loop, then an unconditional branch back into the K loop - both
    backward, so loop_instructions' "last backward branch" would pick them). For the cp.async
    kernels it is the same loop as loop_instructions'."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    span = None
    for addr, text in ins:
        m = re.search(r"^\s*@!?U?P\w+\s+BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and \
                (span is None or addr - int(m.group(1), 16) > span[1] - span[0]):
            span = (int(m.group(1), 16), addr)
    assert span is not None, "no conditional loop in the SASS"
    return [t for a, t in ins if span[0] <= a <= span[1]]


def branch_loops(sass: str, innermost: bool = False) -> list[list[str]]:
    """The bodies (instruction texts up to the ';', stripped) of the conditional backward
    branches longer than 16 instructions, in address order: the loops of a warp-specialized
    kernel's partitions (the mbarrier try-wait retries ptxas moves out of line are 2-3
    instructions). innermost: only the loops that hold no other (a persistent tile loop holds
    its K loops)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = []
    for addr, text in ins:
        m = re.search(r"^@!?U?P\w+\s+BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr - 16 * 16:
            spans.append((int(m.group(1), 16), addr))
    if innermost:
        spans = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1]
                                             for o in spans)]
    return [[t for a, t in ins if lo <= a <= hi] for lo, hi in spans]


def partition_loops(sass: str, marks: tuple[tuple[str, str], ...],
                    innermost: bool = False) -> dict[str, list[list[str]]]:
    """The branch_loops of a warp-specialized kernel by partition: marks are (partition, SASS
    pattern of what only it runs) pairs; a loop goes to the first partition whose pattern one
    of its instructions matches, a loop matching none is left out."""
    loops: dict[str, list[list[str]]] = {name: [] for name, _ in marks}
    for body in branch_loops(sass, innermost):
        kind = next((name for name, pat in marks if any(re.search(pat, t) for t in body)), None)
        if kind:
            loops[kind].append(body)
    return loops


def last_loop(sass: str) -> str:
    """loop_instructions as one text, an instruction a line."""
    return "\n".join(loop_instructions(sass))


def gluon_sm90(fn, types: dict, consts: dict, **options):
    """The @gluon.jit kernel fn compiled ahead of time for sm_90: `consts` its constexprs, the
    other arguments typed by `types`, the pointers, strides, N and K 16-divisible (what the
    launchers' arguments specialize to at the real shapes); options go to triton.compile
    (num_warps, maxnreg). Skips where this Triton has no ahead-of-time Gluon compile API."""
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        pytest.skip("this triton has no ahead-of-time Gluon compile API")
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    div = [n for n in types if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    return triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 128), options=options)


def count(body, pat: str) -> int:
    """How many instructions of `body` (a list of SASS lines) match the regex `pat`."""
    return sum(1 for t in body if re.search(pat, t))


# the synchronization / copy / upcast patterns the Gluon decode kernels' build tests count per
# K chunk (each test adds its wgmma's own pattern)
SYNC_COUNTS = [
    ("ARRIVE", r"WARPGROUP\.ARRIVE"), ("WG_DEPBAR", r"WARPGROUP\.DEPBAR"),
    ("BAR_SYNC", r"\bBAR\.SYNC"), ("DEPBAR", r"^(@\S+\s+)?DEPBAR"),
    ("LDGSTS128", r"\bLDGSTS\.E\.BYPASS\.128\b"), ("LDGSTS", r"\bLDGSTS\.E\s"),
    ("LDS128", r"\bLDS\.128\b"), ("STS", r"\bSTS"), ("PRMT", r"\bPRMT\b"),
    ("UTMALDG", r"\bUTMALDG\b"), ("TRYWAIT", r"SYNCS\.PHASECHK"),
    ("EXPECT", r"SYNCS\.ARRIVE\.TRANS64"), ("FENCE", r"\bFENCE\.VIEW\.ASYNC\.S\b")]


def build_stats(kernel, types: dict, consts: dict, counts, num_warps: int,
                loop=outer_loop_instructions):
    """(registers, shared bytes, K-loop instructions, {name: count} of `counts` patterns) of an
    sm_90 build of a Gluon kernel, with no stack and no local memory (spills) asserted. The K
    loop is `loop`'s: outer_loop_instructions' by default (the mbarrier retry loops sit after
    the function end), loop_instructions' for a kernel without mbarrier waits."""
    k = gluon_sm90(kernel, types, consts, num_warps=num_warps)
    usage, sass = usage_and_sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills) in the kernel"
    body = [t.strip() for t in loop(sass)]
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    return regs, k.metadata.shared, body, {n: count(body, p) for n, p in counts}
