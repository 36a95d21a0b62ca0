# megagraph: set-up and checks on a fresh machine (CPU is enough).
#   make test   - create .venv, install (CPU torch wheel first), run the test suite
#   make demo   - compile the tiny V4.1 model and generate a few tokens with random weights
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

.PHONY: install test demo
