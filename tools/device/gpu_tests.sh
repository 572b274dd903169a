#!/usr/bin/env bash
# Builds specd with the CUDA backend on a GPU machine (the lent H200), runs tests/native and
# tests/gpu, then tools/device/gpu_report.py (per-op errors, GEMV bandwidth of every weight format vs copy
# bandwidth, cuBLAS-path TFLOP/s).
#
# Usage, from the repository root on the GPU machine:
#     OUT=/some/dir bash tools/device/gpu_tests.sh
# Outputs under $OUT (default ./device-out), at most 8 files (the device tool returns 8):
#     build.log     environment (nvidia-smi, nvcc, python, packages) and the pip/CMake build
#     pytest.log    pytest -v output of tests/native and tests/gpu
#     summary.json  gpu_report.py results (errors per op, copy and GEMV bandwidth)
#     summary.md    the same as a markdown section (pasted into BENCHMARKS.md)
#     status.txt    one line per stage: name, exit status, seconds
#     sanitizer.log compute-sanitizer memcheck of a small smoke script (only with SANITIZE=1)
# Wheels the machine lacks (it has no network) are installed from $WHEELS
# (default: ./.whl or ../.whl, whichever exists) into /tmp/site, put on PYTHONPATH. The build needs
# grpcio-tools (protos are compiled at build time), the tests gguf, dflash and the gRPC health /
# reflection services; fetch them here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl gguf dflash==0.1.0 grpcio==1.85.3 grpcio-tools==1.85.1 \
#     protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
# (the versions of this project's environment, so the generated stubs and the runtime agree).
# Exit status: 0 when the build, the tests and the report all succeeded.
set -u -o pipefail

OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STATUS="$OUT/status.txt"
: >"$STATUS"
rc_all=0

stage() {  # stage NAME LOG CMD...: runs CMD, appends its output to LOG, records status and time
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS rc
  echo "=== $name: $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$STATUS"
  [ "$rc" -eq 0 ] || rc_all=1
  return "$rc"
}

# --- environment ------------------------------------------------------------------------------
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
  nvcc --version | tail -2 || true
  $PY --version
  $PY -c 'import torch, numpy, pybind11; print("torch", torch.__version__, torch.cuda.is_available(), "numpy", numpy.__version__, "pybind11", pybind11.__version__)' || true
  nproc
} >"$OUT/build.log" 2>&1

