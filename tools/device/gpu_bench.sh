#!/usr/bin/env bash
# One device call for issue 7 on the lent H200: build + GPU tests (gpu_tests.sh with REPORT=0; TESTS
# selects pytest paths), the GPU report (copy bandwidth, op errors, Q8_0 GEMV, attention / GDN
# timing; the per-format GEMV table only with FORMATS=1), then the target benchmark on a random 27B-shaped GGUF (tools/bench/gpu_decode.py)
# for each mix in $MIXES (default "iq4xs"), and with LOOP_AL (e.g. "5") the service loop benchmark
# (tools/bench/loop_overhead.py --device cuda: coordinator + workers over gRPC, scripted oracle
# drafter at those acceptance lengths) on the first mix's GGUF (LOOP_IPC_AB=1: twice, over the workers' IPC
# stream sockets (the default hot path) then with --no-ipc-streams (gRPC streams), for the A/B; LOOP_ARGS: more
# loop_overhead.py options, e.g. "--ipc-spin-us 0 200"), and with DRAFTERS (e.g. "dflash dspark
# dflash2") the drafter benchmark (tools/bench/gpu_drafter.py: random drafters of those families in the
# published 27B shapes, DRAFTER_TYPE bf16 (default) and / or q8_0 (e.g. "bf16 q8_0": one run each), DRAFTER_ARGS
# more gpu_drafter.py options (e.g. "--profile 4"), written next to the first mix's GGUF by
# tools/bench/random_drafter.py and deleted after; ingest of 512 context rows, propose step time, floor,
# and the ratio to that mix's verify time at each drafter's verify width); all within $BUDGET_S seconds
# (default 560). ATTN_CONTEXTS (e.g. "4096 32768 131072") runs tools/device/attn_bench.py (decode / verify
# attention time, K/V bandwidth and kernel times at those context lengths; its table in decode.log) after the report. DECODE_ARGS adds gpu_decode.py options (e.g. "--prefill 128 512" to leave time for DRAFTERS).
#
# Usage (repository root on the GPU machine; carry .whl, see gpu_tests.sh for the wheels):
#     OUT=/some/dir MIXES="iq4xs q4km" bash tools/device/gpu_bench.sh
#     OUT=/some/dir TESTS=tests/gpu/test_gpu_drafter.py DECODE_ARGS="--prefill 128 512" \
#       DRAFTERS="dflash dspark dflash2" bash tools/device/gpu_bench.sh
# Outputs (8 files with one mix and DRAFTERS, the device tool's limit): gpu_tests.sh's build.log, pytest.log
# (+ the report's stdout), status.txt, summary.json, summary.md; decode.log (benchmark output incl. its
# markdown tables), gpu_decode_<mix>.json per mix, and with DRAFTERS gpu_drafter_<type>.json.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the benchmark runs from /tmp
BUDGET_S=${BUDGET_S:-560}
R=$PWD
left() { local t=$((BUDGET_S - SECONDS)); echo $((t > 1 ? t : 1)); }
trap 'rm -f /tmp/r27-*.gguf /tmp/r27-*.gguf.tmp' EXIT  # 15 GB each (drafters 2-4 GB): never left behind
OUT=$OUT REPORT=0 timeout "$(left)" bash tools/device/gpu_tests.sh >/dev/null 2>&1
echo "gpu_tests rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp || exit 1
t=$(left); [ "$t" -gt 150 ] && t=150
fmt=--no-formats; [ "${FORMATS:-0}" = 1 ] && fmt=""  # FORMATS=1: the per-format GEMV table too (~1 min)
timeout "$t" python3 "$R/tools/device/gpu_report.py" --out "$OUT" $fmt >>"$OUT/pytest.log" 2>&1
echo "report rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
if [ -n "${ATTN_CONTEXTS:-}" ]; then  # decode / verify attention over long KV caches (attn_bench.py)
  t=$(left); [ "$t" -gt 120 ] && t=120
  timeout "$t" python3 "$R/tools/device/attn_bench.py" --out /tmp/attn_bench --contexts $ATTN_CONTEXTS >>"$OUT/decode.log" 2>&1
  echo "attn_bench rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
fi
for mix in ${MIXES:-iq4xs}; do
  [ "$(left)" -gt 60 ] || { echo "decode $mix skipped: no time left" >>"$OUT/status.txt"; break; }
  timeout "$(left)" python3 "$R/tools/bench/gpu_decode.py" --gguf "/tmp/r27-$mix.gguf" --mix "$mix" \
    --out "$OUT" ${DECODE_ARGS:-} >>"$OUT/decode.log" 2>&1
  echo "decode $mix rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
  if [ -n "${DRAFTERS:-}" ] && [ -f "/tmp/r27-$mix.gguf" ] && [ "$(left)" -gt 60 ]; then
    dj=""; [ -f "$OUT/gpu_decode_$mix.json" ] && dj="--decode-json $OUT/gpu_decode_$mix.json"
    for dt in ${DRAFTER_TYPE:-bf16}; do
      [ "$(left)" -gt 60 ] || break
      timeout "$(left)" python3 "$R/tools/bench/gpu_drafter.py" --target "/tmp/r27-$mix.gguf" --families $DRAFTERS \
        --type "$dt" $dj --out "$OUT" ${DRAFTER_ARGS:-} >>"$OUT/decode.log" 2>&1
      echo "drafters $mix $dt rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
    done
    DRAFTERS=""
  fi
  if [ -n "${LOOP_AL:-}" ] && [ "$(left)" -gt 90 ]; then
    ab=""; [ "${LOOP_IPC_AB:-0}" = 1 ] && ab=--no-ipc-streams
    for hot in "" $ab; do
      [ "$(left)" -gt 60 ] || break
      timeout "$(left)" python3 "$R/tools/bench/loop_overhead.py" --target "/tmp/r27-$mix.gguf" --device cuda \
        --tokens 64 --al $LOOP_AL $hot ${LOOP_ARGS:-} >>"$OUT/decode.log" 2>&1
      echo "loop $mix ${hot:-ipc} rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
    done
    LOOP_AL=""
  fi
  rm -f "/tmp/r27-$mix.gguf" /tmp/r27-"$mix"-draft-*.gguf
done
cat "$OUT/status.txt"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40
