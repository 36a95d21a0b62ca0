"""MoeConfig / GemmConfig (kernels/moe/config.py, kernels/gemm/config.py): the defaults name the
kernels the dispatcher ran before the choices became config fields, an override changes the
choice, the fields round-trip through the compiler's override path, and nothing under
kernels/moe or kernels/gemm reads the process environment.

V4.1-Flash's MoE: 384 experts of width 5120 (hidden) x 2304 (inter), top-6. Rows per expert =
tokens x 6 / 384: 64 decode tokens give 1, 8192 prefill tokens give 128.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megagraph.kernels import kernel_config as kc
from megagraph.kernels.gemm.config import GemmConfig, Tile, parse_tiles
from megagraph.kernels.kernel_config import KernelConfigError
from megagraph.kernels.moe.config import MoeConfig

FLASH = dict(experts=384, topk=6, hidden=5120, inter=2304)
ROOT = Path(__file__).resolve().parents[3]


def flash(tokens: int) -> dict[str, int]:
    return dict(FLASH, tokens=tokens)


def test_defaults_choose_the_paths_that_ran():
    """Decode (64 tokens): the Gluon decode L1 / L2 on fp16 H, the shared expert on the side
    stream while the router runs; 512 tokens (8 rows per expert) still decode kernels, but the
    side stream only up to 256 tokens; 16-64 rows: the Triton L1 (12 < rows <= 48 untimed for
    Gluon) and from 48 rows the warp-specialized Gluon L2 (F 2304 = 6 x 384); prefill (8192
    tokens): FP8 H on both warp-specialized kernels and the shared expert's FP8 H."""
    c = MoeConfig()
    assert c.choose(flash(64)) == {"h": "fp16", "l1": "gluon_decode", "l2": "gluon_decode_l2",
                                   "shared": "fp16", "shared_overlap": "router"}
    assert c.choose(flash(512)) == {"h": "fp16", "l1": "gluon_decode", "l2": "gluon_decode_l2",
                                    "shared": "fp16", "shared_overlap": "none"}
    assert c.choose(flash(1024))["l1"] == "triton" and c.choose(flash(1024))["l2"] == "triton"
    assert c.choose(flash(4096)) == {"h": "fp16", "l1": "triton", "l2": "gluon_l2_ws",
                                     "shared": "fp16", "shared_overlap": "none"}
    assert c.choose(flash(8192)) == {"h": "fp8", "l1": "gluon_ws_fp8h", "l2": "gluon_l2_fp8",
                                     "shared": "fp8", "shared_overlap": "none"}


def test_defaults_are_the_tuned_values():
    """The field defaults: the values the kernels ran with (docs/kernels/moe.md)."""
    c = MoeConfig()
    assert (c.decode_max_rows, c.prefill_min_rows, c.wide_l1_min_rows) == (12, 48, 100)
    assert (c.ws_rings, c.ws_wide_rings, c.ws_l1_bn, c.wide_bt) == ((6, 3), (4, 2), 128, 64)
    assert c.gate_tile == (128, 64, 4, 3) and c.shared_early_max_tokens == 256
    assert (c.gluon_decode_load, c.gluon_decode_l2_load) == ("tma", "cp.async")
    assert c.fp4_asm == "auto" and not c.exact and not c.fp8_h and c.fp8_h_prefill
    assert (c.deepgemm_mega, c.deepgemm_mega_max_tokens) == ("off", 8192)
    g = GemmConfig()
    assert (g.cublas_form, g.cublas_form_prefill, g.cublas_prefill_rows) == \
        ("1x128", "128x128", 1024)
    assert (g.cublas_min_rows, g.cublas_grouped_min_rows) == (1, 256)
    assert g.choose({"tokens": 64}) == {"linear": "cublas_fp8", "grouped": "triton",
                                        "form": "1x128"}
    assert g.choose({"tokens": 8192}) == {"linear": "cublas_fp8", "grouped": "cublas_fp8",
                                          "form": "128x128"}