# --- carried wheels -----------------------------------------------------------------------------
WHEELS=${WHEELS:-}
if [ -z "$WHEELS" ]; then
  for d in .whl ../.whl; do
    if ls "$d"/*.whl >/dev/null 2>&1; then WHEELS=$d; break; fi
  done
fi
if [ -n "$WHEELS" ]; then
  stage wheels "$OUT/build.log" $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# --- build ----------------------------------------------------------------------------------------
# Compiler. On the lent H200 image CMake picks /opt/gcc/bin/g++ (GCC 13.3), which has no shared
# libstdc++ and so links libstdc++.a into the module; in that build every C++ exception thrown to
# Python crashed (segfault formatting the message inside the static libstdc++'s ostream, seen in
# CPU-only builds too; device run 2026-11-30). Build with the system compiler, whose libstdc++.so.6
# is the one numpy and Python already load. Override with CXX / CUDAHOSTCXX.
if [ -z "${CXX:-}" ] || [ "${CXX:-}" = /opt/gcc/bin/g++ ]; then
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
fi
if [ -n "${CXX:-}" ] && [ -z "${CUDAHOSTCXX:-}" ]; then export CUDAHOSTCXX=$CXX; fi
echo "CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-}" >>"$OUT/build.log"
export SPECD_GPU=cuda
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if ! stage build "$OUT/build.log" $PY -m pip install --no-build-isolation --no-deps -v \
  -C build-dir=/tmp/specd-build .; then
  echo "build failed; see $OUT/build.log" >&2
  exit 1
fi
# The module's link line and any flags the image sets (a static libstdc++ shows up here).
env | grep -iE '^(LDFLAGS|CXXFLAGS|CFLAGS|CMAKE_[A-Z_]*)=' >>"$OUT/build.log" || true
(command -v ninja >/dev/null && ninja -C /tmp/specd-build -t commands 2>/dev/null | grep -- '-o _native' | tail -1) >>"$OUT/build.log" 2>&1 || true
# A statically linked libstdc++ (no libstdc++.so.6 line here) is the crash pattern described above.
(cd /tmp && ldd "$($PY -c 'import specd.native._native as m; print(m.__file__)')") 2>&1 | tee -a "$OUT/build.log"
# Runs from /tmp so that `import specd` is the installed package, not a source folder.
(cd /tmp && $PY -c 'import specd.native as sn; print("gpu_compiled", sn.gpu_compiled(), "available", sn.gpu_available(), sn.gpu_device_name())') 2>&1 | tee -a "$OUT/build.log"

# --- tests ----------------------------------------------------------------------------------------
# l2_norm's GPU test needs the dispatch line in bindings/norm.cpp (see tests/gpu/test_gpu_ops.py).
# With pytest-xdist, tests run in worker processes, so a crashing test (segfault) is reported as a
# failure and the rest still run.
# Four workers share the machine's cores: each gets a quarter for its OpenMP / torch threads (the CPU
# references; every worker with all the cores' threads oversubscribes them 4x). The pytest stage only.
PYTEST_OPTS=() PYTEST_THREADS=${OMP_NUM_THREADS:-}
if $PY -c 'import xdist' 2>/dev/null; then
  PYTEST_OPTS=(-n 4 --max-worker-restart 100)
  PYTEST_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 ))}
fi
# TEST_TIMEOUT: seconds a test may take (default 150, at most the stage's PYTEST_TIMEOUT less 20). Ten seconds
# before it, pytest's faulthandler writes every thread's stack to the log at once (also from inside a native
# call, where a hang would otherwise show nothing); at it, pytest-timeout (where installed) fails the test and
# the worker goes on. (pytest-timeout also reads PYTEST_TIMEOUT, this script's stage limit, as its default:
# the option overrides it.)
stage_s=${PYTEST_TIMEOUT:-300}
test_s=${TEST_TIMEOUT:-$(( stage_s - 20 < 150 ? stage_s - 20 : 150 ))}
test_s=$(( test_s > 20 ? test_s : 20 ))
PYTEST_OPTS+=(-o "faulthandler_timeout=$(( test_s - 10 ))")
if $PY -c 'import pytest_timeout' 2>/dev/null; then PYTEST_OPTS+=(--timeout "$test_s"); fi
# TESTS picks a subset (default: tests/native tests/gpu), e.g. TESTS="tests/gpu/test_gpu_target.py".
# The cuda-ipc feature transport (two processes on one GPU, then `specd serve --feature-transport
# cuda-ipc` on the demo models) on its own, in one device call:
#   TESTS=tests/gpu/test_gpu_feature_ipc.py REPORT=0 PYTEST_TIMEOUT=500 TEST_TIMEOUT=300 bash tools/device/gpu_tests.sh
# PYTEST_TIMEOUT: seconds for the whole pytest stage (default 300); TEST_TIMEOUT: for each test (above).
read -r -a TEST_PATHS <<<"${TESTS:-tests/native tests/gpu}"
stage pytest "$OUT/pytest.log" timeout "$stage_s" env ${PYTEST_THREADS:+OMP_NUM_THREADS=$PYTEST_THREADS} \
  $PY -m pytest -v -rs -p no:cacheprovider "${PYTEST_OPTS[@]}" "${TEST_PATHS[@]}"

# --- report ----------------------------------------------------------------------------------------
# REPORT=0 skips it (e.g. to keep one device call under its time limit; run gpu_report.py next).
if [ "${REPORT:-1}" != 0 ]; then
  stage report "$OUT/pytest.log" timeout 400 $PY tools/device/gpu_report.py --out "$OUT" ${REPORT_ARGS:-}
fi

# --- memcheck (optional: SANITIZE=1; needs compute-sanitizer and a runtime that supports it) -------
if [ "${SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  cat >/tmp/specd_sanitize_smoke.py <<'PYEOF'
import numpy as np, specd.native as sn
G = sn.Device.GPU
rng = np.random.default_rng(0)
g = lambda a, dt=None: (sn.Tensor(np.ascontiguousarray(a)) if dt is None else sn.Tensor(np.ascontiguousarray(a), dt)).to(G)
for shape in [(1, 1), (3, 7), (2, 4100), (5, 128)]:
    x = rng.standard_normal(shape).astype(np.float32); w = rng.standard_normal(shape[-1]).astype(np.float32)
    sn.rms_norm(g(x), g(w), 1e-6, g(x)); sn.rms_norm(g(x), None).numpy()
if hasattr(sn, "matmul"):
    for n, k, out in [(1, 32, 1), (3, 96, 33), (17, 64, 5), (16, 2048, 257)]:
        raw = rng.integers(0, 256, (out, k // 32 * 34), dtype=np.uint8); raw.reshape(out, -1, 34)[:, :, 1] &= 0x3b
        sn.matmul(g(rng.standard_normal((n, k)).astype(np.float32)), g(raw, sn.DType.Q8_0)).numpy()
        sn.matmul(g(rng.standard_normal((n, k + 3)).astype(np.float32)), g(rng.standard_normal((out, k + 3)).astype(np.float32))).numpy()
    for name in ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]:  # every block format, GEMV and dequantize + cuBLAS
        dt = getattr(sn.DType, name); ts = sn.type_size(dt)
        for n, nb, out in [(1, 1, 3), (5, 3, 7), (17, 2, 5)]:
            raw = rng.integers(0, 256, (out, nb * ts), dtype=np.uint8)
            sn.matmul(g(rng.standard_normal((n, nb * 256)).astype(np.float32)), g(raw, dt)).numpy()
    for n, k in [(1, 8), (3, 100), (17, 24)]:  # 16-bit weights, 16-byte and scalar chunks
        sn.matmul(g(rng.standard_normal((n, k)).astype(np.float32)), g(rng.standard_normal((9, k)).astype(np.float16))).numpy()
if hasattr(sn, "argmax"):
    for shape in [(1, 248320), (3, 1001), (2, 1)]:
        sn.argmax(g(rng.standard_normal(shape).astype(np.float32))).numpy()
sn.gpu_synchronize()
print("sanitize smoke done")
PYEOF
  stage memcheck "$OUT/sanitizer.log" timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 \
    $PY /tmp/specd_sanitize_smoke.py
fi

echo "=== stages"
cat "$STATUS"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
exit $rc_all
