"""GPU backend report: per-op errors against the CPU backend / float64 references, and the Q8_0 GEMV's
weight-streaming bandwidth against the device-to-device copy bandwidth.

Run on a machine with a GPU and a specd built with SPECD_GPU=cuda (tools/device/gpu_tests.sh does
both). Writes <out>/summary.json and <out>/summary.md and prints the markdown.

Errors (fresh random inputs each run; the seed is recorded):
* rms_norm (+ fused residual): max |gpu - cpu| / |cpu| per element, max |gpu - f64| / max|f64|, and
  whether h = x + residual is bit-exact.
* matmul: max over elements of |y - ref| / (|x| @ |w|^T), ref in float64 from the exact weights
  (the tests' bound is 1e-5).
* argmax: number of rows differing from numpy.argmax (must be 0).

Bandwidth:
* copy: a 2 GiB device-to-device copy through PyTorch (bytes read + written, median of 20 event-timed
  copies after warm-up): the practical ceiling.
* GEMV: sn.matmul(x[n, in], w[out, in] Q8_0) called back-to-back from Python, rotating among enough
  weight copies (>= 4 x the 60 MB L2) that every call streams its weight from HBM; time per call =
  wall time of the loop / calls, synchronised at both ends (the host enqueues faster than the kernel
  runs for these sizes; the host-side floor per call is measured and reported too). Effective
  bandwidth = weight bytes (+ x and y, negligible) / time per call.
* formats: the same measurement for every weight format (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K,
  IQ4_XS; the quantized ones through the tensor-core GEMV on CUDA, field "gemv") and every width
  n = 1..16 on the 27B's shapes (out x in): 5120 x 17408 (down), 17408 x 5120
  (gate/up) and 248320 x 5120 (output head; not F32/F16, whose 5 / 2.5 GB copies do not pay for
  themselves). Weight bytes are random (timing does not depend on the values). Then the n > 16 path
  (dequantize to BF16 + cuBLAS) in TFLOP/s at n = 512 and 2048 on 17408 x 5120, dequantization included.
  --formats-only runs just this part, --no-formats skips it.
"""
import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import time

import numpy as np

import specd.native as sn

GPU = sn.Device.GPU


def on_gpu(a, dtype=None):
    a = np.ascontiguousarray(a)
    return (sn.Tensor(a) if dtype is None else sn.Tensor(a, dtype)).to(GPU)


def random_q8_0(rng, out, k, values=True):
    nb = k // 32
    d = (rng.standard_normal((out, nb)) * np.exp(rng.uniform(-6, 0, (out, nb)))).astype(np.float16)
    q = rng.integers(-128, 128, (out, nb, 32), dtype=np.int8)
    raw = np.empty((out, nb, 34), np.uint8)
    raw[:, :, :2] = d.view(np.uint8).reshape(out, nb, 2)
    raw[:, :, 2:] = q.view(np.uint8)
    vals = (d.astype(np.float64)[:, :, None] * q.astype(np.float64)).reshape(out, k) if values else None
    return raw.reshape(out, nb * 34), vals


