"""Source check of the programmatic-dependent-launch contract (native/src/gpu/pdl.cuh), no GPU needed.

Every kernel of the CUDA backend is launched with launch_kernel<K>(), which lets its blocks start
while the kernel before it drains; that is only safe because each kernel waits (griddepcontrol.wait)
before touching memory another kernel writes or reads, and because every kernel waits, the order is
transitive. A kernel that forgot the wait would race with its predecessor only on sm_90 hardware and
only sometimes, so this is checked on the source: each __global__ function's first statement is
pdl_enter() (let the next kernel launch, then wait; pdl_enter_prefetch() also asks L2 for an input first,
which cannot make a value stale), pdl_wait() (a kernel that must not let the next
one launch early: the tiling kernel, which writes weights), or pdl_launch_dependents() for a kernel
that waits later, after loads of weights, with no return before its pdl_wait() (or before the call of a
__device__ helper that does so: the GEMV's gemv_block). Only the kernels pdl.cuh names as its exceptions
may do that."""
import os
import re

import pytest

GPU_SRC = os.path.join(os.path.dirname(__file__), "..", "..", "native", "src", "gpu")
# pdl.cuh's exceptions: kernels that load weights (uploads, which no kernel writes) before their wait
EARLY_WEIGHT_LOADS = {"mma_gemv_kernel", "mma_gemv_pair_kernel", "norm_split_kernel", "norm_split_partials_kernel"}
# __device__ functions such a kernel may leave its wait to, on every path (delegates_wait): each pdl_wait()s with no
# return before it; what they load before it is weights (pdl.cuh's contract: reviewed, not parsed)
WAITING_HELPERS = {"gemv_block"}
# functions a pdl_enter_prefetch() argument may call: each computes an address or a size from kernel
# parameters and indices only (checked below: its body indexes and dereferences nothing)
PREFETCH_HELPERS = {"gdn_block_state", "gdn_block_state_bytes"}
CASTS = {"int", "int64_t", "size_t", "sizeof", "pdl_enter_prefetch"}


def sources():
    """(file, text without comments) of the CUDA sources, subfolders included."""
    for root, _, files in sorted(os.walk(GPU_SRC)):
        for fn in sorted(files):
            if fn.endswith((".cu", ".cuh")):
                src = open(os.path.join(root, fn)).read()
                src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
                yield os.path.relpath(os.path.join(root, fn), GPU_SRC), re.sub(r"//[^\n]*", "", src)


def helper_body(name):
    """The body of the __device__ function `name` (the first definition in the sources)."""
    for _, src in sources():
        for m in re.finditer(r"__device__[^;{]*\b" + name + r"\s*\(", src):
            depth, i = 1, m.end()
            while depth:  # the parameter list, which may hold parentheses (array references)
                depth += {"(": 1, ")": -1}.get(src[i], 0)
                i += 1
            if not re.match(r"\s*{", src[i:]):
                continue  # a declaration
            start = src.index("{", i) + 1
            depth, j = 1, start
            while depth:
                depth += {"{": 1, "}": -1}.get(src[j], 0)
                j += 1
            return src[start:j - 1]
    raise AssertionError(f"no __device__ function {name} in the sources")


