"""Writer + reader on real safetensors files: round trips, dequantization, stacking, damage detection."""

import json
import os
import struct
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megagraph.kernels import formats as F
from megagraph.models import checkpoint as C
from megagraph.models.checkpoint import (
    CheckpointError,
    WeightSpec,
    bytes_needed,
    open_checkpoint,
    random_weights,
    write_checkpoint,
    write_random_checkpoint,
)
from megagraph.models.checkpoint.testing import tiny_v41_specs

SEED = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh random weights every run


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:  # fp8 / e8m0 / int8: compare bytes (NaN-safe, -0 exact)
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def specs():
    return tiny_v41_specs()


@pytest.fixture()
def ckpt(tmp_path, specs):
    """A several-shard random checkpoint; returns its directory."""
    return write_random_checkpoint(tmp_path / "ck", specs, seed=SEED, max_shard_bytes=40_000)


def _shards(d: Path):
    return sorted(d.glob("model-*.safetensors"))


# --------------------------------------------------------------------------------------------- layout


def test_layout_and_index(ckpt, specs):
    shards = _shards(ckpt)
    n = len(shards)
    assert n >= 4, "test must span several shards"
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"].values()) == {p.name for p in shards}
    flat = C.expand_spec(specs)
    assert set(idx["weight_map"]) == {s.name for s in flat}
    assert idx["metadata"]["total_size"] == sum(s.nbytes for s in flat) == bytes_needed(specs)
    assert idx["metadata"]["seed"] == SEED
    ck = open_checkpoint(ckpt)
    assert ck.metadata()["total_size"] == ck.total_size == bytes_needed(specs)
    assert len(ck) == len(flat) and "layers.0.ffn.experts.3.w2.scale" in ck
    # headers agree with the storage dtypes of the specs
    for s in flat:
        assert ck.info(s.name).dtype == s.safetensors_dtype and ck.info(s.name).shape == s.shape
    assert ck.info("layers.0.ffn.experts.0.w1.weight").dtype == "I8"
    assert ck.info("layers.0.attn.wq_a.scale").dtype == "F8_E8M0"


# --------------------------------------------------------------------------------------------- round trips


def test_roundtrip_exact_stacked(ckpt, specs):
    got = open_checkpoint(ckpt).load(specs, progress=False)
    ref = random_weights(specs, seed=SEED, stacked=True)
    assert list(got) == [s.name for s in specs]
    for k in ref:
        assert _equal(got[k], ref[k]), k
    w1 = got["layers.1.ffn.experts.*.w1.weight"]
    assert w1.shape == (4, 64, 32) and w1.dtype == torch.int8


def test_roundtrip_unstacked_specs_equal_stacked(ckpt):
    per_expert = tiny_v41_specs(stacked=False)
    got = open_checkpoint(ckpt).load(per_expert, progress=False)
    stacked = open_checkpoint(ckpt).load(tiny_v41_specs(), progress=False)
    for e in range(4):
        assert _equal(got[f"layers.0.ffn.experts.{e}.w3.weight"], stacked["layers.0.ffn.experts.*.w3.weight"][e])
        assert _equal(got[f"layers.0.ffn.experts.{e}.w3.scale"], stacked["layers.0.ffn.experts.*.w3.scale"][e])


