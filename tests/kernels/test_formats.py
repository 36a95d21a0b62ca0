"""Number formats: exact values, round trips, block inference, quantization error bounds."""

import pytest
import torch

from megagraph.kernels import formats as F


def _gen():
    # fresh random inputs every run (seed printed on failure via the assertion message)
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    return torch.Generator().manual_seed(seed), seed


# ---------------------------------------------------------------------------------------------- dtypes


def test_dtype_table_roundtrips():
    names = ["bf16", "f16", "f32", "f64", "fp8e4m3", "e8m0", "fp4x2", "i8", "u8", "i32", "i64", "bool"]
    assert list(F.DTYPES) == names
    for n in names:
        d = F.DTYPES[n]
        assert torch.empty(0, dtype=d.torch).element_size() == d.itemsize == F.ir_itemsize(n)
        packed = n == "fp4x2"
        assert F.torch_to_ir(F.ir_to_torch(n), packed_fp4=packed) == n
        assert F.safetensors_to_ir(F.ir_to_safetensors(n), packed_fp4=packed) == n
    assert F.ir_to_safetensors("fp4x2") == "I8" and F.ir_to_torch("fp4x2") == torch.int8
    assert F.ir_to_safetensors("e8m0") == "F8_E8M0" and F.ir_to_safetensors("fp8e4m3") == "F8_E4M3"
    assert F.torch_to_ir(torch.int8) == "i8"
    with pytest.raises(ValueError):
        F.ir_to_torch("fp16")
    with pytest.raises(ValueError):
        F.safetensors_to_ir("C64")


# ---------------------------------------------------------------------------------------------- e8m0


def test_e8m0_exact_values():
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    f = F.e8m0_to_f32(s)
    exp = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(f[:255].double(), exp)
    assert f[0].item() == 2.0**-127 and f[127].item() == 1.0 and f[254].item() == 2.0**127
    assert torch.isnan(f[255])
    # torch's own e8m0 decoding agrees for the finite range
    e = s.view(torch.float8_e8m0fnu)
    assert torch.equal(F.e8m0_to_f32(e)[:255], e.float()[:255])
    # int codes accepted too
    assert torch.equal(F.e8m0_to_f32(torch.tensor([126, 130])), torch.tensor([0.5, 8.0]))


def test_f32_to_e8m0_roundtrip_and_rounding():
    s = torch.arange(255, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    back = F.f32_to_e8m0(F.e8m0_to_f32(s), rounding="exact")
    assert back.dtype == torch.float8_e8m0fnu
    assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    x = torch.tensor([3.0, 0.75, 1.0, 5.0])
    assert F.f32_to_e8m0(x).view(torch.uint8).tolist() == [129, 127, 127, 130]
    assert F.f32_to_e8m0(x, rounding="floor").view(torch.uint8).tolist() == [128, 126, 127, 129]
    with pytest.raises(ValueError):
        F.f32_to_e8m0(x, rounding="exact")
    with pytest.raises(ValueError):
        F.f32_to_e8m0(torch.tensor([0.0]))
    assert F.f32_to_e8m0(torch.tensor([2.0**-140, 1e38 * 3])).view(torch.uint8).tolist() == [0, 254]


# ---------------------------------------------------------------------------------------------- e2m1


def test_e2m1_known_codes():
    vals = F.e2m1_to_f32(torch.arange(16, dtype=torch.uint8))
    assert vals.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(vals[8])
    # every grid value maps back to its own code
    assert torch.equal(F.f32_to_e2m1_codes(vals), torch.arange(16, dtype=torch.uint8))
    # int8 nibble codes and high bits ignored
    assert F.e2m1_to_f32(torch.tensor([0x17], dtype=torch.int32)).item() == 6.0


def test_e2m1_rounding_ties_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 4.9, 5.1, 6.5, 1e9, float("inf")])
    c = F.f32_to_e2m1_codes(x)
    assert F.e2m1_to_f32(c).tolist() == [0, 1, 1, 2, 2, 4, 4, 0.5, 0.5, 4, 6, 6, 6, 6]
    assert F.f32_to_e2m1_codes(-x).tolist() == (c | 8).tolist()
    away = F.e2m1_to_f32(F.f32_to_e2m1_codes(x[:7], ties="away")).tolist()
    assert away == [0.5, 1, 1.5, 2, 3, 4, 6]


