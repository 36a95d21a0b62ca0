#!/usr/bin/env bash
# Nsight Compute on one MegaMoE layer call (benchmarks/probes/ncu_moe.py), the report turned into text:
#   OUT=/path ROUTING=balanced bash benchmarks/probes/ncu_moe.sh
# Writes OUT/ncu.log, OUT/details.csv (every kernel's sections: throughputs, occupancy, warp
# states, ...) and OUT/src-<kernel>.csv (per SASS instruction: executed count and the sampled warp
# stall reasons) for the warp-specialized L1 / L2. --clock-control none: the clocks stay as the
# timed runs have them (the device notes' advice). The .ncu-rep itself stays in OUT/moe.ncu-rep.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
{ echo "ncu: $NCU"; "$NCU" --version; } > "$OUT/ncu.log" 2>&1
timeout "${T_NCU:-400}" "$NCU" --clock-control none --profile-from-start off \
  --set "${NCU_SET:-full}" --import-source no -f -o "$OUT/moe" \
  python3 benchmarks/probes/ncu_moe.py --routing "${ROUTING:-balanced}" ${NCU_ARGS:-} >> "$OUT/ncu.log" 2>&1
echo "ncu rc=$?" >> "$OUT/ncu.log"
"$NCU" -i "$OUT/moe.ncu-rep" --page details --csv > "$OUT/details.csv" 2>> "$OUT/ncu.log"
for k in ${SOURCE_KERNELS:-l1_ws_kernel l2_ws_kernel}; do
  "$NCU" -i "$OUT/moe.ncu-rep" --page source --csv --print-source sass -k "regex:$k" \
    > "$OUT/src-$k.csv" 2>> "$OUT/ncu.log"
done
