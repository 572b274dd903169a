"""The GDN step kernel of the GPU (native/src/gpu/gdn_step.cuh: gdn_qkv's L2 norms, gdn_gates and the
token-by-token recurrence of sn.gdn_step), emulated on the host.

host_emu/gdn_step_main.cpp compiles the kernel header for the CPU (host_emu/warp_emu.h: one thread per thread
of a block, shuffles, __syncthreads) and runs gdn_step_kernel with ssm.cu's launch, its outputs and shared
memory poisoned. Checked against float64 numpy (qwen35-target.md §6.5 steps 3-7: q, k = L2-normed heads of
the conv output, g = ssm_a * softplus(a + dt), beta = sigmoid(b), S <- exp(g) S; d = beta (v - S k); S <- S +
d k^T; o = S (scale q)), with the recurrence's tolerance (1e-4 of the scale), so the staging, the head and row
indexing, the writers of the pending q / k / g / beta and the stage edges are checked without a GPU, in and
out of place; o and the state are also checked bit for bit against gdn_kernel (gated_delta_net's register
kernel) run on the step's own q / k / v / g / beta. (Blocks run one after another here, so races between
blocks cannot show; bitwise equality of the whole op with the composition: test_gpu_ops2.py on a GPU.)

host_emu/gdn_split_main.cpp runs gdn_step_split_kernel (the step, then its output's gated norm and the out
projection's x split, in clusters of 8 blocks whose blocks run together: warp_emu.h's emulate_clusters) and the
composition it replaces (gdn_step_kernel, then gated_norm_split_kernel on its o): the split bytes, the pending
values and the state must be equal byte for byte.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "native"))
from gdn_ref import gdn_ref, gdn_step_inputs_ref  # noqa: E402
from host_emu_build import build_emu  # noqa: E402

NAMES_IN = ("cv", "a", "b", "dt", "ssm_a", "state")
NAMES_OUT = ("o", "q", "k", "v", "g", "beta", "state_out", "o_ref", "state_ref", "layers0", "layers1", "state_ref2")


HEADERS = ["gdn_step.cuh", "gdn_step_split.cuh", "gdn_chunked.cuh", "dyn_smem.cuh", "norm.cuh", "norm_split.cuh",
           "matmul_mma.cuh", "weight_formats.cuh", "partials.cuh", "activations.cuh", "warp_reduce.cuh", "pdl.cuh"]


@pytest.fixture(scope="module")
def step_emu(tmp_path_factory):
    return build_emu(tmp_path_factory, "gdn_step_emu", HEADERS, "gdn_step_main.cpp")


@pytest.fixture(scope="module")
def split_emu(tmp_path_factory):
    # AddressSanitizer: a read past o, z, the norm weight or a block's shared memory fails the run
    return build_emu(tmp_path_factory, "gdn_split_emu", HEADERS, "gdn_split_main.cpp", ("-fsanitize=address",))


def reference(cv, a, b, dt, ssm_a, state, hk, dk, hv, dv, eps, scale):
    q, k, v, g, beta = gdn_step_inputs_ref(cv, a, b, dt, ssm_a, hk, dk, hv, dv, eps)
    o, states = gdn_ref(q, k, v, g, beta, state, scale)
    return dict(o=o, q=q, k=k, v=v, g=g, beta=beta, state_out=states[-1] if len(states) else state.astype(np.float64))


def run_emu(emu, T, hk, hv, dk, dv, eps, scale, arrays, in_place):
    d, exe = emu
    files = {n: str(d / f"{n}.bin") for n in NAMES_IN + NAMES_OUT}
    for n in NAMES_IN:
        np.ascontiguousarray(arrays[n], np.float32).tofile(files[n])
    r = subprocess.run([str(exe), str(dk), str(T), str(hk), str(hv), str(dv), repr(eps), repr(float(scale)),
                        str(int(in_place))] +
                       [files[n] for n in NAMES_IN + NAMES_OUT], check=True, capture_output=True, text=True)
    shapes = dict(o=(T, hv, dv), q=(T, hk, dk), k=(T, hk, dk), v=(T, hv, dv), g=(T, hv), beta=(T, hv),
                  state_out=(hv, dv, dk), o_ref=(T, hv, dv), state_ref=(hv, dv, dk), layers0=(hv, dv, dk),
                  layers1=(hv, dv, dk), state_ref2=(hv, dv, dk))
    return {n: np.fromfile(files[n], np.float32).reshape(shapes[n]) for n in NAMES_OUT}, r.stdout.strip()


# (T, hk, hv, dk, dv): a decode token; a stage of 8, 2 row blocks per head; two stages and a ragged one over
# 2 row blocks with GQA 2:6; 4 row blocks with stages; whole-head blocks (dv 40), dk 32 and 128; no tokens.
CASES = [(1, 2, 4, 64, 32), (8, 1, 3, 128, 64), (17, 2, 6, 128, 64), (9, 1, 2, 128, 128), (11, 2, 2, 32, 40),
         (3, 1, 2, 128, 128), (0, 1, 1, 32, 32)]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("T,hk,hv,dk,dv", CASES)
def test_gdn_step_emulated_matches_float64(step_emu, rng, T, hk, hv, dk, dv, in_place):
    """Against float64 within the recurrence's tolerance; o and the state bit for bit those of gdn_kernel
    (gated_delta_net's register kernel) run on the step's own q, k, v, g, beta; gdn_layers_kernel
    (gated_delta_net_states') on two layers in one launch: each layer's state bit for bit gdn_kernel's."""
    eps, scale = 1e-6, 1 / np.sqrt(dk)
    arrays = dict(cv=rng.standard_normal((T, 2 * hk * dk + hv * dv)), a=rng.standard_normal((T, hv)),
                  b=rng.standard_normal((T, hv)), dt=rng.standard_normal(hv) * 0.5,
                  ssm_a=-rng.uniform(0.1, 2, hv), state=rng.standard_normal((hv, dv, dk)) * 0.1)
    arrays = {n: x.astype(np.float32) for n, x in arrays.items()}
    got, plan = run_emu(step_emu, T, hk, hv, dk, dv, eps, scale, arrays, in_place)
    rows = 32 if dv % 32 == 0 else dv
    assert plan == f"blocks={hv * dv // rows} threads={rows * max(4, dk // 16)}"
    ref = reference(*(arrays[n] for n in NAMES_IN), hk, dk, hv, dv, eps, scale)
    for n in NAMES_OUT[:7]:
        x, r = got[n], ref[n]
        assert np.isfinite(x).all(), n  # every output written
        if x.size:
            np.testing.assert_allclose(x, r, rtol=1e-4, atol=1e-4 * np.abs(r).max(), err_msg=n)
    np.testing.assert_array_equal(got["o"].view(np.uint32), got["o_ref"].view(np.uint32))
    np.testing.assert_array_equal(got["state_out"].view(np.uint32), got["state_ref"].view(np.uint32))
    np.testing.assert_array_equal(got["layers0"].view(np.uint32), got["state_ref"].view(np.uint32))
    np.testing.assert_array_equal(got["layers1"].view(np.uint32), got["state_ref2"].view(np.uint32))
    assert T == 0 or not np.array_equal(got["layers1"], got["layers0"])  # two layers, two results
    if T == 0:
        np.testing.assert_array_equal(got["state_out"], arrays["state"])


def step_arrays(rng, T, hk, hv, dk, dv):
    """Random inputs of a GDN step (the recurrence's stable range: decays in (0, 1), a small state)."""
    arrays = dict(cv=rng.standard_normal((T, 2 * hk * dk + hv * dv)), a=rng.standard_normal((T, hv)),
                  b=rng.standard_normal((T, hv)), dt=rng.standard_normal(hv) * 0.5,
                  ssm_a=-rng.uniform(0.1, 2, hv), state=rng.standard_normal((hv, dv, dk)) * 0.1)
    return {n: x.astype(np.float32) for n, x in arrays.items()}


# (T, hk, hv, dk, dv): the 27B's heads (a decode token, a verify of 16: two stages, every block rank splitting two
# tokens) at fewer heads; two heads a group (dv 128) with a ragged stage; four heads a group (dv 64, dk 64); eight
# one-block heads a group (dv 32, dk 32, GQA 1:8); one head a group (dv 256).
SPLIT_CASES = [(1, 2, 4, 128, 128), (16, 2, 4, 128, 128), (11, 1, 2, 128, 128), (3, 2, 4, 64, 64),
               (5, 1, 8, 32, 32), (2, 1, 1, 128, 256)]


@pytest.mark.parametrize("in_place,weighted", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("T,hk,hv,dk,dv", SPLIT_CASES)
def test_gdn_step_split_emulated_equals_composition(split_emu, rng, T, hk, hv, dk, dv, in_place, weighted):
    """gdn_step_split_kernel: the split x, q / k / v / g / beta and the state byte for byte the composition's."""
    d, exe = split_emu
    eps, scale = 1e-6, 1 / np.sqrt(dk)
    arrays = step_arrays(rng, T, hk, hv, dk, dv)
    arrays["z"] = rng.standard_normal((T, hv, dv)).astype(np.float32) * 2
    arrays["w"] = rng.uniform(0.5, 1.5, dv).astype(np.float32)
    names_in = NAMES_IN + ("z", "w")
    files = {n: str(d / f"{n}.bin") for n in names_in + ("split", "split_ref", "pend", "pend_ref")}
    for n in names_in:
        arrays[n].tofile(files[n])
    r = subprocess.run([str(exe), str(dk), str(T), str(hk), str(hv), str(dv), repr(eps), repr(float(scale)),
                        str(int(in_place)), str(int(weighted))] + [files[n] for n in names_in] +
                       [files[n] for n in ("split", "split_ref", "pend", "pend_ref")],
                       check=True, capture_output=True, text=True)
    assert r.stdout.strip() == f"blocks={hv * dv // 32} clusters={hv * dv // 256}"
    split, split_ref = (np.fromfile(files[n], np.uint8) for n in ("split", "split_ref"))
    pend, pend_ref = (np.fromfile(files[n], np.float32) for n in ("pend", "pend_ref"))
    assert pend.size == T * (2 * hk * dk + hv * dv + 2 * hv) + hv * dv * dk
    assert np.isfinite(pend_ref).all() and (split_ref != 0xA5).any()  # the composition wrote them
    np.testing.assert_array_equal(split, split_ref)
    np.testing.assert_array_equal(pend.view(np.uint32), pend_ref.view(np.uint32))
