"""V4.1 graph structure: CSA2 ownership, RoPE per layer type, Engram constants (spec §1.2, §1.3, §8)."""

import pytest
import torch

from megagraph.graph.text import parse_graph, print_graph
from megagraph.models.build import build_step
from megagraph.models.config import load_model_config
from megagraph.models.engram import engram_layouts
from megagraph.models.v41 import layer_roles


@pytest.fixture(scope="module")
def full():
    return load_model_config("v4.1-flash")


@pytest.fixture(scope="module")
def full_graph(full):
    return build_step(full)


def nodes_in(g, prefix, op=None):
    return [n for n in g.nodes if n.outputs[0].startswith(prefix) and (op is None or n.op == op)]


def test_layer_roles_match_the_spec_table(full):
    kinds = [r.kind for r in layer_roles(full)]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    roles = layer_roles(full)
    assert roles[7].kv_owner == 2 and roles[7].index_owner == 2
    assert roles[25].kv_owner == 20 and roles[25].index_owner == 24
    assert roles[20].makes_candidates and not roles[20].uses_candidates
    assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.engram_table for r in roles if r.engram_table is not None] == [0, 1]
    assert roles[14].engram_table == 1


def test_reuse_layers_never_touch_a_compressor_or_indexer(full_graph):
    """Spec §8.7: layers 3-19 own no compressor; 21-23, 25-27... reuse the published top-k."""
    for i in list(range(3, 8)) + [21, 22, 23, 25, 39]:
        assert not nodes_in(full_graph, f"L{i}.attn.compressor"), i
        assert not nodes_in(full_graph, f"L{i}.attn.indexer"), i
        assert not [w for w in full_graph.weights if w.startswith(f"layers.{i}.attn.compressor")]
        assert not [w for w in full_graph.weights if w.startswith(f"layers.{i}.attn.indexer")]
    (attn3,) = nodes_in(full_graph, "L3.attn", "sparse_attn")
    assert attn3.inputs[3] == "L2.attn.compressor.ckv.next"  # owner's compressed KV
    assert attn3.inputs[4] == "L2.attn.indexer.topk"  # published top-k, no recomputation
    (attn25,) = nodes_in(full_graph, "L25.attn", "sparse_attn")
    assert attn25.inputs[3] == "L20.attn.compressor.ckv.next"
    assert attn25.inputs[4] == "L24.attn.indexer.topk"
    (topk24,) = nodes_in(full_graph, "L24.attn.indexer", "topk_select")
    assert topk24.inputs[1] == "L20.attn.indexer.candidates"  # two-level selection
    assert "wgate" not in " ".join(w for w in full_graph.weights if w.startswith("layers.20."))


def test_rope_tables_per_layer_type(full_graph):
    """Ratio-0 layers: theta 1e4 without YaRN; every ratio != 0 layer (ratio 1 too): 1.6e5 + YaRN."""
    for i, want_yarn in ((0, False), (1, False), (2, True), (20, True), (39, True)):
        (q,) = [n for n in nodes_in(full_graph, f"L{i}.attn", "rope") if n.outputs[0] == f"L{i}.attn.q"]
        assert (q.attr("yarn_factor", 1.0) == 16.0) is want_yarn
        assert q.attr("theta") == (160000.0 if want_yarn else 10000.0)


def test_engram_layout_reproduces_the_checkpoint_row_counts(full):
    lay = engram_layouts(full)
    assert lay[1].num_embeddings == 384006168 and lay[14].num_embeddings == 384016682
    assert lay[1].primes[0] == [16000057, 16000079, 16000081, 16000097, 16000121, 16000129,
                                16000133, 16000183]
    assert lay[14].primes[2][-1] == 16000889
    assert lay[1].offsets[:3] == [0, 16000057, 32000136] and lay[1].offsets[-1] == 368005705
    assert lay[1].multipliers == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert lay[14].multipliers == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def test_engram_hash_of_a_hand_computed_ngram(full):
    """Row ids of the 4-gram ending at position 3 of compressed ids (5, 17, 99, 1234), by hand:
    r2 = c3*m0 ^ c2*m1, r3 = r2 ^ c1*m2, r4 = r3 ^ c0*m3; id = r mod prime + offset."""
    from megagraph.kernels.engram.reference import engram_hash

    lay = engram_layouts(full)[1]
    m = lay.multipliers
    c = [5, 17, 99, 1234]
    r2 = (c[3] * m[0]) ^ (c[2] * m[1])
    r3 = r2 ^ (c[1] * m[2])
    r4 = r3 ^ (c[0] * m[3])
    want = [r % p + lay.offsets[(o * 8) + h]
            for o, r in enumerate((r2, r3, r4)) for h, p in enumerate(lay.primes[o])]
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    ids = engram_hash(i64(c), torch.full((1, 3), -1, dtype=torch.int64), i64([0, 1, 2, 3]),
                      i64([0, 0, 0, 0]), i64([0]), i64([0]), multipliers=m, primes=lay.primes,
                      offsets=lay.offsets, pad_id=full.engram_pad_token_id, max_ngram=4)
    assert ids[3].tolist() == want
    assert all(0 <= v < lay.num_embeddings for v in ids.flatten().tolist())


def test_full_size_graph_builds_without_weight_memory(full, monkeypatch):
    """Building the 40-layer graph creates no tensor at all (how long it takes is reported by
    benchmarks/compile_time.py, not asserted here)."""
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    g = build_step(full.replace(name="v4.1-flash-uncached"))
    assert not made
    assert len(g.weights) > 1000 and g.types["layers.0.ffn.experts.*.w1.weight"].shape == (384, 2304, 2560)


@pytest.mark.parametrize("name", ["v4.1-flash", "v4.1-flash-tiny", "v4-flash", "v4-flash-tiny"])
@pytest.mark.parametrize("logits", ["all", "last"])
def test_text_round_trip_is_identical(name, logits):
    g = build_step(load_model_config(name), logits=logits)
    text = print_graph(g)
    assert print_graph(parse_graph(text)) == text
    assert parse_graph(text) == g
