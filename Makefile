# megagraph: set-up and checks on a fresh machine (CPU is enough).
#   make test   - create .venv, install (CPU torch wheel first), run the test suite
#   make demo   - compile the tiny V4.1 model, inspect the artifacts, generate 8 tokens (random weights)
#   make serve-demo - compile the tiny V4.1 model, serve it on 127.0.0.1, answer one chat request
#   make sm90-h200 - the sm_90 SASS pins and Gluon builds under the H200 image's Triton (3.6),
#                    from a copy beside the venv (.cache/triton36; the CPU suite checks 3.9's)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,serve]"

install: $(BIN)/python

test: install
	$(BIN)/python -m pytest tests -q

demo: install
	$(BIN)/megagraph compile --model v4.1-flash-tiny --hw cpu --out artifacts/tiny --force
	$(BIN)/megagraph inspect artifacts/tiny
	$(BIN)/megagraph runtime generate artifacts/tiny --prompt "Hello" --max-tokens 8

SERVE_PORT ?= 8123

serve-demo: install
	$(BIN)/megagraph compile --model v4.1-flash-tiny --hw cpu --out artifacts/tiny --force
	@$(BIN)/megagraph runtime serve artifacts/tiny --port $(SERVE_PORT) & pid=$$!; \
	trap "kill $$pid 2>/dev/null; wait $$pid" EXIT; \
	for i in $$(seq 120); do curl -sf -m 2 localhost:$(SERVE_PORT)/health >/dev/null && break; \
	  kill -0 $$pid 2>/dev/null || { echo "serve-demo: the server exited (see its error above)"; exit 1; }; \
	  sleep 1; done; \
	curl -sf -m 2 localhost:$(SERVE_PORT)/health >/dev/null || { echo "serve-demo: no /health after 120 s"; exit 1; }; \
	curl -s localhost:$(SERVE_PORT)/v1/chat/completions -H 'Content-Type: application/json' \
	  -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}'; echo

TRITON_H200 ?= 3.6.0
T36 := .cache/triton36

$(T36)/triton/__init__.py: install
	$(BIN)/pip install -q --no-deps --target $(T36) triton==$(TRITON_H200)

sm90-h200: $(T36)/triton/__init__.py
	PYTHONPATH=$(T36) $(BIN)/python -m pytest -q -p no:cacheprovider \
	  tests/kernels/attention/test_triton_attention_sm90.py tests/kernels/indexer/test_triton_topk_sm90.py \
	  $(wildcard tests/kernels/moe/test_moe_gluon*.py)

.PHONY: install test demo serve-demo sm90-h200
