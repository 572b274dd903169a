#!/usr/bin/env bash
# Builds and runs tools/device/sync_cost.cu on the GPU machine: what one dependency between two steps of
# GPU work costs, per way of separating them (kernel launches, programmatic dependent launches, CUDA
# graphs of either, one persistent kernel with a grid barrier) and grid size. No specd build needed.
# Usage (repository root on the GPU machine): OUT=/some/dir PHASES="1000 100" bash tools/device/sync_cost.sh
# Output: $OUT/sync_cost.md (the compiler's messages, then one table per phase count).
# Exit status: 0 when it built and every chain's result was right.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
D=$(cd "$(dirname "$0")" && pwd)
BIN=$(mktemp -d)
trap 'rm -rf "$BIN"' EXIT
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o "$BIN/sync_cost" "$D/sync_cost.cu" \
  >"$OUT/sync_cost.md" 2>&1 || exit 1
rc=0
for p in ${PHASES:-1000}; do
  "$BIN/sync_cost" "$p" >>"$OUT/sync_cost.md" 2>&1 || rc=1
  echo >>"$OUT/sync_cost.md"
done
exit $rc
