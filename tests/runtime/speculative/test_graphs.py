"""The dspark-draft pass: what it emits, when it declines, and the runtime's error without it."""

from __future__ import annotations

import pytest
import yaml

from megagraph.models.config import load_model_config
from megagraph.passes import CompileOptions, compile_model, load_hw_profile
from megagraph.passes.artifacts import write_artifacts
from megagraph.passes.dspark_draft import DRAFT, VERIFY
from megagraph.runtime.plan import ArtifactsError, RunPlan
from megagraph.runtime.speculative.programs import plan_graphs


@pytest.mark.parametrize("hw", ["cpu", "h200"])
def test_verify_is_the_step_plus_per_row_outputs(hw):
    c = compile_model(load_model_config("v4.1-flash-tiny"), load_hw_profile(hw))
    v, step = c.extra_graphs[VERIFY], c.graph
    assert v.nodes[:len(step.nodes)] == step.nodes and v.outputs[:len(step.outputs)] == step.outputs
    extra = [lab for lab, _ in v.outputs[len(step.outputs):]]
    assert extra == ["verify.engram_ids", "verify.L2.pend_kv_rows", "verify.L2.pend_gate_rows",
                     "verify.L4.pend_kv_rows", "verify.L4.pend_gate_rows"]
    added = {n.op for n in v.nodes[len(step.nodes):]}
    assert added == (set() if hw == "cpu" else {"cast", "linear"})  # fused: recomputed rows
    d = c.extra_graphs[DRAFT]
    assert d.meta_value("block") == 5 and {lab for lab, _ in d.outputs} == {
        "drafts", "confidence", "logits"}


def test_pass_declines_with_reasons():
    v4 = compile_model(load_model_config("v4-flash-tiny"), load_hw_profile("cpu"))
    assert DRAFT not in v4.extra_graphs and "no DSpark draft head" in v4.records[-1].note
    cfg = load_model_config("v4.1-flash-tiny").replace(dspark_block_size=8)
    big = compile_model(cfg, load_hw_profile("cpu"))
    assert DRAFT not in big.extra_graphs and "block 8 >= window 8" in big.records[-1].note


def test_plan_section_and_the_runtime_error_without_the_graphs(tmp_path):
    cfg = load_model_config("v4.1-flash-tiny")
    write_artifacts(compile_model(cfg, load_hw_profile("cpu")), tmp_path / "on")
    spec = yaml.safe_load((tmp_path / "on" / "plan.yaml").read_text())["speculative"]
    assert spec["draft_graph"] == DRAFT and spec["verify_graph"] == VERIFY
    assert spec["block_size"] == 5 and spec["max_tokens_per_target_forward"] == 6
    draft, verify = plan_graphs(RunPlan.from_artifacts(tmp_path / "on"))  # parsed back
    assert draft.meta_value("step") == DRAFT and verify.meta_value("step") == VERIFY
    off = CompileOptions(disable_passes=("dspark-draft",))
    write_artifacts(compile_model(cfg, load_hw_profile("cpu"), off), tmp_path / "off")
    assert "speculative" not in yaml.safe_load((tmp_path / "off" / "plan.yaml").read_text())
    with pytest.raises(ArtifactsError, match="no dspark-draft graph"):
        plan_graphs(RunPlan.from_artifacts(tmp_path / "off"))
