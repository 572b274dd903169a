#!/usr/bin/env bash
# Tests and kernel benchmarks in one short device call, without the 15 GB random 27B (issue 7): for a
# session with few device minutes left, or a change that touches kernels only.
#   1. gpu_tests.sh builds the working tree and runs TESTS (REPORT=0); meanwhile, with SWEEP_VARIANTS,
#      gemv_sweep.sh compiles its variants (CPU only).
#   2. tools/device/gdn_step_bench.py and tools/device/conv_bench.py on the built library.
#   3. with SWEEP_VARIANTS, the sweep's runs (SWEEP_FORMAT, SWEEP_WIDTHS as gemv_sweep.sh).
# Each stage writes its results as soon as it ends, so a call cut short keeps the stages before.
# Usage (repository root on the GPU machine; carry .whl):
#     OUT=/some/dir TESTS="tests/gpu/test_gpu_spec_loop.py" PYTEST_TIMEOUT=120 \
#       SWEEP_VARIANTS="base:-DSPECD_MMA_SPLIT_BLOCKS=16 mb5:-DSPECD_MMA_RING_REGS=40,-DSPECD_MMA_MIN_BLOCKS=5,-DSPECD_MMA_X_AHEAD=0" bash tools/device/kernels_check.sh
# Outputs: build.log, pytest.log, status.txt (gpu_tests.sh), gdn_step.md, conv.md, sweep.tsv, sweep_build.log.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
R=$PWD
if [ -n "${SWEEP_VARIANTS:-}" ]; then
  rm -rf /tmp/kc_sweep && mkdir -p /tmp/kc_sweep
  (OUT=/tmp/kc_sweep VARIANTS="$SWEEP_VARIANTS" SWEEP_BUILD_ONLY=1 bash tools/device/gemv_sweep.sh >/dev/null 2>&1) &
  sweep_pid=$!
fi
OUT=$OUT REPORT=0 bash tools/device/gpu_tests.sh >/dev/null 2>&1
echo "gpu_tests rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ -n "${SWEEP_VARIANTS:-}" ] && wait "$sweep_pid"  # no compiles while kernels are timed
for bench in gdn_step conv; do  # from /tmp: `import specd` is the installed build
  (cd /tmp && timeout 90 python3 "$R/tools/device/${bench}_bench.py") >"$OUT/$bench.md" 2>&1
  echo "${bench}_bench rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
done
if [ -n "${SWEEP_VARIANTS:-}" ]; then
  cp /tmp/kc_sweep/build.log "$OUT/sweep_build.log"
  OUT=/tmp/kc_sweep VARIANTS="$SWEEP_VARIANTS" SWEEP_SKIP_BUILD=1 bash tools/device/gemv_sweep.sh >/dev/null 2>&1
  echo "sweep rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
  cp /tmp/kc_sweep/sweep.tsv "$OUT/sweep.tsv"
fi