def test_e2m1_nearest_matches_bruteforce():
    g, seed = _gen()
    x = torch.randn(4096, generator=g) * 3
    got = F.e2m1_to_f32(F.f32_to_e2m1_codes(x))
    grid = torch.tensor(F.E2M1_VALUES)
    best = grid[(x.abs()[:, None] - grid).abs().argmin(1)] * torch.sign(x)
    # ties have probability ~0 for random floats
    assert torch.equal(got.abs(), best.abs()), seed
    assert torch.equal(torch.signbit(got), torch.signbit(x)), seed


def test_pack_nibble_order():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    p = F.pack_e2m1(codes)
    assert p.dtype == torch.int8 and p.shape == (1, 2)
    assert p.view(torch.uint8).tolist() == [[0x21, 0xF3]]  # low nibble = even column
    assert torch.equal(F.unpack_e2m1(p), codes)
    with pytest.raises(ValueError):
        F.pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_pack_unpack_roundtrip_random():
    g, seed = _gen()
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(F.unpack_e2m1(F.pack_e2m1(codes)), codes), seed
    raw = torch.randint(-128, 128, (7, 33), generator=g, dtype=torch.int8)
    assert torch.equal(F.pack_e2m1(F.unpack_e2m1(raw)), raw), seed


# ---------------------------------------------------------------------------------------------- fp8 block


@pytest.mark.parametrize("shape,block", [((64, 96), 32), ((100, 70), 32), ((256, 384), 128), ((300, 130), 128),
                                         ((1, 5), 32), ((33, 129), 128)])
