#!/usr/bin/env python3
"""The transport floor under specd's loop overhead: one worker round trip with nothing of specd in it.

Runs a bare worker.proto ``TargetWorker.VerifyStream`` server in a child process (grpcio's
thread-pool server, as the target and draft workers use; or ``--server aio``) whose handler only
sleeps ``--handler-ms`` (a stand-in for the GPU step: the threads then wake from idle, as in serving)
and answers, and a client in this process that sends requests over one stream as specd's coordinator
does (grpc.aio, the read posted before the write, unix socket, the same GRPC_EXPERIMENTS default as the
specd processes). ``ipc``: the same handler behind the workers' IPC stream socket
(specd.target_worker.ipc_stream.IpcStreamServer: framed protobuf on a Unix socket, one blocking thread
per connection) and the coordinator's own client for it (specd.coordinator.server.IpcStream: a
non-blocking socket on the event loop), i.e. specd's default hot path. Both sides stamp time.perf_counter (CLOCK_MONOTONIC, shared
by the processes), so each round trip splits into the request path (client write -> handler start)
and the response path (handler end -> client read done). Reports medians over ``--calls`` calls after
a warm-up; one row per server kind (default all three: sync, aio, ipc; ``both``, the name from before
the ipc row, still means sync and aio).

Compare with the in-step overhead per worker call of tools/bench/loop_overhead.py on the same machine:
what is above this floor is specd's own Python around the calls.

``--ipc-spin-us N [N ...]``: one ipc row per value, the server and the client both spinning up to N us
before blocking (the workers' and the coordinator's ``--ipc-spin-us``; 0 = off, the default): the request
path then shows the worker's wake-up saved, and with a handler shorter than the spin the response path
the client's.

Usage: python tools/bench/grpc_floor.py [--calls 400] [--handler-ms 3] [--server sync|aio|ipc|both|all]
       [--ipc-spin-us 0 [200 ...]] [--write FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# the specd processes' default (specd/coordinator/app.py, target_worker/server.py): iomgr TCP stack
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client,-event_engine_listener")


def serve(addr: str, kind: str, handler_s: float, log_path: str, spin_us: int = 0) -> None:
    """The child: a VerifyStream server whose handler sleeps handler_s and logs its start / end."""
    from concurrent import futures

    import grpc

    from specd.protos.v1 import worker_pb2 as pb
    from specd.protos.v1 import worker_pb2_grpc as pbg

    log = open(log_path, "w", buffering=1)

    def work():
        t = time.perf_counter()
        time.sleep(handler_s)
        te = time.perf_counter()
        log.write(f"{t:.7f} {te:.7f}\n")
        return pb.VerifyResponse(accepted=0, emitted=[1, 2, 3], committed=5, compute_s=te - t)

    if kind == "ipc":
        serve_ipc(work, spin_us)
        return
    if kind == "sync":
        class Sync(pbg.TargetWorkerServicer):
            def VerifyStream(self, requests, context):
                for _ in requests:
                    yield work()

        server = grpc.server(futures.ThreadPoolExecutor(8))
        pbg.add_TargetWorkerServicer_to_server(Sync(), server)
        server.add_insecure_port(addr)
        server.start()
        print("READY", flush=True)
        server.wait_for_termination()
        return

    class Aio(pbg.TargetWorkerServicer):
        async def VerifyStream(self, requests, context):
            async for _ in requests:
                yield await asyncio.to_thread(work)

    async def main():
        server = grpc.aio.server()
        pbg.add_TargetWorkerServicer_to_server(Aio(), server)
        server.add_insecure_port(addr)
        await server.start()
        print("READY", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def serve_ipc(work, spin_us: int = 0) -> None:
    """The ipc child: ``work`` as the VerifyStream handler of an IpcStreamServer (no compute-slot
    limit; spinning up to ``spin_us`` before each blocking read); prints READY with the socket path and
    token, serves until SIGTERM, then removes the socket."""
    import signal

    from specd.target_worker.ipc_stream import VERIFY_STREAM, IpcStreamServer
    from specd.target_worker.server import ComputeSlots

    class Servicer:
        slots = ComputeSlots(0)
        ipc_stream = None

        def _verify(self, request, context):
            return work()

    ipc = IpcStreamServer(Servicer(), VERIFY_STREAM, "grpc-floor", 1 << 20, 8, spin_us=spin_us)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    print(f"READY {ipc.path} {ipc.token.hex()}", flush=True)
    while not stop.wait(0.5):
        pass
    ipc.close()


async def ipc_client(path: str, token: bytes, calls: int, warmup: int, spin_us: int = 0) -> list[tuple[float, float]]:
    """(call start, answer parsed) per call after the warm-up, over one IPC stream (specd's client,
    with an IpcSpin of ``spin_us`` when > 0)."""
    from specd.coordinator.server import IpcOffer, IpcSpin, IpcStream
    from specd.protos.v1 import worker_pb2 as pb
    from specd.target_worker.ipc_stream import VERIFY_STREAM

    out = []
    stream = IpcStream(IpcOffer(path, token, VERIFY_STREAM), 60.0, 1 << 20, spin=IpcSpin(spin_us) if spin_us else None)
    req = pb.VerifyRequest(seq_id="floor", tokens=[1, 2, 3, 4])
    try:
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            await stream.call(req, None)
            if i >= warmup:
                out.append((t0, time.perf_counter()))
    finally:
        await stream.close(True, 5.0)
    return out


async def client(addr: str, calls: int, warmup: int) -> list[tuple[float, float]]:
    """(write start, read done) per call after the warm-up, over one stream."""
    import grpc

    from specd.protos.v1 import worker_pb2 as pb
    from specd.protos.v1 import worker_pb2_grpc as pbg

    out = []
    async with grpc.aio.insecure_channel(addr) as channel:
        call = pbg.TargetWorkerStub(channel).VerifyStream()
        loop = asyncio.get_running_loop()
        req = pb.VerifyRequest(seq_id="floor", tokens=[1, 2, 3, 4])
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            read = loop.create_task(call.read())  # posted first, as specd's WorkerStream.call
            await call.write(req)
            await read
            if i >= warmup:
                out.append((t0, time.perf_counter()))
        await call.done_writing()
    return out


def measure(kind: str, calls: int, handler_ms: float, spin_us: int = 0) -> dict:
    """Medians in microseconds: request path, response path, round trip minus the handler (ipc: both
    sides spinning up to ``spin_us``)."""
    with tempfile.TemporaryDirectory(prefix="specd-grpc-floor-") as d:
        addr, log = f"unix://{d}/floor.sock", os.path.join(d, "handler.log")
        child = subprocess.Popen([sys.executable, __file__, "--serve", addr, "--server", kind,
                                  "--handler-ms", str(handler_ms), "--log", log, "--ipc-spin-us", str(spin_us)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            ready = child.stdout.readline().split()
            if not ready or ready[0] != "READY":
                raise RuntimeError(f"the {kind} server did not start")
            warmup = 50
            if kind == "ipc":
                stamps = asyncio.run(ipc_client(ready[1], bytes.fromhex(ready[2]), calls, warmup, spin_us))
            else:
                stamps = asyncio.run(client(addr, calls, warmup))
        finally:
            child.terminate()
            child.wait(10)
        handler = [tuple(map(float, line.split())) for line in open(log)][warmup:]
    if len(handler) != len(stamps):
        raise RuntimeError(f"{len(handler)} handler stamps for {len(stamps)} calls")
    med = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731
    req = [hs - t0 for (t0, _), (hs, _he) in zip(stamps, handler)]
    rsp = [t2 - he for (_, t2), (_hs, he) in zip(stamps, handler)]
    rest = [(t2 - t0) - (he - hs) for (t0, t2), (hs, he) in zip(stamps, handler)]
    name = f"ipc, spin {spin_us} us" if kind == "ipc" and spin_us else kind
    return {"server": name, "request_us": med(req), "response_us": med(rsp), "round_trip_minus_handler_us": med(rest)}


def markdown(rows: list[dict], args) -> str:
    cmd = f"python tools/bench/grpc_floor.py --calls {args.calls} --handler-ms {args.handler_ms} --server {args.server}"
    if args.ipc_spin_us != [0]:
        cmd += f" --ipc-spin-us {' '.join(map(str, args.ipc_spin_us))}"
    out = [f"## Transport floor of one worker round trip: gRPC and IPC streams ({datetime.date.today().isoformat()})", "",
           f"**Hardware.** {platform.machine()} host, {os.cpu_count()} cores. **Command.** `{cmd}`. One VerifyStream, "
           f"client grpc.aio (specd's coordinator pattern), handler sleeping {args.handler_ms} ms, unix socket; medians "
           f"of {args.calls} calls. Row ipc: the same handler and messages over the workers' IPC stream socket "
           "(length-prefixed frames, one blocking thread per connection) with the coordinator's IpcStream client "
           "(a non-blocking socket on the event loop): specd's default hot path.", "",
           "| server | request path (write -> handler) | response path (handler -> read) | round trip minus handler |",
           "| --- | --- | --- | --- |"]
    out += [f"| {r['server']} | {r['request_us']:.0f} us | {r['response_us']:.0f} us | "
            f"{r['round_trip_minus_handler_us']:.0f} us |" for r in rows]
    return "\n".join(out) + "\n"


KINDS = {"sync": ["sync"], "aio": ["aio"], "ipc": ["ipc"], "both": ["sync", "aio"]}  # --server -> rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400, help="timed calls per server kind (default 400)")
    ap.add_argument("--handler-ms", type=float, default=3.0, help="handler sleep in ms (default 3)")
    ap.add_argument("--server", choices=[*KINDS, "all"], default="all",
                    help="server kind(s) to measure (default all: sync, aio and ipc, one row each; both: sync "
                         "and aio)")
    ap.add_argument("--ipc-spin-us", type=int, nargs="+", default=[0],
                    help="ipc rows: server and client spin up to this many us before blocking; one row per value "
                         "(default 0 = off)")
    ap.add_argument("--write", default="", help="append the markdown section to this file")
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--log", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.calls < 1 or args.handler_ms < 0 or min(args.ipc_spin_us) < 0:
        ap.error("--calls must be >= 1, --handler-ms and --ipc-spin-us >= 0")
    if args.serve:
        serve(args.serve, args.server, args.handler_ms / 1e3, args.log, args.ipc_spin_us[0])
        return 0
    kinds = KINDS[args.server] if args.server in KINDS else KINDS["sync"] + KINDS["aio"] + KINDS["ipc"]
    md = markdown([measure(k, args.calls, args.handler_ms, spin) for k in kinds
                   for spin in (args.ipc_spin_us if k == "ipc" else [0])], args)
    print(md)
    if args.write:
        with open(args.write, "a", encoding="utf-8") as f:
            f.write("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