def errors(rng):
    res = {}
    # rms_norm
    worst_rel_cpu = worst_ref = 0.0
    h_exact = True
    for shape in [(1, 5120), (16, 5120), (384, 256), (7, 4100), (3, 1001)]:
        x = rng.standard_normal(shape).astype(np.float32)
        r = rng.standard_normal(shape).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        for resid in (False, True):
            if resid:
                yg, hg = sn.rms_norm(on_gpu(x), on_gpu(w), 1e-6, on_gpu(r))
                yc, _ = sn.rms_norm(x, w, 1e-6, r)
                h_exact &= bool(np.array_equal(hg.numpy(), x + r))
                src = (x + r).astype(np.float64)
            else:
                yg = sn.rms_norm(on_gpu(x), on_gpu(w), 1e-6)
                yc = sn.rms_norm(x, w, 1e-6)
                src = x.astype(np.float64)
            yg, yc = yg.numpy().astype(np.float64), yc.numpy().astype(np.float64)
            nz = yc != 0
            worst_rel_cpu = max(worst_rel_cpu, float(np.max(np.abs(yg - yc)[nz] / np.abs(yc)[nz])))
            ref = src / np.sqrt((src * src).mean(-1, keepdims=True) + 1e-6) * w
            worst_ref = max(worst_ref, float(np.max(np.abs(yg - ref)) / np.max(np.abs(ref))))
    res["rms_norm"] = {"max_rel_vs_cpu": worst_rel_cpu, "max_err_vs_f64_over_rowmax": worst_ref,
                       "residual_sum_bit_exact": h_exact, "tolerance": "1e-6 rel vs CPU"}
    worst = {}
    for n, k, out in [(1, 4096, 14336), (1, 14336, 4096), (4, 5120, 6144), (16, 4096, 2048), (17, 2048, 1000)]:
        raw, wf = random_q8_0(rng, out, k)
        x = rng.standard_normal((n, k)).astype(np.float32)
        y = sn.matmul(on_gpu(x), on_gpu(raw, sn.DType.Q8_0), exact=n <= 16).numpy().astype(np.float64)
        x64 = x.astype(np.float64)
        ratio = np.abs(y - x64 @ wf.T) / (np.abs(x64) @ np.abs(wf).T + 1e-300)
        worst[f"q8_0 n={n} in={k} out={out}" + (" (cuBLAS)" if n > 16 else "")] = float(ratio.max())
    for n, k, out in [(4, 4096, 1024), (3, 33, 17)]:
        w = rng.standard_normal((out, k)).astype(np.float32)
        x = rng.standard_normal((n, k)).astype(np.float32)
        y = sn.matmul(on_gpu(x), on_gpu(w)).numpy().astype(np.float64)
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        ratio = np.abs(y - x64 @ w64.T) / (np.abs(x64) @ np.abs(w64).T + 1e-300)
        worst[f"f32 n={n} in={k} out={out}"] = float(ratio.max())
    res["matmul"] = {"max_err_over_sum_abs_xw": worst, "tolerance": "1e-5 (GEMV, n <= 16), 2^-8 + 1e-5 (cuBLAS, n > 16)"}
    res["matmul_formats"] = format_errors(rng)
    x = (rng.standard_normal((16, 248320)) * 4).astype(np.float32)
    x[3, [7, 90000, 248000]] = x[3].max() + 1  # ties: first wins
    got = sn.argmax(on_gpu(x)).numpy()
    res["argmax"] = {"rows": 16, "vocab": 248320,
                     "mismatches_vs_numpy": int(np.sum(got != np.argmax(x, -1))), "tolerance": "exact"}
    return res


SCALE_FIELDS = {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}  # fp16 d (, dmin)


def valid_weight(rng, name, out, k):
    """CPU Tensor [out, k] of format `name`: random bytes with small finite fp16 scale fields."""
    if name in ("F32", "F16"):
        return sn.Tensor((rng.standard_normal((out, k)) * 0.05).astype(np.float32 if name == "F32" else np.float16))
    if name == "BF16":
        a = (rng.standard_normal((out, k)) * 0.05).astype(np.float32).view(np.uint32) >> 16
        return sn.Tensor(a.astype(np.uint16), sn.DType.BF16)
    dt = getattr(sn.DType, name)
    nb, ts = k // sn.block_size(dt), sn.type_size(dt)
    raw = rng.integers(0, 256, (out, nb, ts), dtype=np.uint8)
    for off in SCALE_FIELDS[name]:
        d = (rng.uniform(0.5, 2.0, (out, nb, 1)) * 1e-3).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8)
    return sn.Tensor(raw.reshape(out, nb * ts), dt)


def format_errors(rng):
    """Every format at n = 1, 16 (GEMV) and 64 (cuBLAS): max |gpu - cpu| / (|x| @ |w|^T)."""
    worst = {}
    k, out = 5120, 512
    for name in FORMAT_NAMES:
        w = valid_weight(rng, name, out, k)
        wg = w.to(GPU)
        aw = np.abs(sn.dequantize(w).numpy().astype(np.float64))
        for n in (1, 16, 64):
            x = rng.standard_normal((n, k)).astype(np.float32)
            y = sn.matmul(on_gpu(x), wg, exact=n <= 16).numpy().astype(np.float64)
            ref = sn.matmul(x, w).numpy().astype(np.float64)
            ratio = np.abs(y - ref) / (np.abs(x.astype(np.float64)) @ aw.T + 1e-300)
            worst[f"{name} n={n}" + (" (cuBLAS)" if n > 16 else "")] = float(ratio.max())
    return {"max_err_vs_cpu_over_sum_abs_xw": worst, "shape": [out, k],
            "tolerance": "1e-5 (GEMV, n <= 16), 2^-8 + 2e-5 (cuBLAS, n > 16)"}


