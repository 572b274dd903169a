#!/usr/bin/env bash
# Run-time options of one build, A/B on the GPU decode step in one device call (issue 7): the working tree built
# and tested once (gpu_tests.sh), then tools/bench/gpu_decode.py on the random 27B GGUF once per option set of
# OPTIONS ("name:--flag=value,--flag=value ...", or "name" for the defaults), ROUNDS times (default 2), each round
# starting one set later (so no set always runs first), so that an option's effect is judged against the other sets
# measured on the same GPU in the same minutes. Nothing is timed when the build fails. With SWEEP=1,
# gemv_sweep.sh (its SWEEP_* settings from the environment, VARIANTS default "base:") is compiled while the tests
# run and timed after the decodes.
# Usage (repository root on the GPU machine; carry .whl):
#     OUT=/some/dir OPTIONS="graphs:--cuda-graphs eager:--no-cuda-graphs" \
#       AB_DECODE_ARGS="--prefill 128 --decode-tokens 32 --profile 4" TESTS="tests/gpu/test_gpu_graph.py" \
#       bash tools/device/decode_options.sh
# Outputs: build.log, pytest.log, status.txt (gpu_tests.sh), decode.log (the decode runs' output, with each run's
# per-kernel profile under --profile), decode.tsv (name round decode_tok_s verify_ms_w1 verify_ms_w16
# loop_tok_s_al5 gpu_us_per_step: the profile's kernels summed, - without --profile), sweep.tsv / build.log of
# the sweep under $OUT/sweep. Exit status 1 when the tests or a run failed or a run's numbers are missing.
set -u -o pipefail
set -f  # OPTIONS' words are option sets, never file patterns
R=$PWD
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
MIX=${MIX:-iq4xs}
GGUF=/tmp/r27-options.gguf
trap 'rm -f "$GGUF" "$GGUF.tmp"' EXIT  # 15 GB: never left behind
[ -n "${OPTIONS:-}" ] || { echo "OPTIONS: name:--flag=value,... sets, separated by spaces" >&2; exit 2; }
if [ "${SWEEP:-0}" = 1 ]; then  # compile only now (no GPU needed); timed after the decodes
  (mkdir -p "$OUT/sweep" && OUT="$OUT/sweep" VARIANTS="${VARIANTS:-base:}" SWEEP_BUILD_ONLY=1 \
    bash tools/device/gemv_sweep.sh >/dev/null 2>&1) &
  sweep_pid=$!
fi
OUT=$OUT REPORT=0 bash tools/device/gpu_tests.sh >/dev/null 2>&1
tests_rc=$?
echo "gpu_tests rc=$tests_rc at ${SECONDS}s" >>"$OUT/status.txt"
# without this tree's build the runs would time whatever specd an earlier call installed
grep -q "^build rc=0 " "$OUT/status.txt" || { echo "the build failed: nothing timed (build.log)" >&2; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ "${SWEEP:-0}" = 1 ] && wait "$sweep_pid"
rc_all=$((tests_rc != 0))
: >"$OUT/decode.tsv"
sets=($OPTIONS)
for round in $(seq 1 "${ROUNDS:-2}"); do
  order=()
  for ((i = 0; i < ${#sets[@]}; i++)); do order+=("${sets[$(((i + round - 1) % ${#sets[@]}))]}"); done
  for set in "${order[@]}"; do
    name=${set%%:*} flags=
    [ "$set" = "$name" ] || flags=${set#*:}
    dir=/tmp/opt_${name}_r$round
    rm -rf "$dir" && mkdir -p "$dir"
    # shellcheck disable=SC2086
    (cd /tmp && timeout "${DECODE_TIMEOUT:-150}" python3 "$R/tools/bench/gpu_decode.py" --gguf "$GGUF" --mix "$MIX" \
      --prefill --decode-tokens 64 ${AB_DECODE_ARGS:-} ${flags//,/ } --out "$dir") >>"$OUT/decode.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || rc_all=1
    echo "decode $name round $round rc=$rc at ${SECONDS}s" | tee -a "$OUT/decode.log" >>"$OUT/status.txt"
    python3 - "$name" "$round" "$dir/gpu_decode_$MIX.json" >>"$OUT/decode.tsv" <<'EOF'
import json, sys
name, rnd, path = sys.argv[1:]
try:
    r = json.load(open(path))
    v = {int(k): x for k, x in r["verify_ms"].items()}
    loop = {int(k): x["tok_s"] for k, x in r["loop"].items()}
    prof = r.get("profile") or []  # [{kernel, us_per_step, ...}] (--profile N)
    gpu = sum(k["us_per_step"] for k in prof) if prof else None
    print("\t".join([name, rnd, f"{r['decode_tok_s']:.2f}", f"{v[1]:.3f}", f"{v[16]:.3f}", f"{loop[5]:.1f}",
                     "-" if gpu is None else f"{gpu:.0f}"]))
except (OSError, KeyError, TypeError, ValueError) as e:
    print(f"{name}\t{rnd}\tmissing: {e!r} in {path}")
EOF
  done
done
if [ "${SWEEP:-0}" = 1 ]; then
  (OUT="$OUT/sweep" VARIANTS="${VARIANTS:-base:}" SWEEP_SKIP_BUILD=1 timeout "${SWEEP_TIMEOUT:-150}" \
    bash tools/device/gemv_sweep.sh) >>"$OUT/decode.log" 2>&1
  echo "sweep rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
fi
grep -q missing "$OUT/decode.tsv" && rc_all=1
exit $rc_all
