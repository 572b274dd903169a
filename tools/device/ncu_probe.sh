#!/usr/bin/env bash
# Nsight Compute on the kernels a probe command launches (issue 7): speed of light, occupancy, launch,
# scheduler and warp-state statistics, memory workload. Runs after gpu_tests.sh / gpu_bench.sh /
# ab_decode.sh in the same device call (uses the library they installed in /tmp/site); `ncu` is the H200
# machine's /usr/local/cuda/bin/ncu.
#
# Usage (repository root on the GPU machine): OUT=/some/dir NAME=gdn KERNELS=regex:gdn_step \
#     bash tools/device/ncu_probe.sh python3 tools/device/gdn_step_bench.py --probe
# (LAUNCHES: kernels profiled, default 8; NCU_TIMEOUT seconds, default 150.)
# Outputs: ncu_NAME.txt (the full report) and a summary appended to status.txt.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
: "${NAME:?NAME: the report's name}" "${KERNELS:?KERNELS: ncu's -k filter, e.g. regex:attn_}"
[ $# -gt 0 ] || { echo "ncu_probe.sh: the probe command is missing" >&2; exit 2; }
args=()
for a in "$@"; do  # paths of the repository stay valid from /tmp
  if [ -e "$a" ]; then args+=("$(cd "$(dirname "$a")" && pwd)/$(basename "$a")"); else args+=("$a"); fi
done
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp || exit 1
NCU=${NCU:-/usr/local/cuda/bin/ncu}
timeout "${NCU_TIMEOUT:-150}" "$NCU" --target-processes all -k "$KERNELS" --launch-count "${LAUNCHES:-8}" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis "${args[@]}" >"$OUT/ncu_$NAME.txt" 2>&1
echo "$NAME ncu rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
grep -E "[a-z_]+(<.*>)?\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issued Ipc|Warp Cycles Per Issued|Eligible Warps|Theoretical Occupancy|One or More Eligible|Stall" \
  "$OUT/ncu_$NAME.txt" | head -160 >>"$OUT/status.txt"
