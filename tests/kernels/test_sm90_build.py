"""sm90_build's loop finder on hand-written SASS (CPU, no compiler): the partition loops the
warp-specialized Gluon build tests pin are the long conditional backward branches, innermost
ones where asked, each given to the first partition whose pattern it holds."""
from __future__ import annotations

from sm90_build import branch_loops, partition_loops


def _sass(lines: list[str]) -> str:
    """cuobjdump-style SASS: one instruction every 16 bytes from address 0."""
    return "\n".join(f"        /*{16 * i:04x}*/        {t} ;" for i, t in enumerate(lines))


def _program() -> tuple[str, list[str]]:
    """A persistent tile loop (0 .. 60) around two K loops (2 .. 25: HGMMA, 30 .. 55: STS.128),
    an out-of-line try-wait retry (70 .. 72: too short to count) and an unconditional backward
    branch (75 -> 62: not a loop here)."""
    lines = [f"IADD3 R{i % 8}, R1, R2, RZ" for i in range(80)]
    lines[5] = "HGMMA.64x128x16.F32 R24, gdesc[UR4], R24"
    lines[25] = "@P0 BRA 0x20"
    lines[33] = "STS.128 [R1], R4"
    lines[55] = "@!P1 BRA `(0x1e0)"
    lines[60] = "@!UP0 BRA 0x0"
    lines[71] = "SYNCS.PHASECHK.TRANS64 P0, [R1], R2"
    lines[72] = "@!P0 BRA 0x460"
    lines[75] = "BRA 0x3e0"
    return _sass(lines), lines


def test_branch_loops_and_partitions():
    sass, lines = _program()
    body = [t.strip() for t in lines]
    assert branch_loops(sass) == [body[2:26], body[30:56], body[0:61]]
    assert branch_loops(sass, innermost=True) == [body[2:26], body[30:56]]
    marks = (("mma", "HGMMA"), ("upcast", r"\bSTS\.128\b"), ("loader", "UTMALDG"))
    assert partition_loops(sass, marks, innermost=True) == {
        "mma": [body[2:26]], "upcast": [body[30:56]], "loader": []}
    # every loop: the tile loop holds an HGMMA too, and goes to the first mark it matches
    assert partition_loops(sass, marks) == {
        "mma": [body[2:26], body[0:61]], "upcast": [body[30:56]], "loader": []}
    assert partition_loops(sass, (("loader", "UTMALDG"),)) == {"loader": []}
