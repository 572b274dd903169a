#!/usr/bin/env bash
# The llama.cpp baseline of issue 7 on the lent H200: builds llama-bench from .llamacpp/llama.cpp.tar.gz
# (tools/device/fetch_llamacpp.sh) with CUDA for sm_90 only, writes the random 27B-shaped GGUF of
# tools/bench/random_qwen35.py (MIX, default iq4xs) and runs llama-bench on it: prompt processing
# at 512 / 2048 tokens and generation of 128 tokens, all layers on the GPU, JSON into $OUT. The same
# GGUF as tools/bench/gpu_decode.py, so the two are comparable line by line.
# Usage (repository root on the GPU machine, carry [".llamacpp", ".whl"]; only ./.whl is read):
#     OUT=<dir> [MIX=iq4xs] [BUDGET_S=570] bash tools/device/llamacpp_baseline.sh
# Outputs: llamacpp_build.log, llamacpp_bench.json, llamacpp_bench.log.
set -u -o pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
MIX=${MIX:-iq4xs}
BUDGET_S=${BUDGET_S:-570}
trap 'rm -f /tmp/r27-*.gguf /tmp/r27-*.gguf.tmp' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
SPECD_GPU=cuda python3 -m pip install -q --no-build-isolation --no-deps . >"$OUT/llamacpp_build.log" 2>&1 &
specd_build=$!
tar -xzf .llamacpp/llama.cpp.tar.gz -C /tmp
{
  cmake -S /tmp/llama.cpp -B /tmp/llama-build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_TYPE=Release &&
  timeout $((BUDGET_S - 150)) cmake --build /tmp/llama-build --target llama-bench -j "$(nproc)"
} >>"$OUT/llamacpp_build.log" 2>&1 || { echo "llama.cpp build failed or ran out of time at ${SECONDS}s"; exit 1; }
echo "llama-bench built at ${SECONDS}s" | tee -a "$OUT/llamacpp_build.log"
wait "$specd_build" || { echo "specd install failed"; exit 1; }
(cd /tmp && python3 "$OLDPWD/tools/bench/random_qwen35.py" "/tmp/r27-$MIX.gguf" --mix "$MIX") | tee -a "$OUT/llamacpp_bench.log"
timeout $((BUDGET_S - SECONDS > 10 ? BUDGET_S - SECONDS : 10)) /tmp/llama-build/bin/llama-bench \
  -m "/tmp/r27-$MIX.gguf" -ngl 99 -p 512,2048 -n 128 -r 3 -o json >"$OUT/llamacpp_bench.json" 2>>"$OUT/llamacpp_bench.log"
echo "llama-bench rc=$? at ${SECONDS}s" | tee -a "$OUT/llamacpp_bench.log"
