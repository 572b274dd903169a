"""Native ops release the GIL while they compute (bindings.h ``without_gil``): another Python thread
(an RPC handler, the other worker of an in-process test stack) keeps running during a long op.

Measured as the longest pause of a Python loop in the main thread while a worker thread runs one
long op: with the GIL held the loop stalls for the whole op, without it only for switch intervals."""
import threading
import time

import numpy as np

import specd.native as sn


def longest_stall(op) -> tuple[float, float]:
    """(op seconds, longest gap between main-loop iterations while the op ran)."""
    done, span = threading.Event(), {}

    def work():
        t0 = time.perf_counter()
        op()
        span["s"] = time.perf_counter() - t0
        done.set()

    th = threading.Thread(target=work)
    last, worst = time.perf_counter(), 0.0
    th.start()
    while not done.is_set():
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    th.join()
    return span["s"], worst


def test_matmul_and_attention_release_the_gil():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 4096)).astype(np.float32)
    x = rng.standard_normal((48, 4096)).astype(np.float32)
    k = rng.standard_normal((4096, 4, 128)).astype(np.float16)
    q = rng.standard_normal((64, 16, 128)).astype(np.float32)
    pos = np.arange(4032, 4096, dtype=np.int32)
    for name, op in [("matmul", lambda: sn.matmul(x, w)), ("attention", lambda: sn.attention(q, k, k, 4096, pos))]:
        span, stall = longest_stall(op)
        if span < 0.05:
            continue  # too fast to tell on this machine
        assert stall < 0.5 * span, f"{name}: the main thread stalled {stall:.3f} s of a {span:.3f} s op"
