#!/usr/bin/env bash
# Prepares the llama.cpp baseline for a device run (the H200 has no network): downloads the
# llama-cpp-python source distribution (it vendors llama.cpp), keeps only what building
# `llama-bench` needs (the 76 MB sdist is over the device tool's 64 MiB carry limit: documentation,
# vocab GGUFs, tests, examples and the web UI go) and writes .llamacpp/llama.cpp.tar.gz, a
# git-ignored folder to name in the device call's `carry`. Then, on the GPU machine:
#     OUT=<dir> bash tools/device/llamacpp_baseline.sh
# Usage here: bash tools/device/fetch_llamacpp.sh [VERSION]   (default 0.3.36, vendors a llama.cpp
# with the qwen35 architecture)
set -euo pipefail
VERSION=${1:-0.3.36}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >/dev/null
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" "llama_cpp_python-$VERSION/vendor/llama.cpp"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
rm -rf "$src"/{docs,models,tests,examples,pocs,benches,media,.github} "$src/tools/ui" "$src/tools/server"
mkdir -p "$root/.llamacpp"
grep -qx '/.llamacpp/' "$root/.git/info/exclude" 2>/dev/null || echo '/.llamacpp/' >>"$root/.git/info/exclude"
tar -czf "$root/.llamacpp/llama.cpp.tar.gz" -C "$(dirname "$src")" llama.cpp
echo "llama.cpp from llama-cpp-python $VERSION: $(du -h "$root/.llamacpp/llama.cpp.tar.gz" | cut -f1) in .llamacpp/"
