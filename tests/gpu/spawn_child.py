"""Runs a test's function in a spawned child process (its own CUDA context), for the GPU tests of
cross-process CUDA IPC (feature ring, shared target tensors)."""
import multiprocessing as mp


def run_child(target, *args, timeout=120):
    """Calls ``target(*args, queue)`` in a spawned process; ``target`` puts ("ok", result) or ("err",
    text) on the queue. Returns the result; fails the test on "err", on a timeout or on a non-zero exit
    (the child must close its handles and exit cleanly). The child is killed if it outlives ``timeout``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        status, out = q.get(timeout=timeout)
    finally:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    assert status == "ok", out
    assert p.exitcode == 0
    return out
