#!/usr/bin/env bash
# Nsight Compute look at the tensor-core GEMV (issue 7: why it streams 0.16-0.4 of copy bandwidth).
# Builds and runs the GEMV tests like gpu_tests.sh (TESTS defaults to the matmul batch-invariance
# test, REPORT=0), then `ncu` (the H200 machine has /usr/local/cuda/bin/ncu) on tools/device/gemv_probe.py
# (FORMATS, default "IQ4_XS Q8_0"; widths 1 and 8; 3 calls each): speed of light, occupancy, launch,
# scheduler and warp-state statistics (stall reasons), instruction mix, memory workload; and the SASS of
# the GEMV kernels (cuobjdump) for the instruction counts.
#
# Usage (repository root on the GPU machine; carry .whl as for gpu_tests.sh):
#     OUT=/some/dir bash tools/device/gemv_ncu.sh
# Outputs: build.log, pytest.log, status.txt (gpu_tests.sh), ncu.txt, sass.txt.
# WIDTHS (default "1 8"): rows of x profiled.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
R=$PWD
OUT=$OUT REPORT=0 TESTS=${TESTS:-tests/gpu/test_gpu_matmul.py::test_matmul_gpu_batch_invariant} \
  bash tools/device/gpu_tests.sh >/dev/null 2>&1
echo "gpu_tests rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp || exit 1
NCU=${NCU:-/usr/local/cuda/bin/ncu}
read -r -a fmts <<<"${FORMATS:-IQ4_XS Q8_0}"
read -r -a widths <<<"${WIDTHS:-1 8}"
timeout "${NCU_TIMEOUT:-300}" "$NCU" --target-processes all -k regex:mma_gemv_kernel --launch-count $((3 * ${#widths[@]} * ${#fmts[@]})) \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables \
  python3 "$R/tools/device/gemv_probe.py" --formats "${fmts[@]}" --widths ${WIDTHS:-1 8} >"$OUT/ncu.txt" 2>&1
echo "ncu rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
so=$(python3 -c 'import specd.native._native as m; print(m.__file__)')
"${CUOBJDUMP:-/usr/local/cuda/bin/cuobjdump}" -sass "$so" 2>&1 |
  awk '/Function : /{p = /mma_gemv_kernel/} p' >"$OUT/sass.txt"
echo "sass rc=$? lines=$(wc -l <"$OUT/sass.txt")" >>"$OUT/status.txt"
cat "$OUT/status.txt"
grep -E "Warp Cycles Per Issued|Issued Ipc|Stall|Achieved Occupancy|Memory Throughput|Duration" "$OUT/ncu.txt" | head -60
