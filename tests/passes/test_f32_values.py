"""An `act_dtype: f32` graph is f32 end to end: after every pass, for V4.1 and V4, tiny and full
size, no value is bf16/f16 unless it is a declared storage format.

What counts as storage (the graph declares it, nothing here guesses):
* a weight (`g.weights`): checkpoint tensors keep their release dtypes;
* a state pool (a state input, `g.state_labels`) and its update, when the pool's declared dtype is
  that half type and every row written into it is exact there (an MXFP4 / NVFP4 / FP8 fake-quantized
  value: V4.1's bf16 index-key cache with `quantize_kv`, docs/step-convention.md);
* the rows an `embed` gathers from a weight, in the weight's dtype, when every use converts them
  before any arithmetic (a copy of storage, not a result);
* in a graph derived from the step graph (bounded replay), an input that is one of the step
  graph's storage pools above (or the update of one), handed over by name.
Anything else half-precision is an activation that rounds an f32 computation, the bug this guards
against (the Engram rows and their wkv GEMM were bf16 in f32 graphs and moved fp32 logits by 2e-3).
"""

import pytest

from megagraph.graph.ir import Graph
from megagraph.models.build import build_step
from megagraph.models.config import load_model_config
from megagraph.models.dspark import build_dspark_draft
from megagraph.passes import CompileOptions, compile_model, load_hw_profile
from megagraph.passes.indexer_products import _exact_pool
from tests.passes.helpers import model_params

HALF = ("bf16", "f16")
MODELS = ("v4.1-flash-tiny", "v4-flash-tiny", "v4.1-flash", "v4-flash")


def storage_pools(g: Graph) -> set[str]:
    """The half-precision state pools of `g` holding exact values, and their updates' names."""
    prod = g.producers()
    out = set()
    for lab, v in g.outputs:
        if lab in g.inputs and g.types[lab].dtype in HALF and g.types[v] == g.types[lab] \
                and _exact_pool(g, prod, v):
            out |= {lab, v}
    return out


def half_activations(g: Graph, step: Graph | None = None) -> list[str]:
    """Every half-precision value of `g` that is not storage (see the module doc), as text;
    `step`: the step graph `g` was derived from (its pools may enter `g` as inputs)."""
    prod, users = g.producers(), g.users()
    pools = storage_pools(g)
    handed = storage_pools(step) & set(g.inputs) if step is not None else set()
    bad = []
    for v, t in g.types.items():
        if t.dtype not in HALF or v in g.weights or v in pools:
            continue
        if v in handed and step.types[v] == t:
            continue
        n = prod.get(v)
        if (n is not None and n.op == "embed" and n.inputs[1] in g.weights
                and all(u.op == "cast" for u in users.get(v, ()))):
            continue
        bad.append(f"%{v} ({n.op if n else 'input'}): {t}")
    return bad


def f32_graphs(model: str, hw: str, quantize_kv: bool, **changes) -> list[tuple[str, Graph, Graph | None]]:
    """(stage, graph, step graph it derives from) of the built step, every pass, the bounded-replay
    side graphs and (V4.1 with draft stages) the DSpark draft graph, all at act_dtype f32."""
    cfg = load_model_config(model).replace(act_dtype="f32", quantize_kv=quantize_kv, **changes)
    c = compile_model(cfg, load_hw_profile(hw), CompileOptions(bounded_replay=True))
    out = [(stem, g, None) for stem, g in c.stages]
    out += [(name, g, c.graph) for name, g in sorted(c.extra_graphs.items())]
    if cfg.is_v41 and cfg.num_mtp_layers:
        out.append(("dspark_draft", build_dspark_draft(cfg), None))
    return out


@pytest.mark.parametrize("quantize_kv", [True, False], ids=["qat", "noqat"])
@pytest.mark.parametrize("hw", ["cpu", "h200"])
@pytest.mark.parametrize("model", model_params(MODELS))
def test_f32_graphs_have_no_half_precision_activations(model, hw, quantize_kv):
    graphs = f32_graphs(model, hw, quantize_kv)
    assert len(graphs) >= 12  # built + every pass of the pipeline
    if model.startswith("v4.1"):
        assert {"prefill-prefix", "prefill-suffix", "encoder-replay", "dspark_draft"} <= \
            {stage for stage, _, _ in graphs}
    found = {stage: bad for stage, g, step in graphs if (bad := half_activations(g, step))}
    assert not found, f"{model} on {hw}: half-precision activations in f32 graphs: {found}"


@pytest.mark.parametrize("model", ["v4.1-flash-tiny", "v4.1-flash"])
def test_f32_graphs_of_the_vendor_index_key_reading_too(model):
    """The vendor reading scores against a later layer's bf16 index-key pool as the step found it:
    storage read, no half-precision activation made."""
    graphs = f32_graphs(model, "h200", True, index_key_reading="vendor")
    assert graphs[0][1].op_counts()["published_scores"] >= 2
    found = {stage: bad for stage, g, step in graphs if (bad := half_activations(g, step))}
    assert not found, f"{model}: half-precision activations in f32 graphs: {found}"


def test_the_walk_finds_a_half_precision_activation():
    """The check itself: a bf16 graph (every activation bf16) and an f32 graph with one bf16
    Engram lookup put back both fail it; storage (bf16 weights, the bf16 ikey pools) does not."""
    cfg = load_model_config("v4.1-flash-tiny")
    assert len(half_activations(build_step(cfg))) > 100
    g = build_step(cfg.replace(act_dtype="f32"))
    assert half_activations(g) == []
    assert {g.types[w].dtype for w in g.weights} >= {"bf16"}
    assert g.types["L2.ikey"].dtype == "bf16"  # MXFP4 index keys are exact there
    rows = next(n for n in g.nodes if n.op == "engram_lookup")
    bent = g.with_nodes([n.with_attrs(out_dtype="bf16") if n is rows else n for n in g.nodes],
                        types={rows.outputs[0]: g.types[rows.outputs[0]].with_dtype("bf16")})
    assert half_activations(bent) == [f"%{rows.outputs[0]} (engram_lookup): bf16[T, 192]"]
