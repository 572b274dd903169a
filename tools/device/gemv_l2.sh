#!/usr/bin/env bash
# What bounds the tensor-core GEMV once its weights are in L2 (issue 7): gemv_sweep.sh's variants (VARIANTS, default
# the library's tuning, its loads-only form, and 5 blocks a multiprocessor with a 40-register ring at one tile: the
# one-tile instances and the formats without their own tuning) timed on a ladder of weight shapes twice, weights
# streamed from HBM (rotated copies) and weights resident in L2 (SWEEP_HOT=1: one copy; the shapes under 50 MB stay
# there, the larger ones do not). A time that does not drop in L2 is the kernel's own (issue, latency, launch), not
# HBM's; the slope of time over bytes along the ladder against its intercept separates the per-byte rate from the
# per-call cost. No Python build: nvcc only.
# Usage (repository root on the GPU machine):
#     OUT=/some/dir bash tools/device/gemv_l2.sh
# Outputs: $OUT/cold/sweep.tsv, $OUT/hot/sweep.tsv (gemv_sweep.sh's columns), $OUT/build.log. Exit status 1 when a
# variant did not build or a mode timed nothing.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT/cold" "$OUT/hot"
export VARIANTS=${VARIANTS:-"base: loads:-DSPECD_MMA_LOADS_ONLY=1 mb5:-DSPECD_MMA_RING_REGS=40,-DSPECD_MMA_MIN_BLOCKS=5,-DSPECD_MMA_X_AHEAD=0"}
export SWEEP_FORMAT=${SWEEP_FORMAT:-IQ4_XS_T,Q6_K_T} SWEEP_WIDTHS=${SWEEP_WIDTHS:-1,4,16}
export SWEEP_SHAPES=${SWEEP_SHAPES:-1024x5120,2048x5120,4096x5120,6144x5120,10240x5120,17408x5120,5120x6144,5120x17408,17408x5120x2}
OUT=$OUT SWEEP_BUILD_ONLY=1 bash tools/device/gemv_sweep.sh
rc=0
grep -q "rc=[1-9]" "$OUT/build.log" && rc=1
for mode in cold hot; do
  hot=0
  [ "$mode" = hot ] && hot=1
  OUT=$OUT/$mode SWEEP_HOT=$hot SWEEP_SKIP_BUILD=1 bash tools/device/gemv_sweep.sh >/dev/null
  grep -qv "^#" "$OUT/$mode/sweep.tsv" || rc=1
done
exit $rc
