#!/usr/bin/env bash
# Trains the three demo drafters on the lent H200 in one device run (under 10 minutes).
#
# Before (here, CPU):  python3 tools/demo/train_drafters.py prepare --target-hf <demo target HF dir>
#                      python3 -m pip download --no-deps dflash==0.1.0 -d .whl
# Device call:         carry [".demowork", ".whl"]; command: OUT=$OUT bash tools/demo/device_train_drafters.sh
# After (here, CPU):   tools/demo/README.md "Drafters" (convert-drafter, quantize-drafter, benchmark).
#
# Stages: install the carried wheels (dflash, pure Python), generate greedy continuations + features
# once, then train DFlash, DFlash 2 and DSpark as three concurrent processes (the models are tiny,
# so each is bound by kernel launches, not by the GPU) within what is left of a 9-minute budget.
# Outputs under $OUT (8 files at most): run.log, <family>.tar (HF checkpoint + summary.json),
# <family>_log.jsonl (training log). TOTAL_S (default 540) is the whole run's wall-clock budget in
# seconds; each family trains for what is left of it after generation, minus 60 s for evaluation.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
TOTAL_S=${TOTAL_S:-540}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} >"$LOG" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || exit 1
export PYTHONPATH=/tmp/site

python3 tools/demo/train_drafters.py generate --data .demowork/drafter-data --out /tmp/drafter-gen 2>&1 \
  | { grep -v 'falling back' || true; } | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

budget=$((TOTAL_S - SECONDS - 60))   # 60 s for evaluation, export and the copy back
[ "$budget" -gt 30 ] || { echo "no time left to train ($SECONDS s used)" | tee -a "$LOG"; exit 1; }
echo "training budget per family: $budget s" | tee -a "$LOG"
pids=()
for fam in dflash dflash2 dspark; do
  python3 tools/demo/train_drafters.py train --family "$fam" --budget-s "$budget" --out /tmp/drafters \
    >"/tmp/$fam.out" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for fam in dflash dflash2 dspark; do
  echo "=== $fam" >>"$LOG"
  grep -v 'falling back' "/tmp/$fam.out" | tail -5 >>"$LOG"
  cp "/tmp/drafters/$fam.tar" "/tmp/drafters/${fam}_log.jsonl" "$OUT/" 2>>"$LOG" || rc=1
done
echo "total ${SECONDS}s rc=$rc" | tee -a "$LOG"
exit $rc
