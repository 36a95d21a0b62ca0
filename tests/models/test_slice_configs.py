"""The shipped full-width layer slices (configs/models/v4.1-flash-slice{4,5}.yaml) are
v4.1-flash.yaml with only the layer schedule, the CSA2 sources, the Engram table and the draft
stages changed.

The GPU benchmarks (benchmarks/harness/models.py: slice_config) and `megagraph compile --model
v4.1-flash-slice5` both read these files; deriving them here from the release config keeps a later
edit of either YAML from giving the server and the benchmarks different models.
"""

import dataclasses

import pytest

from megagraph.kernels.engram.reference import engram_layout
from megagraph.models.config import known_models, load_model_config
from megagraph.models.v41 import layer_roles

SLICES = {  # layers -> the fields that differ from the release's layer schedule
    4: dict(compress_ratios=(0, 2, 2, 1), index_source_layers=(1, 3)),
    5: dict(compress_ratios=(0, 2, 2, 1, 1), index_source_layers=(1, 3, 4)),
}


def derived_slice(layers: int):
    """v4.1-flash cut to `layers` layers: L0 window-only + the one Engram table, L1 ratio-2
    KV/index source, L2 ratio-2 reuse, L3 ratio-1 KV/index/candidate source (+ L4 reindex); the
    Engram table's rows from the prime search started at 100,000."""
    full = load_model_config("v4.1-flash")
    start = 100_000
    rows = engram_layout([0], None, max_ngram=full.engram_max_ngram, n_heads=full.engram_n_heads,
                         vocab_start=start,
                         compressed_vocab=full.engram_compressed_vocab_size)[0].num_embeddings
    return full.replace(name=f"v4.1-flash-slice{layers}", num_layers=layers,
                        engram_layers=(0,), engram_num_embeddings=(rows,), engram_vocab_size=start,
                        num_mtp_layers=0, dspark_target_layers=(), kv_source_layers=(1, 3),
                        candidate_source_layer=3, **SLICES[layers])


@pytest.mark.parametrize("layers", sorted(SLICES))
def test_shipped_slice_is_the_release_config_cut_to_layers(layers):
    shipped = load_model_config(f"v4.1-flash-slice{layers}")
    want = derived_slice(layers)
    assert f"v4.1-flash-slice{layers}" in known_models()
    diff = {f.name: (getattr(shipped, f.name), getattr(want, f.name))
            for f in dataclasses.fields(shipped) if f.compare
            and getattr(shipped, f.name) != getattr(want, f.name)}
    assert diff == {}, f"shipped vs derived: {diff}"


def test_slice5_has_every_layer_kind_and_ratio_of_the_release():
    full, s5 = load_model_config("v4.1-flash"), load_model_config("v4.1-flash-slice5")
    kinds = lambda c: {r.kind for r in layer_roles(c)}  # noqa: E731
    ratios = lambda c: {r.ratio for r in layer_roles(c)}  # noqa: E731
    assert kinds(s5) == kinds(full) == {"swa", "full", "reuse", "reindex"}
    assert ratios(s5) == ratios(full) == {0, 1, 2}
    assert (s5.hidden_size, s5.n_routed_experts, s5.weight_format) == (5120, 384, "release")
    assert any(r.engram_table is not None for r in layer_roles(s5))


def test_benchmarks_slice_config_reads_the_shipped_yaml():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from harness import models as workloads

    assert workloads.slice_config(5) == load_model_config("v4.1-flash-slice5")
    assert workloads.model_config("slice") == load_model_config("v4.1-flash-slice4")
    with pytest.raises(ValueError, match="no 3-layer slice"):
        workloads.slice_config(3)
