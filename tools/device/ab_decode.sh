#!/usr/bin/env bash
# A/B of the GPU decode step in one device call (issue 7): the working tree against older trees, on the
# same GPU, the same random 27B-shaped GGUF and the same minutes, so that a change is judged against
# its baseline measured there, not against another session's numbers.
#   1. gpu_tests.sh builds and installs the working tree and runs TESTS (REPORT=0); meanwhile each tree
#      of OLD ("name:dir ...") is built into /tmp/site_NAME (its own build folder) and, with
#      SWEEP_VARIANTS, gemv_sweep.sh compiles its variants (a variant can point -I at an old tree's
#      native/src/gpu: its headers then replace the working tree's).
#   2. tools/bench/gpu_decode.py of each tree on the GGUF (the random 27B in quant mix MIX, default iq4xs),
#      the old ones, then "new", then DECODE_ENVS' new-NAME runs, ROUNDS times
#      (default 2): plain decode tok/s, verify ms at widths 1..17 and the scripted loop (no prefill, no profile).
#   3. the sweep's runs (SWEEP_FORMAT as gemv_sweep.sh).
# The old trees: folders carried with the working tree (untracked), e.g.
#     mkdir ab_pdl && git archive wip/pdl-all ':!models' ':!tests' | tar -x -C ab_pdl
# (without models/ and tests/: the device tool carries at most 64 MiB with the working tree). Each tree decodes
# with its own tools/bench/gpu_decode.py: for AB_DECODE_ARGS an older script lacks (e.g. --profile-verify, before
# 8ee3e8f), copy the working tree's script into the old tree's folder.
# Usage (repository root on the GPU machine; carry .whl):
#     OUT=/some/dir OLD="pdl:ab_pdl" TESTS="tests/gpu/test_gpu_gemv_tiles.py" bash tools/device/ab_decode.sh
#     OUT=/some/dir DECODE_TREES=new AB_DECODE_ARGS="--decode-context 8192" bash tools/device/ab_decode.sh  (no OLD)
#     OUT=/some/dir DECODE_ENVS="off:SPECD_EXP_X=0 on:SPECD_EXP_X=1" bash tools/device/ab_decode.sh  (runs new-off, new-on)
#     OUT=/some/dir OLD="pdl:ab_pdl" SWEEP_FORMAT=IQ4_XS_T \
#       SWEEP_VARIANTS="new:-DSPECD_MMA_SPLIT_BLOCKS=16 pdl:-I$PWD/ab_pdl/native/src/gpu" bash tools/device/ab_decode.sh
# SWEEP_OLD=1 (with SWEEP_VARIANTS) also runs each old tree's own gemv_sweep.sh (its own sweep source and
# header, its default tuning; the variant is named TREE-own), for trees whose GEMV interface differs from the
# working tree's (where an -I variant would not compile); up to 150 s more per tree. A tree whose script
# cannot build apart from running (no SWEEP_SKIP_BUILD, before 01d8f48) is listed as not supported.
# Outputs: build.log, pytest.log, status.txt (gpu_tests.sh), old_build.log, ab.log (the decode runs'
# output), ab.tsv (tree round decode_tok_s verify_ms_w1 verify_ms_w4 verify_ms_w8
# verify_ms_w16 loop_tok_s_al3 loop_tok_s_al5 loop_tok_s_al7 decode_verify_commit_tok_s (- for trees from before
# it) decode_at_context ("N:tok/s,..." with AB_DECODE_ARGS="--decode-context N ...", else -), the file of
# specd.native._native; or why a tree was not measured), sweep.tsv, ncu.txt (with NCU, NCU_SOURCE as gemv_sweep.sh:
# its Nsight Compute of those sweep variants and the per-opcode stall summaries; SWEEP_TIMEOUT: seconds for the
# sweep's runs and Nsight Compute, and for each SWEEP_OLD tree's, default 150); with ATTN_CONTEXTS (e.g. "4096 32768") each
# tree's tools/device/attn_bench.py run (the working tree's script on that tree's library, round 1): its
# table in ab.log (the JSON stays in /tmp: the device tool brings back 8 files). AB_DECODE_ARGS adds gpu_decode.py options to every decode run; DECODE_TREES (e.g. "new")
# limits the decode runs to those trees; DECODE_ENVS ("name:VAR=V,VAR=V ...") adds decode runs of the working tree,
# named new-NAME (DECODE_TREES takes that name), each with those environment variables set: an experiment's runtime
# knob read by an uncommitted working tree, one build for several variants (never a product switch; a PYTHONPATH
# there is overridden by the script's); LOOP_AL (e.g. "3 5 7") then runs tools/bench/loop_overhead.py on the
# working tree (the service loop over its IPC streams, as gpu_bench.sh; LOOP_ARGS: more of its options, e.g.
# "--capture-layers 1,16,31,46,61"). DECODE_TIMEOUT: seconds per decode run
# (default 150). Exit status 1 when a tree was not measured.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
OLD=${OLD-}  # the baseline trees, name:dir ... (none: the working tree alone, e.g. a sweep of one of its flags)
R=$PWD
MIX=${MIX:-iq4xs}  # the random 27B's quant mix (tools/bench/random_qwen35.py: iq4xs, q4km, ...)
GGUF=/tmp/r27-ab.gguf
trap 'rm -f "$GGUF" "$GGUF.tmp"' EXIT  # 15 GB: never left behind
# The old trees' builds need the wheels (grpcio-tools builds the protos) before gpu_tests.sh installs them
# into /tmp/site (replacing its folders): their own copy in /tmp/site_ab. The compilers gpu_tests.sh picks.
: >"$OUT/old_build.log"
for d in .whl ../.whl; do
  if ls "$d"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_ab "$d"/*.whl \
      >>"$OUT/old_build.log" 2>&1
    break
  fi
done
if [ -z "${CXX:-}" ] || [ "${CXX:-}" = /opt/gcc/bin/g++ ]; then
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
fi
if [ -n "${CXX:-}" ] && [ -z "${CUDAHOSTCXX:-}" ]; then export CUDAHOSTCXX=$CXX; fi
names=() dirs=()
if [ "${SWEEP_OLD:-0}" = 1 ] && [ -z "${SWEEP_VARIANTS:-}" ]; then
  echo "SWEEP_OLD=1 runs alongside a sweep: set SWEEP_VARIANTS too" >&2
  exit 2
fi
set -f  # DECODE_ENVS, DECODE_TREES and OLD are words, never file patterns (set +f after OLD's loop)
env_names=" " env_runs=()
for e in ${DECODE_ENVS:-}; do  # name:VAR=V[,VAR=V ...], else the run would be mistaken for an old tree's
  [[ $e =~ ^[A-Za-z0-9_]+:[A-Za-z_][A-Za-z0-9_]*=[^,]*(,[A-Za-z_][A-Za-z0-9_]*=[^,]*)*$ ]] ||
    { echo "DECODE_ENVS: $e is not name:VAR=V[,VAR=V ...]" >&2; exit 2; }
  case $env_names in *" ${e%%:*} "*) echo "DECODE_ENVS: the name ${e%%:*} twice" >&2; exit 2 ;; esac
  env_names+="${e%%:*} " env_runs+=("$e")
done
for t in ${DECODE_TREES:-}; do  # a name that matches no tree would skip every decode silently
  case $t in
    new) known=1 ;;
    new-*) case $env_names in *" ${t#new-} "*) known=1 ;; *) known=0 ;; esac ;;
    *) case " $OLD " in *" $t:"*) known=1 ;; *) known=0 ;; esac ;;
  esac
  [ "$known" = 1 ] || { echo "DECODE_TREES: $t is not new, a tree of OLD nor new-NAME of DECODE_ENVS" >&2; exit 2; }
done
for t in $OLD; do
  case ${t%%:*} in new | new-*) echo "OLD: the names new and new-* are the working tree's" >&2; exit 2 ;; esac
  names+=("${t%%:*}"); dirs+=("$(cd "${t#*:}" && pwd)") || exit 2
done
set +f
(for i in "${!names[@]}"; do  # one after the other: each build takes all cores it is given
   rm -rf "/tmp/site_${names[$i]}" "/tmp/specd-build-${names[$i]}"  # pip --target keeps what is there
   (cd "${dirs[$i]}" && PYTHONPATH=/tmp/site_ab SPECD_GPU=cuda CMAKE_BUILD_PARALLEL_LEVEL=8 python3 -m pip install --no-build-isolation \
     --no-deps -q --no-compile --target "/tmp/site_${names[$i]}" -C build-dir="/tmp/specd-build-${names[$i]}" . \
     >>"$OUT/old_build.log" 2>&1
    rc=$?
    echo "build ${names[$i]} rc=$rc" >>"$OUT/old_build.log"
    [ "$rc" -eq 0 ] && touch "/tmp/site_${names[$i]}/.ab_built")
 done) &
old_pid=$!
if [ -n "${SWEEP_VARIANTS:-}" ]; then  # compile only (no GPU yet): gemv_sweep.sh runs them in step 3
  (mkdir -p /tmp/ab_sweep && OUT=/tmp/ab_sweep VARIANTS="$SWEEP_VARIANTS" SWEEP_BUILD_ONLY=1 \
    bash tools/device/gemv_sweep.sh >/dev/null 2>&1
   [ "${SWEEP_OLD:-0}" = 1 ] && for i in "${!names[@]}"; do  # each old tree's own sweep, its defaults
     grep -q SWEEP_SKIP_BUILD "${dirs[$i]}/tools/device/gemv_sweep.sh" 2>/dev/null || continue
     (cd "${dirs[$i]}" && mkdir -p "/tmp/ab_sweep_${names[$i]}" && OUT="/tmp/ab_sweep_${names[$i]}" \
       VARIANTS="${names[$i]}-own:" SWEEP_BUILD_ONLY=1 bash tools/device/gemv_sweep.sh >/dev/null 2>&1)
   done) &
  sweep_pid=$!
fi
OUT=$OUT REPORT=0 bash tools/device/gpu_tests.sh >/dev/null 2>&1
echo "gpu_tests rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
wait "$old_pid"
echo "old builds done at ${SECONDS}s: $(grep -E '^build ' "$OUT/old_build.log" | tr '\n' ' ')" >>"$OUT/status.txt"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ -n "${SWEEP_VARIANTS:-}" ] && wait "$sweep_pid"  # no compiles while the decodes are timed
: >"$OUT/ab.tsv"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!names[@]}" new ${env_runs[@]+"${env_runs[@]}"}; do
    tree=new src=$R path=$PYTHONPATH envs=() old=0
    case $i in
      new) ;;
      *:*) tree=new-${i%%:*}; IFS=, read -r -a envs <<<"${i#*:}" ;;  # DECODE_ENVS: the working tree, these variables set
      *) tree=${names[$i]} src=${dirs[$i]} path=/tmp/site_${names[$i]}:$PYTHONPATH old=1 ;;
    esac
    # The library this tree's run imports: never the new build under an old name (a failed or partial build).
    lib=$(cd /tmp && PYTHONPATH=$path python3 -c 'import specd.native._native as m; print(m.__file__)' 2>/dev/null)
    if [ "$old" = 1 ] && { [ ! -f "/tmp/site_$tree/.ab_built" ] || [ "${lib#/tmp/site_$tree/}" = "$lib" ]; }; then
      printf '%s\t%s\tnot measured: built %s, imports %s (old_build.log)\n' "$tree" "$round" \
        "$([ -f "/tmp/site_$tree/.ab_built" ] && echo yes || echo no)" "${lib:-nothing}" >>"$OUT/ab.tsv"
      continue
    fi
    if [ -n "${ATTN_CONTEXTS:-}" ] && [ "$round" = 1 ]; then  # this tree's attention kernels, the new script
      (cd /tmp && env ${envs[@]+"${envs[@]}"} PYTHONPATH=$path timeout 120 python3 "$R/tools/device/attn_bench.py" --out /tmp/ab_attn --label "$tree" \
        --contexts $ATTN_CONTEXTS) >>"$OUT/ab.log" 2>&1
      echo "attn_bench $tree rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
    fi
    case " ${DECODE_TREES:-$tree} " in *" $tree "*) ;; *) continue ;; esac  # DECODE_TREES: only these trees decode
    rm -rf "/tmp/ab_$tree$round" && mkdir -p "/tmp/ab_$tree$round"  # no result of an earlier call
    (cd /tmp && env ${envs[@]+"${envs[@]}"} PYTHONPATH=$path timeout "${DECODE_TIMEOUT:-150}" python3 "$src/tools/bench/gpu_decode.py" --gguf "$GGUF" --mix "$MIX" \
      --prefill --decode-tokens 64 ${AB_DECODE_ARGS:-} --out "/tmp/ab_$tree$round") >>"$OUT/ab.log" 2>&1
    echo "decode $tree round $round rc=$? at ${SECONDS}s" | tee -a "$OUT/ab.log" >>"$OUT/status.txt"
    python3 - "$tree" "$round" "/tmp/ab_$tree$round/gpu_decode_$MIX.json" "$lib" >>"$OUT/ab.tsv" <<'EOF'
import json, sys
tree, rnd, path, lib = sys.argv[1:]
try:  # no file, or a result without one of these columns: reported as missing (the exit status says so)
    r = json.load(open(path))
    v = {int(k): x for k, x in r["verify_ms"].items()}
    loop = {int(k): x["tok_s"] for k, x in r["loop"].items()}
    cols = [f"{r['decode_tok_s']:.2f}"] + [f"{v[w]:.3f}" for w in (1, 4, 8, 16)] + [f"{loop[a]:.1f}" for a in (3, 5, 7)]
    vc = r.get("decode_verify_commit_tok_s")  # (gpu_decode.py from before Qwen35Model.step: absent)
    cols.append("-" if vc is None else f"{vc:.2f}")
    ctx = r.get("decode_at_context_tok_s") or {}  # AB_DECODE_ARGS="--decode-context N ...": "N:tok/s,..."
    cols.append(",".join(f"{n}:{t:.2f}" for n, t in ctx.items()) or "-")
except (OSError, KeyError, TypeError, ValueError) as e:
    print(f"{tree}\t{rnd}\tmissing: {e!r} in {path}")
    raise SystemExit
print("\t".join([tree, rnd] + cols + [lib]))
EOF
  done
done
if [ -n "${LOOP_AL:-}" ] && [ -f "$GGUF" ]; then  # the service loop on the working tree (tools/bench/loop_overhead.py, as gpu_bench.sh)
  (cd /tmp && timeout 200 python3 "$R/tools/bench/loop_overhead.py" --target "$GGUF" --device cuda --tokens 64 \
    --al $LOOP_AL ${LOOP_ARGS:-}) >>"$OUT/ab.log" 2>&1
  echo "loop new rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
fi
if [ -n "${SWEEP_VARIANTS:-}" ]; then
  rm -f /tmp/ab_sweep/ncu.txt /tmp/ab_sweep/ncu_src_*.csv  # never an earlier call's profiles
  OUT=/tmp/ab_sweep VARIANTS="$SWEEP_VARIANTS" SWEEP_SKIP_BUILD=1 timeout "${SWEEP_TIMEOUT:-150}" bash tools/device/gemv_sweep.sh \
    >/dev/null 2>&1
  cp /tmp/ab_sweep/sweep.tsv "$OUT/sweep.tsv"
  cat /tmp/ab_sweep/build.log >>"$OUT/old_build.log"
  if [ -n "${NCU-}" ] && [ -s /tmp/ab_sweep/ncu.txt ]; then  # gemv_sweep.sh's Nsight Compute of the variants in NCU
    cp /tmp/ab_sweep/ncu.txt "$OUT/ncu.txt"
    for csv in /tmp/ab_sweep/ncu_src_*.csv; do  # NCU_SOURCE=1: per-opcode stall summaries (the CSVs stay: 8 files)
      [ -f "$csv" ] && python3 tools/device/ncu_src_summary.py "$csv" >>"$OUT/ncu.txt" 2>&1
    done
  fi
  [ "${SWEEP_OLD:-0}" = 1 ] && for i in "${!names[@]}"; do
    if ! grep -q SWEEP_SKIP_BUILD "${dirs[$i]}/tools/device/gemv_sweep.sh" 2>/dev/null; then
      echo "# ${names[$i]}-own: not supported (its gemv_sweep.sh cannot build apart from running)" >>"$OUT/sweep.tsv"
      continue
    fi
    (cd "${dirs[$i]}" && OUT="/tmp/ab_sweep_${names[$i]}" VARIANTS="${names[$i]}-own:" SWEEP_SKIP_BUILD=1 timeout "${SWEEP_TIMEOUT:-150}" \
      bash tools/device/gemv_sweep.sh >/dev/null 2>&1)
    echo "sweep ${names[$i]}-own rc=$? at ${SECONDS}s" >>"$OUT/status.txt"
    cat "/tmp/ab_sweep_${names[$i]}/sweep.tsv" >>"$OUT/sweep.tsv" 2>/dev/null ||
      echo "# ${names[$i]}-own: no sweep.tsv" >>"$OUT/sweep.tsv"
    cat "/tmp/ab_sweep_${names[$i]}/build.log" >>"$OUT/old_build.log" 2>/dev/null
  done
fi
cat "$OUT/status.txt" "$OUT/ab.tsv"
! grep -qE "not measured|missing" "$OUT/ab.tsv"