def test_overrides_change_the_choice():
    c = MoeConfig()
    assert c.choose(flash(8192))["h"] == "fp8"
    no_fp8 = dataclasses.replace(c, fp8_h_prefill=False).choose(flash(8192))
    assert no_fp8["h"] == "fp16" and no_fp8["l1"] == "gluon_ws_wide"
    assert no_fp8["l2"] == "gluon_l2_ws" and no_fp8["shared"] == "fp16"
    narrow = dataclasses.replace(c, fp8_h_prefill=False, ws_l1_bn=64).choose(flash(8192))
    assert narrow["l1"] == "gluon_ws"
    off = MoeConfig(gluon=False).choose(flash(8192))
    assert off["h"] == "fp16" and off["l1"] == "cublas_grouped" and off["l2"] == "triton"
    assert MoeConfig(gluon=False, cublas_prefill=False).choose(flash(8192))["l1"] == "triton"
    assert MoeConfig(fp8_h=True).choose(flash(64))["h"] == "fp8"
    assert MoeConfig(fp8_h=True).choose(flash(64))["l1"] == "triton"  # no Gluon FP8-H decode
    assert MoeConfig(gluon_decode=False).choose(flash(64))["l1"] == "triton"
    assert MoeConfig(decode_max_rows=0).choose(flash(64))["l2"] == "triton"
    assert MoeConfig(shared_early=False).choose(flash(64))["shared_overlap"] == "none"
    pinned = MoeConfig(tiles=(Tile(16, 64).spec("l1"),)).choose(flash(64))
    assert pinned["l1"] == "triton" and pinned["l2"] == "gluon_decode_l2"
    assert GemmConfig(cublas_fp8=False).choose({"tokens": 64}) == {"linear": "triton",
                                                                   "grouped": "triton"}
    assert GemmConfig(cublas_grouped_min_rows=1).choose({"tokens": 64})["grouped"] == \
        "cublas_fp8"


def test_choose_follows_the_widths():
    """Shape conditions the widths alone decide: the prefill L2 needs d % 128 and F % 384 (else
    Triton's), the FP8-H kernels F % 128 (else fp16 H)."""
    c = MoeConfig()
    assert c.choose(dict(flash(4096), inter=2048))["l2"] == "triton"
    odd = c.choose(dict(flash(8192), inter=2112))  # 2112 = 16.5 x 128
    assert odd["h"] == "fp16" and odd["shared"] == "fp16"


def test_registered_and_resolved_through_the_compiler_path():
    fams = kc.families()
    assert fams["moe"] is MoeConfig and fams["gemm"] is GemmConfig
    assert kc.family_of("mega_moe") == "moe"
    assert kc.family_of("moe_experts_q[act_fmt=fp8_1x128]") == "moe"
    assert kc.family_of("linear_q[act_fmt=fp8_1x128]") == "gemm"
    assert kc.family_of("grouped_linear_q[act_fmt=fp8_1x128]") == "gemm"
    sets = kc.parse_set(["moe.fp8_h_prefill=false", "moe.ws_l2_rings=[8, 3]",
                         "moe.tiles=['l1:bm=16,bn=64,swap=1']", "gemm.cublas_min_rows=64"])
    got = kc.resolve(sets)
    assert got["moe"].fp8_h_prefill is False and got["moe"].ws_l2_rings == (8, 3)
    assert got["moe"].tile_overrides() == {"l1": Tile(16, 64, swap=True)}
    assert got["gemm"].cublas_min_rows == 64
    back = kc.from_plan({k: v.to_dict() for k, v in got.items()})
    assert back == got
    assert kc.config_hash(back) == kc.config_hash(got) != kc.config_hash(kc.resolve({}))
    with pytest.raises(KernelConfigError, match="ws_l1_bn"):
        kc.resolve({"moe": {"ws_l1_bn": 96}})
    with pytest.raises(KernelConfigError, match="no field"):
        kc.resolve({"moe": {"shared_stream": True}})  # dropped: tried and slower


def test_tile_specs():
    t = Tile(16, 128, 128, 4, 3, par=True, swap=True)
    assert parse_tiles((t.spec("l2_fp8h"),)) == {"l2_fp8h": t}
    for bad in ("l1", "l1:bn=16", "l1:bm=16,bn=x", "l1:bm=16,bn=16,colour=1"):
        with pytest.raises(KernelConfigError):
            parse_tiles((bad,))
    with pytest.raises(KernelConfigError):
        MoeConfig(tiles=("l1:bn=16",))


def test_no_environment_reads_under_moe_and_gemm():
    """Every choice is in the configs: no os.environ / os.getenv under kernels/moe or
    kernels/gemm (the Triton interpreter switch comes from configs/process.py)."""
    pat = re.compile(r"\bos\.(environ|getenv|putenv)\b|\bfrom os import\b")
    files = sorted((ROOT / "kernels" / "moe").glob("*.py")) + \
        sorted((ROOT / "kernels" / "gemm").glob("*.py"))
    assert len(files) > 10
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1) if pat.search(line)]
    assert hits == []
