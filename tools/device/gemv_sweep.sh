#!/usr/bin/env bash
# Variant sweep of the tensor-core GEMV on the GPU machine (issue 7; no Python build needed):
# compiles tools/device/gemv_sweep.cu once per variant (-D overrides of the tuning constants at the
# top of native/src/gpu/matmul_mma.cuh), in parallel, runs each (per format: the 27B's 17408 x 5120
# FFN gate alone, gate + up as one grouped launch, 5120 x 17408 down; widths 1, 2, 4, 8, 10, 12, 16) and, for the
# variants in NCU, Nsight Compute on one launch of the gate at width NCU_WIDTH (default 1; format NCU_FORMAT, default IQ4_XS_T: the tiled
# IQ4_XS; shape NCU_SHAPE, default the gate's 17408x5120, as SWEEP_SHAPES spells one; sections below, SM clock not locked).
#
# Usage (repository root on the GPU machine):
#     OUT=/some/dir bash tools/device/gemv_sweep.sh
#     OUT=/some/dir VARIANTS="s4:-DSPECD_MMA_SPLIT_BLOCKS=4 s16:-DSPECD_MMA_SPLIT_BLOCKS=16" NCU="s16" bash tools/device/gemv_sweep.sh
# Ring depth and occupancy (SPECD_MMA_RING_REGS, SPECD_MMA_MAX_AHEAD, SPECD_MMA_MIN_BLOCKS; results are
# bit-identical whatever they are: the split plans read the constant kWaveBlocks, not these flags,
# test_gpu_mma_gemv_ring_depth_keeps_results in tests/gpu/test_gpu_decoders_host.py), e.g.
#     VARIANTS="base:-DSPECD_MMA_SPLIT_BLOCKS=16 ring96:-DSPECD_MMA_RING_REGS=96,-DSPECD_MMA_MIN_BLOCKS=3
#       ring128:-DSPECD_MMA_RING_REGS=128,-DSPECD_MMA_MIN_BLOCKS=3 mb5:-DSPECD_MMA_RING_REGS=40,-DSPECD_MMA_MIN_BLOCKS=5,-DSPECD_MMA_X_AHEAD=0"
# (the flags set the one-tile instances; two tiles take one block more and 5/8 of the ring (tiled IQ4_XS: its own at
# two to four tiles, SPECD_MMA_IQ4T_BLOCKS_2 / _RING_2 / _BLOCKS_34 / _RING_34), three and four tiles one block fewer and 3/4 of it, five and
# six one block fewer and no ring (BF16: 3/4 of it): matmul_mma.cuh, min_blocks / units_ahead; check build.log for spills: a 160-register ring at
# 3 blocks per SM spills);
# x read a unit ahead (the tiled formats' one-tile instances, SPECD_MMA_X_AHEAD; SPECD_MMA_X_RING_REGS their ring,
# which the ring and block flags above leave alone: add -DSPECD_MMA_X_AHEAD=0 to time those on the tiled formats'
# one-tile instances), bit-identical too; the fewest units per split (changes the split-K arithmetic, so the checksums):
#     VARIANTS="new: off:-DSPECD_MMA_X_AHEAD=0 xr72:-DSPECD_MMA_X_RING_REGS=72,-DSPECD_MMA_MIN_BLOCKS=3 s8:-DSPECD_MMA_SPLIT_UNITS=8"
# With NCU_SOURCE=1 Nsight Compute also collects the SourceCounters section and writes each NCU variant's
# per-SASS-instruction table (stall samples by reason) to ncu_src_NAME.csv (per-opcode summary, anywhere:
# python tools/device/ncu_src_summary.py ncu_src_*.csv). Checksums agree bit for bit between
# variants with the same split sizing (SPECD_MMA_SPLIT_BLOCKS, SPECD_MMA_SPLIT_UNITS, SPECD_MMA_SPLIT_WAVES and
# SPECD_MMA_SPLIT_MAX_INPUTS change the split-K arithmetic). The L2 prefetch of the
# ring-less (2- to 6-tile) instances, SPECD_MMA_L2_AHEAD (units ahead, 0: off), never changes a result; nor does
# SPECD_MMA_Q6_X4_TILES (the most n8 tiles at which Q6_K's quants are built as 4 (q - 32), default 3), e.g.
# VARIANTS="base: off:-DSPECD_MMA_Q6_X4_TILES=0 all:-DSPECD_MMA_Q6_X4_TILES=6".
# SWEEP_WIDTHS=1,8 times those widths only (default 1, 2, 4, 8, 10, 12, 16).
# SWEEP_FORMAT=NAME[,NAME...] times those formats only (IQ4_XS, IQ4_XS_T, Q4_K, Q4_K_T, Q5_K, Q5_K_T, Q6_K, Q6_K_T, Q8_0;
# read by gemv_sweep.cu).
# SWEEP_SHAPES=OUTxIN[xGROUP],... times those weight shapes instead of the 27B FFN's three; SWEEP_HOT=1 times every
# call on one copy of its weights, which then stays in L2 when it fits (50 MB): the GEMV without HBM (both read
# by gemv_sweep.cu; tools/device/gemv_l2.sh runs the pair).
# SWEEP_BUILD_ONLY=1 compiles the variants and stops (no GPU needed: e.g. while tests run), SWEEP_SKIP_BUILD=1
# then runs them (tools/device/ab_decode.sh does both).
# Outputs: sweep.tsv (variant format out in group n us GBps ratio_to_copy checksum), build.log, ncu.txt,
# ncu_src_NAME.csv.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
B=/tmp/gemv_sweep
mkdir -p "$B"
NVCC=${NVCC:-nvcc}
# The defaults as built (base), their loads alone (the weight stream's ceiling, wrong results), and the two split
# rules they replace: the fewest-units rule alone (nowave), at 4 blocks per SM (split4). (Since the wave rule,
# SPECD_MMA_SPLIT_BLOCKS 8 to 16 give tiled IQ4_XS the same splits on the 27B's shapes.)
DEFAULT_VARIANTS="base:
loads:-DSPECD_MMA_LOADS_ONLY=1
nowave:-DSPECD_MMA_SPLIT_WAVES=0
split4:-DSPECD_MMA_SPLIT_WAVES=0,-DSPECD_MMA_SPLIT_BLOCKS=4"
VARIANTS=${VARIANTS:-$DEFAULT_VARIANTS}
if [ "${SWEEP_SKIP_BUILD:-0}" != 1 ]; then  # SWEEP_SKIP_BUILD=1: the binaries of an earlier SWEEP_BUILD_ONLY=1 call
  { date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv; "$NVCC" --version | tail -1; } >"$OUT/build.log" 2>&1
  names=()
  for v in $VARIANTS; do
    name=${v%%:*}
    flags=${v#*:}
    names+=("$name")
    rm -f "$B/$name"  # a failed compile never leaves an earlier call's binary to be timed under this name
    # shellcheck disable=SC2086
    ("$NVCC" -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Xptxas -v ${flags//,/ } -I native/include \
      -I native/src/gpu -I native/src -o "$B/$name" tools/device/gemv_sweep.cu >"$B/$name.log" 2>&1
     echo "build $name rc=$?" >>"$B/$name.log") &
  done
  wait
  for name in "${names[@]}"; do
    { echo "=== $name"; grep -E "rc=|error|Used|Compiling entry" "$B/$name.log" | grep -B1 -E "rc=|error|Used" |
        grep -E "rc=|error|gemv|Used" | sed 's/ptxas info    : //'; } >>"$OUT/build.log"
  done
fi
[ "${SWEEP_BUILD_ONLY:-0}" = 1 ] && exit 0
names=()
for v in $VARIANTS; do names+=("${v%%:*}"); done
: >"$OUT/sweep.tsv"
for name in "${names[@]}"; do
  [ -x "$B/$name" ] || { echo "# $name: not built" >>"$OUT/sweep.tsv"; continue; }
  timeout "${RUN_TIMEOUT:-120}" "$B/$name" "$name" >>"$OUT/sweep.tsv" 2>&1
  echo "# $name rc=$? at ${SECONDS}s" >>"$OUT/sweep.tsv"
done
NCU_BIN=${NCU_BIN:-/usr/local/cuda/bin/ncu}
: >"$OUT/ncu.txt"
for name in ${NCU-}; do
  [ -x "$B/$name" ] || continue
  echo "######## $name" >>"$OUT/ncu.txt"
  src=()
  rm -f "$B/ncu_$name.ncu-rep"  # never import a report of an earlier call
  [ "${NCU_SOURCE:-0}" = 1 ] && src=(--section SourceCounters --import-source no -o "$B/ncu_$name" -f)
  SWEEP_FORMAT=${NCU_FORMAT:-IQ4_XS_T} SWEEP_WIDTHS=${NCU_WIDTH:-1} SWEEP_SHAPES=${NCU_SHAPE:-17408x5120} timeout "${NCU_TIMEOUT:-150}" "$NCU_BIN" --clock-control none -k regex:mma_gemv_kernel \
    --launch-skip 5 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables ${src[@]+"${src[@]}"} "$B/$name" "$name" 1 >>"$OUT/ncu.txt" 2>&1
  rc=$?
  echo "ncu $name rc=$rc" >>"$OUT/ncu.txt"
  if [ "$rc" -eq 0 ] && [ "${NCU_SOURCE:-0}" = 1 ] && [ -f "$B/ncu_$name.ncu-rep" ]; then  # per-SASS stall samples
    "$NCU_BIN" -i "$B/ncu_$name.ncu-rep" --page details >>"$OUT/ncu.txt" 2>&1
    "$NCU_BIN" -i "$B/ncu_$name.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu_src_$name.csv" 2>>"$OUT/ncu.txt"
  fi
done
grep -v "^#" "$OUT/sweep.tsv" | awk -F'\t' '$6 == 1 || $6 == 16' | cut -f1-9
grep "^#" "$OUT/sweep.tsv"
