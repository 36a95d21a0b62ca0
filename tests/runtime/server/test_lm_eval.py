"""The real lm-evaluation-harness (`local-completions`, loglikelihood requests: `echo`,
`logprobs`, `max_tokens: 1`, token-id prompts in batches) on a tiny multiple-choice task of local
data against the test server. Each log-likelihood it computes must be the sum of the reference
engine's prompt-token log-probabilities for the same token ids (a second engine with the server's
weights; f32 plan, 1e-4 per token)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from megagraph.runtime.batch import SeqChunk
from megagraph.runtime.engine import Engine

from .conftest import API_KEY, MODEL

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " a tree", " blue"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
    {"question": "Water is made of hydrogen and", "choices": [" oxygen", " iron", " sand"],
     "answer": 0},
]

TASK = """task: megagraph_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, server):
    d = tmp_path_factory.mktemp("lm_eval")
    (d / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in DOCS))
    (d / "task.yaml").write_text(TASK.format(data=d / "data.jsonl"))
    tok = d / "tokenizer"  # the server's tokenizer.json as a local HF tokenizer (no hub access)
    tok.mkdir()
    shutil.copy(server.service.engine.tokenizer.path, tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


def test_lm_eval_loglikelihood_against_the_server(server, server_config, artifacts, task_dir,
                                                  monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm = get_model("local-completions")(
        model=MODEL, base_url=server.base_url + "/v1/completions",
        tokenizer=str(task_dir / "tokenizer"), tokenizer_backend="huggingface",
        num_concurrent=1, max_retries=1, batch_size=4, max_length=512)
    out = simple_evaluate(model=lm, tasks=["megagraph_tiny_mc"], log_samples=True,
                          task_manager=TaskManager(include_path=str(task_dir)))
    res = out["results"]["megagraph_tiny_mc"]
    assert 0.0 <= res["acc,none"] <= 1.0
    samples = out["samples"]["megagraph_tiny_mc"]
    assert len(samples) == len(DOCS)

    ref = Engine.from_artifacts(artifacts, max_slots=1, capacity=server_config.capacity,
                                seed=server_config.seed, progress=False,
                                random_weights=server_config.random_weights)
    slot = ref.slots.allocate()
    checked = 0
    for s in samples:
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            ll, greedy = resp[0]
            ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
            ids = ctx_ids + cont_ids
            ref.cached.pop(slot, None)
            logp = torch.log_softmax(ref.step([SeqChunk(slot, tuple(ids))]).float(), -1)
            rows = range(len(ctx_ids) - 1, len(ids) - 1)
            want = sum(logp[r, ids[r + 1]].item() for r in rows)
            assert math.isclose(ll, want, abs_tol=1e-4 * len(cont_ids)), (ctx, cont)
            assert greedy == all(logp[r].argmax().item() == ids[r + 1] for r in rows)
            checked += 1
    ref.release(slot)
    assert checked == sum(len(d["choices"]) for d in DOCS)
