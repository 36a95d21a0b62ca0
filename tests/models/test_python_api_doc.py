"""docs/python-api.md is executed as written, on a tiny V4.1 checkpoint (project writer, release
config.json, a real tokenizer.json): its `ckpt = ...` line is pointed at that checkpoint and
nothing else changes. Then what the page promises is checked on the values it computed:

* decode == prefill: every token the greedy loop chose is the argmax of the matching row of one
  prefill of the prompt plus the tokens generated so far, and the last decode step's logits equal
  that prefill's last row to 1e-4 (fp32, differences only from GEMM row counts, as in
  test_v41_consistency);
* loading the step graph alone warns about the drafter's tensors it leaves unread, as the page says;
* the drafter's outputs have the documented shapes and the confidence is a probability.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megagraph.models.build import build_step
from megagraph.models.config import load_model_config
from megagraph.models.dspark import build_dspark_draft
from megagraph.models.session import ReferenceSession, SeqChunk
from tests.checkpoints import write_model_checkpoint, write_tiny_tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
CKPT_LINE = re.compile(r'^ckpt = "[^"]*".*$', re.M)


def doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_python_recipe_runs_as_documented(tmp_path):
    cfg = load_model_config("v4.1-flash-tiny")
    ckpt = write_model_checkpoint(tmp_path / "ckpt", cfg, [build_step(cfg), build_dspark_draft(cfg)],
                                  seed=int(torch.randint(0, 2**31 - 1, ())))
    write_tiny_tokenizer(ckpt, cfg)
    blocks = doc_blocks()
    assert len(blocks) == 2 and len(CKPT_LINE.findall(blocks[0])) == 1
    ns: dict = {}
    with pytest.warns(UserWarning, match=r"not in the specs \(ignored\): mtp\.0\."):
        exec(compile(CKPT_LINE.sub(f"ckpt = {str(ckpt)!r}", blocks[0]), f"{DOC}[1]", "exec"), ns)

    cfg, g, weights, prompt, generated = (ns[k] for k in ("cfg", "g", "weights", "prompt", "generated"))
    assert (cfg.act_dtype, cfg.quantize_kv, cfg.weight_format) == ("f32", False, "dense")
    assert ns["logits"].shape == (1, cfg.vocab_size) and ns["logits"].dtype == torch.float32
    assert len(generated) == 4 and len(set(ns["constants"]["engram_token_map"].tolist())) == 400
    for n in range(len(generated)):  # decode step n == the last row of a prefill up to it
        s = ReferenceSession(g, weights, slots=1, capacity=64, constants=ns["constants"])
        full = s.step([SeqChunk(0, (*prompt, *generated[: n + 1]))])
        if n == len(generated) - 1:
            torch.testing.assert_close(full[-1:], ns["logits"], rtol=1e-4, atol=1e-4)
        assert int(full[-2].argmax()) == generated[n]  # the greedy choice the recipe made

    exec(compile(blocks[1], f"{DOC}[2]", "exec"), ns)
    B = cfg.dspark_block_size
    assert ns["drafts"].shape == (1, B) and ns["drafts"].dtype == torch.int64
    assert ns["confidence"].shape == (1, B) and ((ns["confidence"] > 0) & (ns["confidence"] < 1)).all()
    assert ns["anchor"] == generated[0]  # the same weights and prompt: the same first token