def copy_bandwidth():
    try:
        import torch
    except ImportError:
        return None
    nbytes = 2 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a.random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    t = statistics.median(times)
    del a, b
    torch.cuda.empty_cache()
    return {"bytes_moved": 2 * nbytes, "median_s": t, "GBps": 2 * nbytes / t / 1e9, "method": "torch copy_, events, median of 20"}


def time_calls(fn, args_list, calls):
    for i in range(10):
        fn(*args_list[i % len(args_list)])
    sn.gpu_synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(*args_list[i % len(args_list)])
    sn.gpu_synchronize()
    return (time.perf_counter() - t0) / calls


def gemv_bandwidth(rng, copy_gbps):
    rows = []
    # Host floor: the smallest call, which the GPU finishes at once.
    tiny_w = on_gpu(random_q8_0(rng, 1, 32, values=False)[0], sn.DType.Q8_0)
    tiny_x = on_gpu(rng.standard_normal((1, 32)).astype(np.float32))
    floor = min(time_calls(sn.matmul, [(tiny_x, tiny_w)], 2000) for _ in range(3))
    l2 = 60e6
    for out, k, ns in [(14336, 4096, [1, 2, 4, 8, 16]), (4096, 14336, [1, 4, 16]), (17408, 5120, [1, 16]),
                       (248320, 5120, [1, 16])]:
        wbytes = out * (k // 32) * 34
        copies = max(1, int(np.ceil(4 * l2 / wbytes)))
        ws = [on_gpu(random_q8_0(rng, out, k, values=False)[0], sn.DType.Q8_0) for _ in range(copies)]
        for n in ns:
            x = on_gpu(rng.standard_normal((n, k)).astype(np.float32))
            calls = max(20, min(400, int(0.25 / (wbytes / 3e12))))
            reps = [time_calls(sn.matmul, [(x, w) for w in ws], calls) for _ in range(3)]
            t = statistics.median(reps)
            gbps = wbytes / t / 1e9
            rows.append({"out": out, "in": k, "n": n, "weight_bytes": wbytes, "weight_copies": copies,
                         "calls": calls, "us_per_call": t * 1e6, "us_spread": (max(reps) - min(reps)) * 1e6,
                         "weight_GBps": gbps, "ratio_to_copy": gbps / copy_gbps if copy_gbps else None,
                         "gflops": 2 * n * out * k / t / 1e9})
        del ws
        sn.gpu_synchronize()
    return {"host_floor_us_per_call": floor * 1e6, "rows": rows}


def attention_gdn_timing(rng):
    """Attention (1 query row over 4k / 32k keys, 8 masked verify rows over 4k keys, and a 512-row prefill chunk
    over 8k keys exact and flash, F16 cache, 27B shapes: 24 q heads, 4 KV heads,
    head_dim 256) and GDN decode (T = 1, 48 v heads, 16 k heads, dk = dv = 128) per call, from a
    Python loop synchronised at both ends (includes the host floor of each call: q_pos is
    value-checked on the host, which reads it back)."""
    rows = []
    hq, hkv, d = 24, 4, 256
    for kv_len in (4096, 32768):
        raw = (rng.standard_normal((kv_len, hkv, d)) * 0.5).astype(np.float16)
        k, v = on_gpu(raw), on_gpu(raw[::-1].copy())
        q = on_gpu(rng.standard_normal((1, hq, d)).astype(np.float32))
        pos = on_gpu(np.array([kv_len - 1], np.int32))
        t = statistics.median(time_calls(lambda: sn.attention(q, k, v, kv_len, pos), [()], 50) for _ in range(3))
        kv_bytes = 2 * kv_len * hkv * d * 2
        rows.append({"op": f"attention 1 x {kv_len} keys F16 (24q/4kv/256)", "us_per_call": t * 1e6,
                     "kv_GBps": kv_bytes / t / 1e9})
        if kv_len == 4096:  # tree verify: 8 query rows (mask over the last 8 keys), same cache
            n = 8
            q8 = on_gpu(rng.standard_normal((n, hq, d)).astype(np.float32))
            pos8 = on_gpu(np.arange(kv_len - n, kv_len, dtype=np.int32))
            mask = np.ones((n, kv_len), np.int32)
            mask[:, kv_len - n:] = np.tril(np.ones((n, n), np.int32))
            mask8 = on_gpu(mask)
            t = statistics.median(time_calls(lambda: sn.attention(q8, k, v, kv_len, pos8, causal=False, mask=mask8),
                                             [()], 50) for _ in range(3))
            rows.append({"op": f"attention {n} x {kv_len} keys F16 masked verify (24q/4kv/256)",
                         "us_per_call": t * 1e6, "kv_GBps": kv_bytes / t / 1e9})
    # A prefill chunk at 27B shapes: 512 rows at positions 7680 .. 8191 over 8192 keys, the exact split-K
    # kernel vs the tensor-core flash path (exact=False); the op name carries the attention TFLOP/s
    # (4 * hq * d flops per visible (row, key) pair; GB/s column: K/V bytes of the cache read once).
    kv_len, n = 8192, 512
    raw = (rng.standard_normal((kv_len, hkv, d)) * 0.5).astype(np.float16)
    k, v = on_gpu(raw), on_gpu(raw[::-1].copy())
    qp = on_gpu(rng.standard_normal((n, hq, d)).astype(np.float32))
    posp = on_gpu(np.arange(kv_len - n, kv_len, dtype=np.int32))
    flops = 4.0 * hq * d * (n * (kv_len - n) + n * (n + 1) / 2)
    kv_bytes = 2 * kv_len * hkv * d * 2
    for exact in (True, False):
        t = statistics.median(time_calls(lambda: sn.attention(qp, k, v, kv_len, posp, exact=exact), [()], 5)
                              for _ in range(3))
        rows.append({"op": f"attention {n} x {kv_len} keys F16 prefill, {'exact' if exact else 'flash (exact=False)'}"
                           f" (24q/4kv/256): {flops / t / 1e12:.1f} TFLOP/s",
                     "us_per_call": t * 1e6, "kv_GBps": kv_bytes / t / 1e9})
    del k, v, qp
    hk, hv, dk, dv = 16, 48, 128, 128
    args = [on_gpu(a) for a in (rng.standard_normal((1, hk, dk)).astype(np.float32) * 0.1,
                                rng.standard_normal((1, hk, dk)).astype(np.float32) * 0.1,
                                rng.standard_normal((1, hv, dv)).astype(np.float32),
                                -np.abs(rng.standard_normal((1, hv)).astype(np.float32)),
                                np.full((1, hv), 0.5, np.float32))]
    state = on_gpu(np.zeros((hv, dv, dk), np.float32))
    t = statistics.median(time_calls(lambda: sn.gated_delta_net(*args, state, 1 / np.sqrt(dk)), [()], 200)
                          for _ in range(3))
    rows.append({"op": "gated_delta_net T=1 (48v/16k/128/128)", "us_per_call": t * 1e6,
                 "kv_GBps": 2 * hv * dv * dk * 4 / t / 1e9})
    return rows


FORMAT_NAMES = ["F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
FORMAT_SHAPES = [(5120, 17408), (17408, 5120), (248320, 5120)]  # (out, in)
MMA_GEMV_FORMATS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # tensor-core GEMV on CUDA (matmul_mma.cuh)


def random_weight(rng, name, out, k, pool):
    """A GPU weight of format `name` [out, k] filled with random bytes (tiled from `pool`)."""
    dt = getattr(sn.DType, name)
    rb = sn.type_size(dt) * (k // sn.block_size(dt))
    raw = np.resize(pool, out * rb).reshape(out, rb)
    if name == "F32":
        return on_gpu(raw.view(np.float32))
    if name == "F16":
        return on_gpu(raw.view(np.float16))
    if name == "BF16":
        return on_gpu(raw.view(np.uint16), dt)
    return on_gpu(raw, dt)


def format_bandwidth(rng, copy_gbps, budget_s=100.0):
    """Per format, shape and width 1..16: us/call, weight GB/s and ratio to copy; then cuBLAS TFLOP/s."""
    t_start = time.perf_counter()
    pool = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    rows, blas = [], []
    for out, k in FORMAT_SHAPES:
        for name in FORMAT_NAMES:
            if out > 100000 and name in ("F32", "F16"):
                continue
            if time.perf_counter() - t_start > budget_s:
                rows.append({"format": name, "out": out, "in": k, "skipped": "time budget"})
                continue
            dt = getattr(sn.DType, name)
            wbytes = out * sn.type_size(dt) * (k // sn.block_size(dt))
            ws = [random_weight(rng, name, out, k, pool) for _ in range(max(1, int(np.ceil(240e6 / wbytes))))]
            calls = max(10, min(200, int(0.02 / (wbytes / 3e12))))
            for n in range(1, 17):
                x = on_gpu(rng.standard_normal((n, k)).astype(np.float32))
                t = min(time_calls(sn.matmul, [(x, w) for w in ws], calls) for _ in range(2))
                gbps = wbytes / t / 1e9
                rows.append({"format": name, "out": out, "in": k, "n": n, "weight_bytes": wbytes,
                             "gemv": "tensor-core" if name in MMA_GEMV_FORMATS and sn.gpu_backend() == "cuda" else "fma",
                             "us_per_call": t * 1e6, "weight_GBps": gbps,
                             "ratio_to_copy": gbps / copy_gbps if copy_gbps else None})
            del ws
            sn.gpu_synchronize()
    out, k = 17408, 5120
    for name in FORMAT_NAMES:
        w = random_weight(rng, name, out, k, pool)
        for n in (512, 2048):
            x = on_gpu(rng.standard_normal((n, k)).astype(np.float32))
            t = min(time_calls(lambda x, w: sn.matmul(x, w, exact=False), [(x, w)], 10) for _ in range(2))
            blas.append({"format": name, "out": out, "in": k, "n": n, "ms_per_call": t * 1e3,
                         "TFLOPs": 2 * n * out * k / t / 1e12})
        del w
    return {"rows": rows, "blas": blas, "seconds": time.perf_counter() - t_start}


def markdown_formats(rep):
    f = rep.get("formats")
    if not f:
        return []
    L = ["", "GEMV per format: us per call / effective weight bandwidth as a fraction of copy bandwidth", ""]
    for out, k in FORMAT_SHAPES:
        names = [nm for nm in FORMAT_NAMES if any(r["format"] == nm and r["out"] == out and "n" in r for r in f["rows"])]
        if not names:
            continue
        def head(nm):
            r = next((r for r in f["rows"] if r["format"] == nm and r["out"] == out and "gemv" in r), None)
            return f"{nm} ({r['gemv']})" if r else nm
        L += [f"**{out} x {k}** (out x in)", "", "| n | " + " | ".join(head(nm) for nm in names) + " |",
              "| --- |" + " --- |" * len(names)]
        for n in range(1, 17):
            cells = []
            for nm in names:
                r = next((r for r in f["rows"] if r["format"] == nm and r["out"] == out and r.get("n") == n), None)
                ratio = f"{r['ratio_to_copy']:.2f}" if r and r["ratio_to_copy"] else "-"
                cells.append(f"{r['us_per_call']:.1f} / {ratio}" if r else "-")
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        L.append("")
    L += ["n > 16 path (dequantize to BF16 + cuBLAS, included in the time), 17408 x 5120:", "",
          "| format | n | ms/call | TFLOP/s |", "| --- | --- | --- | --- |"]
    for b in f["blas"]:
        L.append(f"| {b['format']} | {b['n']} | {b['ms_per_call']:.3f} | {b['TFLOPs']:.1f} |")
    return L


def markdown(rep):
    label = f" [{rep['label']}]" if rep.get("label") else ""
    L = [f"## GPU backend report{label} ({rep['date']})", "",
         f"- device: {rep['device']} ({rep['backend']}); host: {rep['host']}; seed {rep['seed']}; env {rep.get('env', {})}", ""]
    e = rep["errors"]
    if e is None:
        return "\n".join(L + markdown_bandwidth(rep) + markdown_formats(rep)) + "\n"
    L += ["| op | metric | value | tolerance |", "| --- | --- | --- | --- |"]
    r = e["rms_norm"]
    L.append(f"| rms_norm | max rel err vs CPU | {r['max_rel_vs_cpu']:.3g} | 1e-6 |")
    L.append(f"| rms_norm | max err vs f64 / row max | {r['max_err_vs_f64_over_rowmax']:.3g} | 2e-6 |")
    L.append(f"| rms_norm | residual sum h bit-exact | {r['residual_sum_bit_exact']} | exact |")
    for k, v in e["matmul"]["max_err_over_sum_abs_xw"].items():
        L.append(f"| matmul {k} | max err / sum abs(x)abs(w) | {v:.3g} | {'2^-8' if 'cuBLAS' in k else '1e-5'} |")
    for k, v in e.get("matmul_formats", {}).get("max_err_vs_cpu_over_sum_abs_xw", {}).items():
        L.append(f"| matmul {k} 512 x 5120 | max err vs CPU / sum abs(x)abs(w) | {v:.3g} | {'2^-8' if 'cuBLAS' in k else '1e-5'} |")
    L.append(f"| argmax 16 x 248320 | mismatches vs numpy | {e['argmax']['mismatches_vs_numpy']} | 0 |")
    return "\n".join(L + markdown_bandwidth(rep) + markdown_formats(rep)) + "\n"


def markdown_bandwidth(rep):
    L = []
    if rep.get("attn_gdn"):
        L += ["", "Attention / GDN decode at 27B shapes (Python loop, per call; GB/s = state or KV bytes read):", "",
              "| op | us/call | GB/s |", "| --- | --- | --- |"]
        L += [f"| {r['op']} | {r['us_per_call']:.1f} | {r['kv_GBps']:.0f} |" for r in rep["attn_gdn"]]
    c = rep["copy"]
    L += ["", f"Device-to-device copy (torch, 2 GiB, read+write): **{c['GBps']:.0f} GB/s**" if c else "copy: torch missing", ""]
    g = rep["gemv"]
    if g:
        L += [f"Q8_0 GEMV via sn.matmul (Python loop, host floor {g['host_floor_us_per_call']:.1f} us/call):", "",
              "| out x in | n | us/call | weight GB/s | / copy BW | GFLOP/s |", "| --- | --- | --- | --- | --- | --- |"]
        for r in g["rows"]:
            ratio = f"{r['ratio_to_copy']:.2f}" if r["ratio_to_copy"] else "-"
            L.append(f"| {r['out']} x {r['in']} | {r['n']} | {r['us_per_call']:.1f} | {r['weight_GBps']:.0f} | {ratio} | {r['gflops']:.0f} |")
    return L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--label", default="", help="variant name shown in the report (e.g. an env setting)")
    ap.add_argument("--bandwidth-only", action="store_true", help="skip the error checks")
    ap.add_argument("--formats-only", action="store_true", help="only copy bandwidth and the per-format matmul table")
    ap.add_argument("--no-formats", action="store_true", help="skip the per-format matmul table")
    args = ap.parse_args()
    if not sn.gpu_available():
        print("no GPU available: nothing to report", file=sys.stderr)
        return 1
    seed = int(os.environ.get("SPECD_TEST_SEED", secrets.randbits(32)))
    rng = np.random.default_rng(seed)
    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": sn.gpu_device_name(), "backend": sn.gpu_backend(),
           "host": platform.node(), "seed": seed, "label": args.label,
           "env": {k: v for k, v in os.environ.items() if k.startswith("SPECD_")}}
    rep["errors"] = None if (args.bandwidth_only or args.formats_only) else errors(rng)
    print(json.dumps(rep["errors"], indent=1), flush=True)
    rep["copy"] = copy_bandwidth()
    copy_gbps = rep["copy"]["GBps"] if rep["copy"] else None
    rep["gemv"] = None if args.formats_only else gemv_bandwidth(rng, copy_gbps)
    rep["attn_gdn"] = None if args.formats_only else attention_gdn_timing(rng)
    rep["formats"] = None if args.no_formats else format_bandwidth(rng, copy_gbps)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(rep, f, indent=1)
    md = markdown(rep)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
