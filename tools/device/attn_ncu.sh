#!/usr/bin/env bash
# Nsight Compute on the attention kernels of a decode and of an 8-row chain / tree verify over a long KV
# cache (issue 7: what bounds the split-K chunk pass and its combine). Runs after gpu_tests.sh /
# gpu_bench.sh in the same device call (uses the library they installed in /tmp/site): `ncu` (the H200
# machine has /usr/local/cuda/bin/ncu) on tools/device/attn_bench.py --probe (each case called once):
# speed of light, occupancy, launch, scheduler and warp-state statistics, memory workload.
#
# Usage (repository root on the GPU machine):
#     OUT=/some/dir CONTEXTS=32768 bash tools/device/attn_ncu.sh
# Outputs: ncu_attn.txt (the full report) and a summary appended to status.txt.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
R=$PWD
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp || exit 1
NCU=${NCU:-/usr/local/cuda/bin/ncu}
timeout "${NCU_TIMEOUT:-150}" "$NCU" --target-processes all -k regex:attn_ --launch-count "${LAUNCHES:-8}" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 "$R/tools/device/attn_bench.py" --out /tmp/attn_ncu --probe --contexts ${CONTEXTS:-32768} \
  >"$OUT/ncu_attn.txt" 2>&1
echo "attn ncu rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
grep -E "attn_.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issued Ipc|Warp Cycles Per Issued|Eligible Warps|Theoretical Occupancy" \
  "$OUT/ncu_attn.txt" | head -120 >>"$OUT/status.txt"
