"""Every pass keeps the graph's meaning: the reference interpreter gives the same outputs before and
after each stage, bit for bit, for prefill, decode and mixed steps (tiny models, fp32 activations).
The one exception is quantize-epilogues, whose error bound is tested in test_quantize_epilogues.py;
the stages after it are compared against its output, again bit for bit."""

import pytest
import torch

from tests.passes.helpers import compiled_f32, model_params, run_scenario

APPROXIMATE = {"quantize-epilogues"}


@pytest.mark.parametrize("hw", ("gb300", "h200", "cpu"))
@pytest.mark.parametrize("model", model_params())
def test_every_stage_preserves_outputs(model, hw):
    cfg, w, consts, stages = compiled_f32(model, hw)
    ref = run_scenario(cfg, stages[0][1], w, consts)
    prev = stages[0][1].nodes
    checked = []
    for name, g in stages[1:]:
        if g.nodes == prev:
            continue  # only the meta note changed
        out = run_scenario(cfg, g, w, consts)
        assert out.keys() == ref.keys()
        if name in APPROXIMATE:
            for k, v in out.items():
                assert v.shape == ref[k].shape and bool(torch.isfinite(v.float()).all()), (name, k)
        else:
            for k, v in out.items():
                assert torch.equal(v, ref[k]), f"{name} changed {k}: max |diff| {(v - ref[k]).abs().max()}"
        checked.append(name)
        ref, prev = out, g.nodes
    if hw == "cpu":  # cleanups, and the hardware-independent indexer-products annotation
        rest = [c for c in checked if c != "indexer-products"]
        assert rest in ([], ["fold-constants"], ["fold-constants", "cse"], ["cse"])
    else:
        assert {"fuse-compressor", "quantize-epilogues", "mega-moe-fusion", "mega-mhc-fusion",
                "batch-window-copies"} <= set(checked)