def test_fp8_block_shapes_inference_and_error_bound(shape, block):
    g, seed = _gen()
    w = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 3)
    q, s = F.quantize_fp8_block(w, block)
    O, I = shape
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (-(-O // block), -(-I // block))
    if s.shape[0] > 1 or s.shape[1] > 1:
        assert F.infer_block_size(q.shape, s.shape)[s.shape[0] == 1] == block
    d = F.dequantize_fp8_block(q, s)
    assert d.shape == w.shape and d.dtype == torch.float32
    # identical to dequantizing with the explicit block
    assert torch.equal(d, F.dequantize_fp8_block(q, s, block))
    # scale is 2^ceil(log2(amax/448)): every block's max |q| lies in (224, 448]
    sf = F.e8m0_to_f32(s).repeat_interleave(block, 0).repeat_interleave(block, 1)[:O, :I]
    err = (d - w).abs()
    bound = torch.maximum(w.abs() * 2.0**-4, sf * 2.0**-10)
    assert bool((err <= bound).all()), seed
    qf = q.float().abs()
    for bo in range(s.shape[0]):
        for bi in range(s.shape[1]):
            m = qf[bo * block:(bo + 1) * block, bi * block:(bi + 1) * block].max().item()
            assert 224 <= m <= 448, (seed, m)


def test_fp8_block_exact_for_representable_values():
    # values e4m3(k) * 2^e with a per-block power-of-two scale survive exactly
    g, seed = _gen()
    codes = torch.randint(0, 256, (64, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # drop NaNs
    base = codes.view(torch.float8_e4m3fn).float()
    base[0, 0] = 448.0
    base[0, 32] = base[32, 0] = base[32, 32] = 448.0  # every block's amax is exactly 448
    w = base * 2.0**-7
    q, s = F.quantize_fp8_block(w)
    assert torch.equal(F.e8m0_to_f32(s), torch.full((2, 2), 2.0**-7))
    assert torch.equal(F.dequantize_fp8_block(q, s), w), seed


def test_fp8_block_zero_block_and_scale_known_values():
    w = torch.zeros(64, 64)
    w[:32, 32:] = 448.0 * 4
    w[32:, :32] = 449.0  # just above 448 -> next power of two
    w[32:, 32:] = 1.0
    q, s = F.quantize_fp8_block(w)
    assert F.e8m0_to_f32(s).tolist() == [[1.0, 4.0], [2.0, 2.0**-8]]
    assert torch.equal(F.dequantize_fp8_block(q, s)[:32], w[:32])


def test_fp8_block_inference_rejects_mismatch():
    q = torch.zeros(100, 70, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        F.dequantize_fp8_block(q, torch.ones(3, 3, dtype=torch.float8_e8m0fnu))
    with pytest.raises(ValueError):
        F.dequantize_fp8_block(q, torch.ones(4, 3, dtype=torch.float8_e8m0fnu), 128)
    with pytest.raises(ValueError):
        F.quantize_fp8_block(torch.tensor([[float("nan")]]))


def test_fp8_rows():
    g, seed = _gen()
    t = torch.randn(50, 256, generator=g) * torch.rand(50, 1, generator=g) * 10
    q, s = F.quantize_fp8_rows(t)
    assert q.shape == (50, 256) and s.shape == (50, 8) and s.dtype == torch.float8_e8m0fnu
    d = F.dequantize_fp8_rows(q, s)
    sf = F.e8m0_to_f32(s).repeat_interleave(32, 1)
    assert bool(((d - t).abs() <= torch.maximum(t.abs() * 2.0**-4, sf * 2.0**-10)).all()), seed
    # row-wise: a gathered subset dequantizes identically
    idx = torch.tensor([3, 17, 49])
    assert torch.equal(F.dequantize_fp8_rows(q[idx], s[idx]), d[idx])


# ---------------------------------------------------------------------------------------------- mxfp4


def test_mxfp4_shapes_and_error_bound():
    g, seed = _gen()
    w = torch.randn(48, 256, generator=g) * torch.exp(torch.randn(48, 1, generator=g))
    p, s = F.quantize_mxfp4(w)
    assert p.dtype == torch.int8 and p.shape == (48, 128)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (48, 8)
    d = F.unpack_mxfp4(p, s)
    sf = F.e8m0_to_f32(s).repeat_interleave(32, 1)
    err = (d - w).abs()
    assert bool((err <= torch.maximum(w.abs() / 4, sf / 4)).all()), seed
    amax = w.abs().reshape(48, 8, 32).amax(-1).repeat_interleave(32, 1)
    assert bool((err <= amax / 4).all()), seed
    # amax/scale lies in (3, 6], so every block's max |code value| is in [3, 6] after rounding
    v = F.e2m1_to_f32(F.unpack_e2m1(p)).abs().reshape(48, 8, 32).amax(-1)
    assert bool(((v >= 3) & (v <= 6)).all()), seed


def test_mxfp4_exact_roundtrip_of_representable():
    g, seed = _gen()
    codes = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    codes[:, 0] = 7  # each 32-block holds a 6 -> scale exact
    codes[:, 32] = 15
    exps = torch.randint(-5, 6, (16, 2), generator=g)
    w = F.e2m1_to_f32(codes) * torch.exp2(exps.float()).repeat_interleave(32, 1)
    p, s = F.quantize_mxfp4(w)
    assert torch.equal(F.e8m0_to_f32(s), torch.exp2(exps.float()))
    # -0.0 codes compare equal to +0.0 values: compare decoded floats
    assert torch.equal(F.unpack_mxfp4(p, s), w), seed
    c2 = F.unpack_e2m1(p)
    nz = (codes & 7) != 0
    assert torch.equal(c2[nz], codes[nz]), seed


def test_mxfp4_known_packing():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 6.0, -0.5, 1.5, -3.0
    p, s = F.quantize_mxfp4(w)
    assert F.e8m0_to_f32(s).tolist() == [[1.0]]
    assert p.view(torch.uint8)[0, :2].tolist() == [0x97, 0xD3]
    with pytest.raises(ValueError):
        F.quantize_mxfp4(torch.zeros(2, 48))


def test_batched_dequantizers_match_per_expert():
    g, seed = _gen()
    w = torch.randn(3, 70, 64, generator=g)
    # (quantizer, its dequantizer, scales of a wrong shape for the batch)
    for quant, dequant, wrong in ((F.quantize_fp8_block, F.dequantize_fp8_block, lambda s: s[0]),
                                  (F.quantize_mxfp4, F.unpack_mxfp4, lambda s: s[:2])):
        per_expert = [quant(w[e]) for e in range(3)]
        codes = torch.stack([c for c, _ in per_expert])
        scales = torch.stack([sc for _, sc in per_expert])
        d = dequant(codes, scales)
        assert d.shape == (3, 70, 64)
        for e in range(3):
            assert torch.equal(d[e], dequant(*per_expert[e])), seed
        with pytest.raises(ValueError):
            dequant(codes, wrong(scales))
