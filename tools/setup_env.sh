#!/usr/bin/env bash
# Creates (or refreshes) the virtualenv at $SPECD_VENV (default: .venv in the repo) with specd
# built from this checkout. Usage: tools/setup_env.sh [extra]   e.g. "test" for the test oracles.
#
# torch is installed first at the pinned CPU build (2.13.0): left to the resolver, `torch` would pull
# a multi-GB CUDA build that the CPU test oracles do not need. When `nvcc` is on the PATH the GPU
# backend is compiled too (SPECD_GPU=cuda), so the CUDA sources are built on every machine that can.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SPECD_VENV:-$root/.venv}"
extra="${1:-}"

python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if [[ "$extra" == "test" ]]; then
  "${pip[@]}" "torch==2.13.0"
fi
if [[ -z "${SPECD_GPU+x}" ]] && command -v nvcc >/dev/null 2>&1; then
  export SPECD_GPU=cuda
fi
# cuBLAS (the CUDA backend's wide matmul): when the CUDA toolkit has no cuBLAS (the CPU CI image has
# nvcc and cudart only), install the nvidia-cublas wheel (pyproject extra `cuda`; the CUDA 13 wheel
# is nvidia-cublas 13.x) into the venv and point CMake at it (SPECD_CUBLAS_ROOT, also the module's RPATH).
if [[ "${SPECD_GPU:-}" == "cuda" && -z "${SPECD_CUBLAS_ROOT:-}" ]]; then
  nvcc_dir="$(dirname "$(readlink -f "$(command -v nvcc)")")"
  if ! ls "${CUDA_HOME:-/nonexistent}"/include/cublas_v2.h "$nvcc_dir"/../include/cublas_v2.h \
      "$nvcc_dir"/../targets/*/include/cublas_v2.h /usr/local/cuda*/include/cublas_v2.h \
      /usr/local/cuda*/targets/*/include/cublas_v2.h /usr/include/cublas_v2.h >/dev/null 2>&1; then
    "${pip[@]}" "nvidia-cublas>=13.0"
    SPECD_CUBLAS_ROOT="$("$venv/bin/python" -c 'import os, sysconfig
for k in ("platlib", "purelib"):
    d = os.path.join(sysconfig.get_paths()[k], "nvidia", "cu13")
    if os.path.exists(os.path.join(d, "include", "cublas_v2.h")):
        print(d)
        break')"
    [[ -n "$SPECD_CUBLAS_ROOT" ]] || { echo "specd: nvidia-cublas installed but cublas_v2.h not found" >&2; exit 1; }
    export SPECD_CUBLAS_ROOT
  fi
fi
echo "specd: building (SPECD_GPU=${SPECD_GPU:-none}${SPECD_CUBLAS_ROOT:+, cuBLAS from $SPECD_CUBLAS_ROOT}) into $venv" >&2
target="$root"
[[ -n "$extra" ]] && target="$root[$extra]"
# The build requirements (pyproject's [build-system] requires, read from it, plus CMake and Ninja) go into
# the venv and the build runs without isolation: pip's isolated build environment is a new temporary folder
# every time, and the changed paths made CMake reconfigure and recompile all of build/ on every run.
mapfile -t build_reqs < <("$venv/bin/python" -c 'import ast, re, sys
section = open(sys.argv[1]).read().split("[build-system]", 1)[1]
print("\n".join(ast.literal_eval(re.search(r"^requires\s*=\s*(\[[^\]]*\])", section, re.M).group(1))))' \
  "$root/pyproject.toml")
[[ ${#build_reqs[@]} -gt 0 ]] || { echo "specd: no [build-system] requires read from pyproject.toml" >&2; exit 1; }
"${pip[@]}" "${build_reqs[@]}" "cmake>=3.18" ninja
"${pip[@]}" --no-build-isolation "$target"
if [[ "$extra" == "test" ]]; then
  # The DFlash / DFlash 2 reference (oracles.md §2). Its wheel pins tqdm, datasets and requests for
  # its training scripts, none of which the model classes the tests drive need: install it alone.
  "${pip[@]}" --no-deps "dflash==0.1.0"
  # The DSpark reference (oracles.md §3): mlx-dspark on mlx's CPU build, in its own virtualenv (the
  # tests run it as a subprocess through SPECD_MLX_PYTHON). mlx-lm / mlx-vlm are installed without
  # their dependency lists, which pull audio, vision and dataset stacks the drafter code never imports.
  mlx="$venv-mlx"
  python3 -m venv "$mlx"
  mpip=("$mlx/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${mpip[@]}" "mlx[cpu]==0.32.4" numpy "transformers==5.24.0" huggingface_hub requests pillow
  "${mpip[@]}" --no-deps "mlx-lm==0.32.2" "mlx-vlm==0.7.10" "mlx-dspark==0.20.3"
fi
