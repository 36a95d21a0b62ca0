#!/usr/bin/env bash
# One device call: install, the GPU kernel test suites, the kernel table. Each step has its own
# time limit so that the call ends inside the device tool's 10 minutes and the logs come back.
#   OUT=/path STEPS="tests;kernels;120:python3 x.py" bash benchmarks/h200_check.sh
# (steps split on ";"; "SECONDS:command" runs a command with that limit, its output in steps.log)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests;kernels"}
export PYTHONUNBUFFERED=1
# the project's pytest addopts name a snapshot plugin option the device image lacks: every pytest
# in a step runs without them (with them, a bare `pytest` step fails on that option alone)
export PYTEST_ADDOPTS="-o addopts= ${PYTEST_ADDOPTS:-}"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/env.txt" 2>&1
IFS=';' read -ra STEP_LIST <<< "$STEPS"
for step in "${STEP_LIST[@]}"; do
  case $step in
    tests) timeout ${T_TESTS:-330} python3 -m pytest -q -o addopts="" -rfE --tb=short \
             --durations=15 -p no:cacheprovider ${PYTEST_ARGS:-} \
             ${TESTS:-tests/kernels/*/test_triton_*.py tests/kernels/test_capturable_cuda.py} \
             > "$OUT/tests.log" 2>&1
           echo "tests rc=$?" >> "$OUT/env.txt";;
    kernels) timeout ${T_KERNELS:-200} python3 benchmarks/kernels.py --out "$OUT/kernels" \
             ${KERNEL_ARGS:-} > "$OUT/kernels.log" 2>&1; echo "kernels rc=$?" >> "$OUT/env.txt";;
    *) t=${step%%:*}; cmd=${step#*:}  # "SECONDS:command" (STEPS is split on ';')
       echo "=== $cmd" >> "$OUT/steps.log"
       timeout "$t" bash -c "$cmd" >> "$OUT/steps.log" 2>&1
       echo "$cmd rc=$?" >> "$OUT/env.txt";;
  esac
done
