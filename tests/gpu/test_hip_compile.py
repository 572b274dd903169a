"""The GPU backend compiled for AMD GPUs by hipcc: no GPU needed (issue 7: the kernels are written once for
CUDA and built for HIP through native/src/gpu/portability.h).

Each native/src/gpu/*.cu is compiled as HIP (hipcc with HIP_PLATFORM=amd, i.e. clang's HIP front end and
AMDGPU back end) into an object with device code for one CDNA 3 target, with the flags of native/CMakeLists.txt's
HIP build (-O3, C++17, SPECD_WITH_GPU=1). An error fails, and so does a warning located in native/: a
portability slip (a CUDA runtime name without a HIP mapping, a CUDA-only pragma form, an ignored nodiscard
status) shows up here first, since no AMD machine builds specd in CI.

Target: the first of OFFLOAD_ARCHS that the toolchain builds a kernel for: gfx942 (MI300X; clang >= 16), else
gfx940 (the MI300 family's first target, which clang 15 of Debian 12's ROCm 5.2 knows and newer LLVM dropped), else
gfx90a (CDNA 2, MI200). .ci/run installs Debian's toolchain (hipcc,
libamdhip64-dev, rocm-device-libs) where apt can; elsewhere these tests skip without hipcc or the HIP headers.
matmul_blas.cu (the prefill's GEMMs) uses hipBLAS's v2 API (HIPBLAS_V2: hipDataType in hipblasGemmEx,
ROCm >= 6), which Debian does not ship (trixie has hipBLAS 5.5): it is compiled only where such headers exist.
"""
import concurrent.futures
import os
import re
import shutil
import subprocess

import pytest

GPU_SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "native", "src", "gpu"))
NATIVE = os.path.dirname(os.path.dirname(GPU_SRC))
OFFLOAD_ARCHS = ("gfx942", "gfx940", "gfx90a")
SOURCES = sorted(f for f in os.listdir(GPU_SRC) if f.endswith(".cu")) if os.path.isdir(GPU_SRC) else []
BLAS_SOURCES = {"matmul_blas.cu"}  # include hipblas/hipblas.h (SPECD_GPU_BLAS)
# A hipBLAS with the v2 GemmEx API that portability.h maps cuBLAS's onto.
HIPBLAS_V2_PROBE = """#define HIPBLAS_V2
#include <hipblas/hipblas.h>
hipDataType specd_a = HIP_R_16BF;
hipblasComputeType_t specd_c = HIPBLAS_COMPUTE_32F;
"""
HIP_PROBE = """#include <hip/hip_runtime.h>
__global__ void specd_probe(float* p) { p[threadIdx.x] = 1.0f; }
"""


def hipcc_command(src, out, arch, syntax_only=False):
    """hipcc's arguments compiling ``src`` as HIP for ``arch`` (CMakeLists.txt's HIP flags)."""
    return [shutil.which("hipcc"), "-x", "hip", f"--offload-arch={arch}", "-std=c++17", "-O3",
            "-DSPECD_WITH_GPU=1", "-I", os.path.join(NATIVE, "include"), "-I", os.path.join(NATIVE, "src"),
            "-I", GPU_SRC, *(["-fsyntax-only"] if syntax_only else ["-c", "-o", str(out)]), str(src)]


def run_hipcc(args):
    """(returncode, stderr) of hipcc on the AMD platform (hipcc picks NVIDIA's when it finds nvcc)."""
    env = dict(os.environ, HIP_PLATFORM="amd")
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    return r.returncode, r.stderr


def our_diagnostics(stderr):
    """The errors anywhere, and the warnings located in native/ (hipcc's own notes about its link flags are not
    ours), as lines."""
    found = []
    for line in stderr.splitlines():
        m = re.match(r"^(.*?):\d+:\d+: (error|warning|fatal error):", line)
        if (m and (m.group(2) != "warning" or os.path.abspath(m.group(1)).startswith(NATIVE))) or \
                line.startswith("clang: error"):
            found.append(line)
    return found


@pytest.fixture(scope="module")
def hip_results(tmp_path_factory):
    """{source name: (returncode, stderr)} of every source compiled for HIP, in parallel; skips without a HIP
    toolchain. matmul_blas.cu is left out without hipBLAS's v2 headers (its result is then absent)."""
    if not shutil.which("hipcc"):
        pytest.skip("no hipcc (Debian: apt-get install hipcc libamdhip64-dev rocm-device-libs; .ci/run does)")
    if not SOURCES:
        pytest.skip("no native/src/gpu sources")
    d = tmp_path_factory.mktemp("hip")
    probe = d / "probe.hip"
    probe.write_text(HIP_PROBE)
    errors = {}
    for arch in OFFLOAD_ARCHS:
        rc, errors[arch] = run_hipcc(hipcc_command(probe, d / "probe.o", arch))
        if rc == 0:
            break
    else:
        pytest.skip(f"hipcc builds a kernel for none of {OFFLOAD_ARCHS} here (HIP headers or device libraries "
                    f"missing): {errors[OFFLOAD_ARCHS[-1]].strip()[-300:]}")
    blas = d / "blas.hip"
    blas.write_text(HIPBLAS_V2_PROBE)
    have_blas = run_hipcc(hipcc_command(blas, None, arch, syntax_only=True))[0] == 0
    todo = [s for s in SOURCES if have_blas or s not in BLAS_SOURCES]
    workers = min(4, len(os.sched_getaffinity(0)))  # the CPUs this process may use, not the host's
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {s: pool.submit(run_hipcc, hipcc_command(os.path.join(GPU_SRC, s), d / (s + ".o"), arch))
                   for s in todo}
        return {s: f.result() for s, f in futures.items()}


def test_sources_found():
    assert "matmul.cu" in SOURCES and "runtime.cu" in SOURCES, SOURCES


@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_for_amd(hip_results, source):
    if source not in hip_results:
        pytest.skip(f"{source} needs hipBLAS's v2 API (ROCm >= 6), not found here")
    rc, err = hip_results[source]
    diagnostics = our_diagnostics(err)
    assert rc == 0 and not diagnostics, f"hipcc {source} (rc {rc}):\n" + "\n".join(diagnostics or [err[-3000:]])


def test_our_diagnostics_reads_clang_output():
    stderr = "\n".join([
        f"{GPU_SRC}/ssm.cu:145:69: error: use of undeclared identifier 'cudaFuncSetAttribute'",
        f"{GPU_SRC}/runtime.cu:87:7: warning: ignoring return value [-Wunused-result]",
        "/usr/include/hip/amd_detail/x.h:3:1: warning: a warning in HIP's own headers",
        "clang: warning: -lgcc_s: 'linker' input unused [-Wunused-command-line-argument]",
        "clang: error: cannot find ROCm device library",
    ])
    assert our_diagnostics(stderr) == stderr.splitlines()[:2] + [stderr.splitlines()[4]]