def test_roundtrip_arbitrary_tensors_single_file_and_subset(tmp_path):
    g = torch.Generator().manual_seed(SEED)
    t = {
        "a.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
        "c": torch.randint(-5, 5, (4, 4), generator=g, dtype=torch.int32),
        "d": torch.rand(6, generator=g) > 0.5,
        "e": torch.randint(0, 255, (3,), generator=g).to(torch.uint8),
        "f": torch.randn(2, 3, generator=g)[:, 1],  # non-contiguous view
    }
    d = write_checkpoint(tmp_path / "one", t, single_file=True, metadata={"note": "x", "n": 3})
    assert sorted(os.listdir(d)) == ["model.safetensors"]
    ck = open_checkpoint(d)
    assert ck.metadata()["note"] == "x" and ck.metadata()["total_size"] == sum(v.nbytes for v in t.values())
    specs = [WeightSpec(k, tuple(v.shape), F.torch_to_ir(v.dtype)) for k, v in t.items()]
    got = ck.load(specs, progress=False)
    for k in t:
        assert _equal(got[k], t[k].contiguous()), k
    # a single file path works too; a subset of specs warns about the rest
    with pytest.warns(UserWarning, match="not in the specs"):
        sub = open_checkpoint(d / "model.safetensors").load(specs[:2], progress=False)
    assert list(sub) == ["a.weight", "b"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_checkpoint(d).load(specs[:2], progress=False, warn_unexpected=False)


def test_progress_bar_in_bytes(ckpt, specs, capsys):
    open_checkpoint(ckpt).load(specs, progress=True)
    err = capsys.readouterr().err
    assert "loading weights" in err and "100%" in err and "B/s" in err
    open_checkpoint(ckpt).load(specs, progress=False)
    assert capsys.readouterr().err == ""


def test_bytes_needed_matches_load(ckpt, specs):
    ck = open_checkpoint(ckpt)
    got = ck.load(specs, progress=False)
    assert sum(t.numel() * t.element_size() for t in got.values()) == ck.bytes_needed(specs) == bytes_needed(specs)
    deq = ck.load(specs, dequantize=True, progress=False)
    assert sum(t.numel() * t.element_size() for t in deq.values()) == bytes_needed(specs, dequantize=True)


# --------------------------------------------------------------------------------------------- dequantize


def test_dequantize_matches_formats(ckpt, specs):
    ck = open_checkpoint(ckpt)
    q = ck.load(specs, progress=False)
    d = ck.load(specs, dequantize=True, progress=False)
    assert not any(k.endswith(".scale") for k in d)
    # fp8 block with a ragged edge (q_lora = 48 -> scale [2, 2])
    w = d["layers.0.attn.wq_a.weight"]
    assert w.dtype == torch.float32 and w.shape == (48, 64)
    assert torch.equal(w, F.dequantize_fp8_block(q["layers.0.attn.wq_a.weight"], q["layers.0.attn.wq_a.scale"]))
    # stacked mxfp4 experts
    e = d["layers.1.ffn.experts.*.w2.weight"]
    assert e.shape == (4, 64, 64)
    for i in range(4):
        ref = F.unpack_mxfp4(q["layers.1.ffn.experts.*.w2.weight"][i], q["layers.1.ffn.experts.*.w2.scale"][i])
        assert torch.equal(e[i], ref)
    # Engram rows (scale [rows, W/32])
    t = d["layers.1.engram.embed.weight"]
    assert torch.equal(t, F.dequantize_fp8_rows(q["layers.1.engram.embed.weight"], q["layers.1.engram.embed.scale"]))
    # dequantized values are close to a N(0, 0.02) draw: within the formats' error bounds of the float
    assert 0.01 < float(w.std()) < 0.04 and 0.01 < float(e.std()) < 0.04
    # non-quantized tensors untouched; bf16 dequant dtype
    assert _equal(d["layers.0.attn_norm.weight"], q["layers.0.attn_norm.weight"])
    d16 = ck.load(specs, dequantize=True, dequant_dtype=torch.bfloat16, progress=False)
    assert d16["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16


def test_v4_128_blocks_dequantize(tmp_path):
    specs = C.fp8_linear_specs("layers.0.attn.wq_b", 300, 130, block=128)
    d = write_random_checkpoint(tmp_path / "v4", specs, seed=SEED)
    ck = open_checkpoint(d)
    q = ck.load(specs, progress=False)
    assert q["layers.0.attn.wq_b.scale"].shape == (3, 2)
    w = ck.load(specs, dequantize=True, progress=False)["layers.0.attn.wq_b.weight"]
    assert torch.equal(w, F.dequantize_fp8_block(q["layers.0.attn.wq_b.weight"], q["layers.0.attn.wq_b.scale"], 128))


def test_stacked_fp8_dequantize(tmp_path):
    specs = [WeightSpec("l.experts.*.w.weight", (3, 40, 64), "fp8e4m3"), WeightSpec("l.experts.*.w.scale", (3, 2, 2), "e8m0")]
    d = write_random_checkpoint(tmp_path / "s", specs, seed=SEED)
    ck = open_checkpoint(d)
    q = ck.load(specs, progress=False)
    w = ck.load(specs, dequantize=True, progress=False)["l.experts.*.w.weight"]
    for e in range(3):
        ref = F.dequantize_fp8_block(q["l.experts.*.w.weight"][e], q["l.experts.*.w.scale"][e])
        assert torch.equal(w[e], ref)


def test_random_weights_properties(specs):
    a = random_weights(specs, seed=SEED)
    b = random_weights(list(reversed(specs)), seed=SEED)
    assert a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)  # order independent
    c = random_weights(specs, seed=SEED + 1)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    norm = a["layers.0.attn_norm.weight"].float()
    assert abs(float(norm.mean()) - 1) < 0.02 and float(norm.std()) < 0.05
    assert a["layers.0.hc_attn_fn"].dtype == torch.float32 and abs(float(a["layers.0.hc_attn_fn"].mean())) < 0.01
    assert a["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert a["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    with pytest.raises(C.SpecError):
        random_weights([s for s in specs if not s.name.endswith("wq_a.scale")], seed=0)


# --------------------------------------------------------------------------------------------- errors


def _err(fn) -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        fn()
    return ei.value


def test_missing_tensor_lists_names(ckpt, specs):
    extra = [WeightSpec("layers.9.attn.wq_a.weight", (48, 64), "fp8e4m3"),
             WeightSpec("layers.9.attn.wq_a.scale", (2, 2), "e8m0")]
    e = _err(lambda: open_checkpoint(ckpt).load(specs + extra, progress=False))
    assert e.tensor == "layers.9.attn.wq_a.weight"
    assert "model.safetensors.index.json" in str(e) and "layers.9.attn.wq_a.scale" in str(e)
    assert "2 expected tensor(s) missing" in str(e)


def test_mis_shaped_tensor(ckpt, specs):
    bad = [WeightSpec(s.name, (s.shape[0], s.shape[1], s.shape[2] + 1), s.dtype)
           if s.name == "layers.1.ffn.experts.*.w2.weight" else s for s in specs]
    e = _err(lambda: open_checkpoint(ckpt).load(bad, progress=False))
    assert e.tensor == "layers.1.ffn.experts.0.w2.weight"
    assert e.file.endswith(".safetensors") and Path(e.file).name in str(e)
    assert "expected [64, 33], found [64, 32]" in str(e)
    assert len(e.problems) == 4  # one per expert, all reported


def test_wrong_dtype(ckpt, specs):
    """A narrower or different float is refused (a wider one is accepted: test_reinterpreted_dtypes)."""
    bad = [WeightSpec(s.name, s.shape, "f16") if s.name == "layers.0.attn_norm.weight" else s for s in specs]
    e = _err(lambda: open_checkpoint(ckpt).load(bad, progress=False))
    assert e.tensor == "layers.0.attn_norm.weight"
    assert "expected f16 (F16 or F32 or F64), found BF16" in str(e)
    bad = [WeightSpec(s.name, s.shape, "f32") if s.name == "layers.0.attn_norm.weight" else s for s in specs]
    e = _err(lambda: open_checkpoint(ckpt).load(bad, progress=False))
    assert e.tensor == "layers.0.attn_norm.weight" and "expected f32 (F32 or F64), found BF16" in str(e)
    assert Path(e.file).name.startswith("model-0")
    # cast_floats accepts it and converts
    got = open_checkpoint(ckpt).load(bad, progress=False, cast_floats=True)
    assert got["layers.0.attn_norm.weight"].dtype == torch.float32


def test_stacked_members_stored_wider_keep_their_precision_only_when_asked(tmp_path, caplog):
    """A stack whose members are stored in different float widths comes back in the widest with
    keep_wider (no member rounded), else in the declared dtype; one line says which."""
    import logging

    g = torch.Generator().manual_seed(SEED)
    members = [torch.randn(4, 5, generator=g) for _ in range(3)]
    stored = {"e.0.w": members[0].to(torch.bfloat16), "e.1.w": members[1],
              "e.2.w": members[2].to(torch.bfloat16)}
    path = write_checkpoint(tmp_path / "ck", stored)
    spec = [WeightSpec("e.*.w", (3, 4, 5), "bf16")]
    with caplog.at_level(logging.WARNING, logger="megagraph.checkpoint"):
        kept = open_checkpoint(path).load(spec, progress=False, keep_wider=True)["e.*.w"]
        rounded = open_checkpoint(path).load(spec, progress=False)["e.*.w"]
    assert kept.dtype == torch.float32 and torch.equal(kept[1], members[1])
    assert torch.equal(kept[0], stored["e.0.w"].float()) and torch.equal(kept[2], stored["e.2.w"].float())
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded[1], members[1].to(torch.bfloat16))
    lines = [r.getMessage() for r in caplog.records if r.name == "megagraph.checkpoint"]
    assert len(lines) == 2
    assert "1 tensor(s) declared BF16 stored as wider F32, kept as F32 (e.g. e.1.w)" in lines[0]
    assert "rounded to the declared BF16" in lines[1]


def test_validation_happens_before_reading(ckpt, specs, monkeypatch):
    from megagraph.models.checkpoint import reader

    def boom(*a, **k):
        raise AssertionError("data read before validation")

    monkeypatch.setattr(reader, "safe_open", boom)
    bad = specs + [WeightSpec("nope", (1,), "f32")]
    _err(lambda: open_checkpoint(ckpt).load(bad, progress=False))


def test_truncated_shard(ckpt):
    shard = _shards(ckpt)[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    e = _err(lambda: open_checkpoint(ckpt))
    assert e.file == str(shard) and "truncated" in str(e) and shard.name in str(e)
    assert e.tensor is not None and e.tensor in str(e)
    # cut inside the header, too
    shard.write_bytes(data[:20])
    e = _err(lambda: open_checkpoint(ckpt))
    assert e.file == str(shard) and "truncated" in str(e)


def test_corrupt_header(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    hdr = b"{not json"
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr)
    e = _err(lambda: open_checkpoint(d))
    assert "model.safetensors" in str(e) and "corrupt header" in str(e)


def test_index_missing_shard(ckpt):
    shard = _shards(ckpt)[2]
    shard.unlink()
    e = _err(lambda: open_checkpoint(ckpt))
    assert e.file == str(shard) and "missing shard" in str(e) and e.tensor in str(e)


def test_index_tensor_not_in_shard(ckpt):
    idx_path = ckpt / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    shards = sorted(set(idx["weight_map"].values()))
    name = next(k for k, v in idx["weight_map"].items() if v == shards[0])
    idx["weight_map"][name] = shards[1]
    idx_path.write_text(json.dumps(idx))
    e = _err(lambda: open_checkpoint(ckpt))
    assert e.tensor == name and shards[1] in str(e)


def test_malformed_index_json(ckpt):
    idx_path = ckpt / "model.safetensors.index.json"
    idx_path.write_text(idx_path.read_text()[:-20])
    e = _err(lambda: open_checkpoint(ckpt))
    assert e.file == str(idx_path) and "malformed index JSON" in str(e)
    idx_path.write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in str(_err(lambda: open_checkpoint(ckpt)))


def test_total_size_mismatch_warns(ckpt):
    idx_path = ckpt / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["metadata"]["total_size"] += 1
    idx_path.write_text(json.dumps(idx))
    with pytest.warns(UserWarning, match="total_size"):
        open_checkpoint(ckpt)


def test_missing_dir_and_empty_dir(tmp_path):
    assert "not found" in str(_err(lambda: open_checkpoint(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    assert "model.safetensors.index.json" in str(_err(lambda: open_checkpoint(tmp_path / "empty")))


def test_read_failure_names_file_and_tensor(ckpt, specs, monkeypatch):
    from megagraph.models.checkpoint import reader

    real = reader.safe_open

    class Flaky:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def get_tensor(self, name):
            raise OSError("disk on fire")

    monkeypatch.setattr(reader, "safe_open", Flaky)
    e = _err(lambda: open_checkpoint(ckpt).load(specs, progress=False))
    assert "disk on fire" in str(e) and e.tensor and e.file.endswith(".safetensors")


# --------------------------------------------------------------------------------------------- writer safety


def test_failed_write_leaves_nothing(tmp_path, specs, monkeypatch):
    from megagraph.models.checkpoint import writer

    calls = []
    real = writer.save_file

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("no space left on device")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", failing)
    w = random_weights(specs, seed=SEED)
    with pytest.raises(CheckpointError, match="no space left"):
        write_checkpoint(tmp_path / "out", w, max_shard_bytes=40_000)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir
    # an existing checkpoint survives a failed overwrite untouched
    monkeypatch.setattr(writer, "save_file", real)
    good = write_checkpoint(tmp_path / "out", {"x": torch.ones(3)})
    before = sorted(p.name for p in good.iterdir())
    calls.clear()
    monkeypatch.setattr(writer, "save_file", failing)
    with pytest.raises(CheckpointError):
        write_checkpoint(tmp_path / "out", w, max_shard_bytes=40_000, overwrite=True)
    assert sorted(p.name for p in good.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert torch.equal(open_checkpoint(good).load([WeightSpec("x", (3,), "f32")], progress=False)["x"], torch.ones(3))


def test_overwrite_rules(tmp_path):
    d = write_checkpoint(tmp_path / "o", {"x": torch.ones(2)})
    with pytest.raises(FileExistsError):
        write_checkpoint(d, {"y": torch.zeros(2)})
    write_checkpoint(d, {"y": torch.zeros(2)}, overwrite=True)
    ck = open_checkpoint(d)
    assert ck.keys() == ["y"]
    (tmp_path / "empty").mkdir()
    write_checkpoint(tmp_path / "empty", {"z": torch.ones(1)})  # empty dir is fine
    assert open_checkpoint(tmp_path / "empty").keys() == ["z"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "o"]


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="stacked"):
        write_checkpoint(tmp_path / "a", {"e.*.w": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="total_size"):
        write_checkpoint(tmp_path / "a", {"x": torch.ones(1)}, metadata={"total_size": 3})
    assert not (tmp_path / "a").exists()


def test_shared_storage_views_are_written(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    d = write_checkpoint(tmp_path / "v", {f"r{i}": base[i] for i in range(3)})
    got = open_checkpoint(d).load([WeightSpec(f"r{i}", (4,), "f32") for i in range(3)], progress=False)
    assert all(torch.equal(got[f"r{i}"], base[i]) for i in range(3))


def test_reads_safetensors_written_by_others(tmp_path):
    # an HF-style single-file checkpoint written directly by safetensors
    d = tmp_path / "hf"
    d.mkdir()
    q, s = F.quantize_fp8_block(torch.randn(64, 64))
    save_file({"l.weight": q, "l.scale": s}, str(d / "model.safetensors"))
    specs = C.fp8_linear_specs("l", 64, 64)
    out = open_checkpoint(d).load(specs, dequantize=True, progress=False)
    assert torch.equal(out["l.weight"], F.dequantize_fp8_block(q, s))