def kernels():
    """(file, name, body) of every __global__ function of the CUDA sources."""
    found = []
    for fn, src in sources():
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\(.*?\)\s+)?(\w+)\s*\(", src, re.S):
            depth, i = 0, m.end() - 1
            while True:  # the parameter list
                depth += {"(": 1, ")": -1}.get(src[i], 0)
                if depth == 0:
                    break
                i += 1
            start = src.index("{", i) + 1
            depth, j = 1, start
            while depth:
                depth += {"{": 1, "}": -1}.get(src[j], 0)
                j += 1
            found.append((fn, m.group(1), src[start:j - 1]))
    return found


def test_every_kernel_found():
    """Every __global__ in the sources is a kernel the checks below see (none skipped by its spelling)."""
    names = {name for _, name, _ in kernels()}
    assert {"mma_gemv_kernel", "split_x_kernel", "norm_kernel", "attn_chunk_kernel", "attn_flash_kernel", "gdn_kernel"} <= names
    assert sum(src.count("__global__") for _, src in sources()) == len(kernels())


@pytest.mark.parametrize("fn,name,body", [pytest.param(*k, id=f"{k[0]}:{k[1]}") for k in kernels()])
def test_kernel_waits_before_memory(fn, name, body):
    first = body.strip().split(";")[0] + ";"  # the first statement
    assert re.fullmatch(r"(detail::)?pdl_(enter|wait|launch_dependents)\(\);|(detail::)?pdl_enter_prefetch\(.*\);",
                        first, re.S), (
        f"{fn}: {name} must start with pdl_enter() (see native/src/gpu/pdl.cuh), starts with {first!r}")
    if "pdl_enter_prefetch" in first:  # its address arguments come from kernel parameters, not from memory
        assert "[" not in first and "->" not in first, f"{fn}: {name} reads memory before its wait: {first!r}"
        called = set(re.findall(r"(\w+)\s*(?:<[^<>()]*>)?\s*\(", first)) - CASTS
        assert called <= PREFETCH_HELPERS, f"{fn}: {name} calls {called - PREFETCH_HELPERS} before its wait"
        for helper in called:
            body_h = helper_body(helper)
            assert "[" not in body_h and "->" not in body_h and not re.search(r"(^|[=(,]\s*)\*\w", body_h), (
                f"{helper} (called before {name}'s wait) must compute an address, not read memory")
    if "pdl_launch_dependents" in first:
        assert name in EARLY_WEIGHT_LOADS, f"{fn}: {name} starts before its wait but is not one of pdl.cuh's exceptions"
        if "pdl_wait()" in body:
            before = body[:body.index("pdl_wait()")]
            assert not re.search(r"\breturn\b", before), f"{fn}: {name} may return before its pdl_wait()"
        else:
            assert delegates_wait(body), (f"{fn}: {name} lets the next kernel launch but neither waits nor leaves the "
                                          f"wait to a {sorted(WAITING_HELPERS)} call on every path")


# A call of a WAITING_HELPERS function (template arguments and arguments without statements in them).
_HELPER_CALL = r"(?:" + "|".join(sorted(WAITING_HELPERS)) + r")\s*(?:<[^;{}]*?>)?\s*\([^;{}]*\)\s*;"
# What a delegating kernel may hold before that call: shared-memory declarations and const locals initialised from its
# parameters and indices (no call, so no memory is written).
_DECLARATION = r"\s*(?:__shared__[^;{}]*;|const\s+[\w:]+\s+\w+\s*=\s*[^;{}()]*(?:\w+\([^;{}()]*\)[^;{}()]*)*;)"
_CASTS = {"int", "int64_t", "unsigned", "size_t"}


def delegates_wait(body):
    """Whether a kernel body that starts with pdl_launch_dependents() leaves its wait to WAITING_HELPERS on every path:
    after that statement only _DECLARATIONs (calls in their initialisers only casts), then one helper call, or an
    if / else whose branches are one helper call each; and each helper pdl_wait()s with no return before it."""
    rest = body.strip().split(";", 1)[1]
    while m := re.match(_DECLARATION, rest):
        assert set(re.findall(r"(\w+)\s*\(", m.group(0))) <= _CASTS, f"a call before the wait: {m.group(0)!r}"
        rest = rest[m.end():]
    tail = rest.strip()
    if not (re.fullmatch(_HELPER_CALL, tail) or
            re.fullmatch(r"if\s*\([^;{}]*?\)\s*" + _HELPER_CALL + r"\s*else\s*" + _HELPER_CALL, tail)):
        return False
    for helper in WAITING_HELPERS:
        h = helper_body(helper)
        assert "pdl_wait()" in h and not re.search(r"\breturn\b", h[:h.index("pdl_wait()")]), (
            f"{helper} must pdl_wait() before any return")
    return True


def test_delegated_wait_needs_a_helper_call_on_every_path():
    """The lint's own check of the delegating kernels: a branch without the helper call, or a store before it, fails."""
    call = "gemv_block<F, NT, 0, false>(g, blockIdx.x, n, xv, m, part);"
    assert delegates_wait("pdl_launch_dependents(); __shared__ float part[4][16]; " + call)
    assert delegates_wait("pdl_launch_dependents(); const int64_t b = g.block0[int(g.count)]; "
                          f"if (int64_t(blockIdx.x) < b) {call} else {call}")
    assert not delegates_wait(f"pdl_launch_dependents(); if (blockIdx.x < 4) {call} else y[0] = 1.0f;")
    assert not delegates_wait(f"pdl_launch_dependents(); y[0] = 1.0f; {call}")
    assert not delegates_wait("pdl_launch_dependents(); __shared__ float part[4];")
    with pytest.raises(AssertionError, match="a call before the wait"):
        delegates_wait(f"pdl_launch_dependents(); const int a = atomicAdd(p, 1); {call}")


def test_kernels_launch_through_launch_kernel():
    """No <<<>>> launch outside pdl.cuh: a kernel launched plainly is safe, but would not overlap, and
    launch_kernel is where launch errors are reported."""
    for fn, src in sources():
        if fn != "pdl.cuh":
            assert "<<<" not in src, f"{fn}: launch with launch_kernel<K>() (pdl.cuh)"
