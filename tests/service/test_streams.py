"""The hot path over per-sequence worker streams (worker.proto VerifyStream / ProposeStream,
CoordinatorConfig.worker_streams), over the workers' IPC stream sockets (ipc_streams, the default) or
gRPC, and the pipelined client write: lossless against plain greedy and against the unary path, one
stream per sequence and worker, the per-call bound without a deadline, compute-slot admission of
streams, and the cached metric children. Tests of the stream semantics run on both transports
(``transport``: "ipc" = the stack's default coordinator, "grpc" = ``ipc_streams=False``)."""
from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from specd.coordinator.policy import PolicyConfig
from specd.draft_worker import server as dserver
from specd.draft_worker.scripted import ScriptedDrafter
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg
from specd.target_worker import server as tserver

from .conftest import generate, streamed_ids, token_request
from .test_serving import wait_released


def _spec(mode=gpb.SPECULATION_MODE_FORCE, **kw):
    return gpb.SpeculationParams(mode=mode, **kw)


# the coordinator options of each hot-path transport (the stack's policy: speculate every step)
TRANSPORTS = {"ipc": {}, "grpc": {"ipc_streams": False}, "unary": {"worker_streams": False}}
HOT_PATH = {"ipc": "ipc-stream", "grpc": "grpc-stream", "unary": "unary"}


def via(stack, transport: str, **kw):
    """A SpecDecode stub of a coordinator over the stack's workers whose hot path is ``transport``
    ("ipc": the stack's default coordinator; the others started once and cached; with ``kw`` a new
    one), checked to use that transport for both workers."""
    cache = stack.__dict__.setdefault("transport_stubs", {})
    if transport not in cache or kw:
        if transport == "ipc" and not kw:
            stub, coord = stack.stub, stack.coords[0][0]
        else:
            stub = stack.coordinator(**{"policy": PolicyConfig(step_ratio=0), **TRANSPORTS[transport], **kw})
            coord = stack.coords[-1][0]
        assert coord.hot_path == {"target": HOT_PATH[transport], "drafter": HOT_PATH[transport]}, coord.hot_path
        if kw:
            return stub
        cache[transport] = stub
    return cache[transport]


def _wait_slots_free(stack, timeout=10.0):
    """Waits until every compute slot of both workers is free again (no stream left holding one)."""
    end = time.monotonic() + timeout
    while True:
        taken = [(s.n - s.sem._value) for s in (stack.tservicer.slots, stack.dservicer.slots)]
        if taken == [0, 0]:
            return
        if time.monotonic() > end:
            raise AssertionError(f"compute slots still taken (target, drafter): {taken}")
        time.sleep(0.05)


def greedy_runs(stubs, prompt, ref, spec, n=30):
    """Generates n tokens of ``prompt`` through each stub with speculation ``spec``; asserts each streams
    exactly ``ref[:n]`` (the plain greedy tokens) and returns each run's (steps, drafts, accepted tokens,
    accepted per position), for comparing the paths' speculation."""
    out = []
    for stub in stubs:
        chunks, done = generate(stub, token_request(prompt, n, ignore_eos=True, speculation=spec))
        assert streamed_ids(chunks) == ref[:n] == list(done.output_ids)
        sp = done.speculation
        out.append((done.timing.steps, sp.num_drafts, sp.num_accepted_tokens, list(sp.accepted_per_position)))
    return out


@pytest.mark.parametrize("transport", ["ipc", "grpc", "unary"])
@pytest.mark.parametrize("plan", [None, 2, 0])
@pytest.mark.parametrize("draft_mode", [gpb.DRAFT_MODE_CHAIN, gpb.DRAFT_MODE_TREE])
def test_streams_and_unary_calls_give_the_plain_greedy_output(stack, reference, plan, draft_mode, transport):
    """Chain and tree steps at full, partial and no acceptance: the IPC stream path (default), the
    gRPC stream path (--no-ipc-streams) and the unary path (--no-worker-streams) each stream exactly
    the plain greedy tokens, with the same steps and acceptance as the unary path."""
    prompt = [7, 1, 8, 2, 8]
    ref, _ = reference(prompt, 40)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = plan
    try:
        a, b = greedy_runs((via(stack, transport), via(stack, "unary")), prompt, ref, _spec(draft_mode=draft_mode))
        assert a == b
    finally:
        stack.drafter.plan = None
    wait_released(stack)


@pytest.mark.parametrize("transport", ["ipc", "grpc"])
def test_one_stream_per_sequence_and_worker_carries_every_step(stack, reference, monkeypatch, transport):
    """With worker_streams (default) a request opens one VerifyStream and one ProposeStream and sends
    every step over them: no unary Verify / Propose, one stream message per step and worker call.
    Over IPC each worker accepts exactly one connection for the request (none over gRPC)."""
    prompt = [2, 7, 1, 8]
    ref, _ = reference(prompt, 30)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 1
    seen = {"Verify": 0, "Propose": 0, "VerifyStream": 0, "ProposeStream": 0, "verify_msgs": 0, "propose_msgs": 0}
    lock = threading.Lock()
    # the servicers' RPC methods are bound at registration; both workers admit calls through
    # ComputeSlots.run (unary) and ComputeSlots.stream (streams), looked up per call
    real_run, real_stream = tserver.ComputeSlots.run, tserver.ComputeSlots.stream
    names = {"_verify": ("Verify", "VerifyStream", "verify_msgs"), "_propose": ("Propose", "ProposeStream", "propose_msgs")}

    def run(self, context, fn, *args):
        if fn.__name__ in names:
            with lock:
                seen[names[fn.__name__][0]] += 1
        return real_run(self, context, fn, *args)

    def stream(self, context, fn, requests):
        key = names.get(fn.__name__)
        if key:
            with lock:
                seen[key[1]] += 1

        def counted():
            for r in requests:
                if key:
                    with lock:
                        seen[key[2]] += 1
                yield r
        return real_stream(self, context, fn, counted())

    stub = via(stack, transport)
    monkeypatch.setattr(tserver.ComputeSlots, "run", run)
    monkeypatch.setattr(tserver.ComputeSlots, "stream", stream)
    ipcs = (stack.tservicer.ipc_stream, stack.dservicer.ipc_stream)
    before = [i.connections for i in ipcs]
    try:
        chunks, done = generate(stub, token_request(prompt, 20, ignore_eos=True, speculation=_spec()))
    finally:
        stack.drafter.plan = None
    assert streamed_ids(chunks) == ref[:20]
    assert [i.connections - b for i, b in zip(ipcs, before)] == ([1, 1] if transport == "ipc" else [0, 0])
    steps = done.timing.steps
    assert seen["Verify"] == seen["Propose"] == 0
    assert seen["VerifyStream"] == seen["ProposeStream"] == 1
    assert seen["verify_msgs"] == steps
    assert 1 <= seen["propose_msgs"] <= steps
    wait_released(stack)


@pytest.mark.parametrize("transport", ["ipc", "grpc"])
def test_plain_requests_open_no_drafter_stream(stack, reference, monkeypatch, transport):
    """Speculation off: the verify stream only (the drafter is never called)."""
    stub = via(stack, transport)
    opened = []
    real = tserver.ComputeSlots.stream
    monkeypatch.setattr(tserver.ComputeSlots, "stream",
                        lambda self, c, fn, it: opened.append(fn.__name__) or real(self, c, fn, it))
    prompt = [5, 5, 6]
    ref, _ = reference(prompt, 12)
    chunks, done = generate(stub, token_request(prompt, 12, ignore_eos=True,
                                                speculation=_spec(gpb.SPECULATION_MODE_OFF)))
    assert streamed_ids(chunks) == ref[:12] and opened == ["_verify"]
    wait_released(stack)


@pytest.mark.parametrize("transport", ["ipc", "grpc"])
def test_stream_call_without_deadline_is_bounded_by_worker_timeout(stack, reference, transport):
    """No request deadline: each stream message is bounded by worker_timeout_s like a unary call; a
    drafter that does not answer in time ends the request with DEADLINE_EXCEEDED and frees both
    workers' sequences (and, on both transports, their stream slots)."""
    stub = via(stack, transport, worker_timeout_s=0.5)
    prompt = [9, 9, 1]
    real = stack.drafter.propose

    def slow(*a, **kw):
        time.sleep(3.0)
        return real(*a, **kw)

    stack.drafter.propose = slow
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            generate(stub, token_request(prompt, 10, ignore_eos=True, speculation=_spec()), timeout=None)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value.details()
        assert "worker_timeout_s" in ei.value.details()
        assert time.monotonic() - t0 < 2.5  # before the drafter's answer
    finally:
        del stack.drafter.propose  # the slow call in flight keeps running; its Release waits for it
    wait_released(stack)
    _wait_slots_free(stack)


@pytest.mark.parametrize("transport", ["ipc", "grpc"])
def test_stream_with_deadline_ends_with_deadline_exceeded(stack, transport):
    """A request deadline bounds every stream message (gRPC: the stream's deadline; IPC: the call's
    timer): a step that outlives it ends the request with DEADLINE_EXCEEDED."""
    stub = via(stack, transport)
    real = stack.drafter.propose

    def slow(*a, **kw):
        time.sleep(1.0)
        return real(*a, **kw)

    stack.drafter.propose = slow
    try:
        with pytest.raises(grpc.RpcError) as ei:
            generate(stub, token_request([4, 4, 2], 10, ignore_eos=True, speculation=_spec()), timeout=0.6)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        del stack.drafter.propose
    wait_released(stack)
    _wait_slots_free(stack)


def test_stream_worker_error_maps_like_the_unary_call(stack):
    """A worker error on a stream message ends the request with the unary call's mapping
    (a Verify of a sequence the target does not know: NOT_FOUND -> INTERNAL naming the call)."""
    t = wpbg.TargetWorkerStub(grpc.insecure_channel(f"unix://{stack.dir}/t.sock"))
    call = t.VerifyStream(iter([wpb.VerifyRequest(seq_id="no-such-seq", tokens=[1])]), timeout=10)
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("transport", ["ipc", "grpc"])
def test_worker_error_mid_stream_ends_that_request_only(stack, reference, monkeypatch, transport):
    """The target refuses the 3rd Verify of one request (INVALID_ARGUMENT on its stream): that request
    ends with the unary mapping (INTERNAL naming the call) after the chunks of its first steps, which
    are the plain greedy tokens; a request running alongside and the next one are served in full, and
    both workers' sequences and compute slots are freed."""
    stub = via(stack, transport)
    bad, good = [3, 1, 4, 1, 5], [2, 7, 1, 8, 2]
    for p in (bad, good):
        ref, _ = reference(p, 40)
        stack.drafter.continuations[tuple(p)] = ref
    stack.drafter.plan = 1
    real, n = stack.tservicer._verify, {}

    def verify(request, context):
        if request.seq_id.startswith("bad-"):
            n[request.seq_id] = n.get(request.seq_id, 0) + 1
            if n[request.seq_id] == 3:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused for the test")
        return real(request, context)

    monkeypatch.setattr(stack.tservicer, "_verify", verify)
    req = token_request(bad, 30, ignore_eos=True, speculation=_spec())
    req.request_id = "bad-1"
    got, other = [], {}
    t = threading.Thread(target=lambda: other.update(
        r=generate(stub, token_request(good, 30, ignore_eos=True, speculation=_spec()))))
    t.start()
    try:
        with pytest.raises(grpc.RpcError) as ei:
            for r in stub.Generate(req, timeout=60):
                got.extend(r.chunk.token_ids)
    finally:
        t.join(60)
        stack.drafter.plan = None
    assert ei.value.code() == grpc.StatusCode.INTERNAL
    assert "verify failed: INVALID_ARGUMENT: refused for the test" in ei.value.details()
    assert 0 < len(got) < 30 and got == reference(bad, 40)[0][:len(got)]
    chunks, _ = other["r"]
    assert streamed_ids(chunks) == reference(good, 40)[0][:30]
    chunks, _ = generate(stub, token_request(good, 12, ignore_eos=True, speculation=_spec()))
    assert streamed_ids(chunks) == reference(good, 40)[0][:12]
    wait_released(stack)
    _wait_slots_free(stack)


class _AbortContext:
    def __init__(self):
        self.code = None

    def abort(self, code, details):
        self.code = code
        raise RuntimeError(details)


def test_compute_slots_admit_a_stream_for_its_whole_life():
    """ComputeSlots.stream holds one slot from the stream's first message to its end; another call
    meanwhile is refused with RESOURCE_EXHAUSTED, and the slot is free again after the stream."""
    slots = tserver.ComputeSlots(1)
    ctx = _AbortContext()
    msgs = iter([1, 2, 3])
    gen = slots.stream(ctx, lambda r, c: r * 10, msgs)
    assert next(gen) == 10
    with pytest.raises(RuntimeError):
        slots.run(ctx, lambda: None)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list(gen) == [20, 30]
    assert slots.run(ctx, lambda: "ok") == "ok"
    gen2 = slots.stream(ctx, lambda r, c: r, iter([1, 2]))
    assert next(gen2) == 1
    gen2.close()  # a cancelled stream (the server closes the generator) frees its slot too
    assert slots.run(ctx, lambda: "ok") == "ok"


def test_step_metrics_use_cached_children_and_list_only_reached_positions():
    """record_step keeps its per-step series children and creates per-position series only for
    positions that occurred (values as before the caching)."""
    from specd.coordinator.metrics import CoordinatorMetrics

    mx = CoordinatorMetrics("m", "d")
    mx.record_step(4, 2, 0.001, 0.002, 0.0005)
    mx.record_step(4, 0, 0.001, 0.002, 0.0005)
    mx.record_step(0, 0, 0.0, 0.002, 0.0005)
    r = mx.registry
    lab = {"model": "m", "drafter": "d"}
    assert r.get_sample_value("specd_spec_drafts_total", lab) == 2
    assert r.get_sample_value("specd_spec_draft_tokens_total", lab) == 8
    assert r.get_sample_value("specd_spec_accepted_tokens_total", lab) == 2
    assert r.get_sample_value("specd_spec_reached_positions_total", {**lab, "position": "0"}) == 2
    assert r.get_sample_value("specd_spec_reached_positions_total", {**lab, "position": "2"}) == 1
    assert r.get_sample_value("specd_spec_reached_positions_total", {**lab, "position": "3"}) is None
    assert r.get_sample_value("specd_spec_accepted_tokens_per_position_total", {**lab, "position": "1"}) == 1
    assert r.get_sample_value("specd_spec_accepted_tokens_per_position_total", {**lab, "position": "2"}) is None
    assert r.get_sample_value("specd_step_seconds_count", {**lab, "phase": "verify"}) == 3
    assert r.get_sample_value("specd_step_seconds_count", {**lab, "phase": "draft"}) == 2


def test_worker_streams_flag_default_and_serve_forwarding():
    """--no-worker-streams (coordinator, forwarded by serve) turns the streams off; default on."""
    from specd.coordinator.cli import build_parser
    from specd.coordinator.config import config_from_args
    from specd.coordinator.launcher import _passthrough

    p = build_parser()
    assert config_from_args(p.parse_args(["coordinator"])).worker_streams is True
    assert config_from_args(p.parse_args(["coordinator", "--no-worker-streams"])).worker_streams is False
    args = p.parse_args(["serve", "--no-worker-streams"])
    assert "--no-worker-streams" in _passthrough(args)
    assert "--no-worker-streams" not in _passthrough(p.parse_args(["serve"]))


class _EndedRpc:
    """A stream-stream call that the worker ended (UNAVAILABLE) while the coordinator was between steps."""

    def done(self):
        return True

    async def write(self, msg):
        import asyncio

        raise asyncio.InvalidStateError("RPC already finished")

    async def read(self):
        raise AssertionError("not reached")

    async def code(self):
        return grpc.StatusCode.UNAVAILABLE

    async def details(self):
        return "connection reset"

    def cancel(self):
        return False


def test_worker_stream_that_ended_between_steps_maps_its_status():
    """A stream the worker ended between two steps (worker restarted) fails the next call with the
    stream's status mapped like a unary call (UNAVAILABLE stays UNAVAILABLE), not as an internal error."""
    import asyncio

    from specd.coordinator.server import RequestError, WorkerStream

    ws = WorkerStream(lambda timeout=None: _EndedRpc(), "verify", 5.0)

    async def run():
        with pytest.raises(RequestError) as ei:
            await ws.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None)
        return ei.value

    err = asyncio.run(run())
    assert err.code == grpc.StatusCode.UNAVAILABLE and "worker unavailable" in err.message
    asyncio.run(ws.close(True))  # done: nothing to close, no error


class BlackHoleProxy:
    """TCP relay 127.0.0.1:port -> target; ``freeze()`` stops relaying but keeps every socket open."""

    def __init__(self, target_port):
        self.target_port, self.frozen, self.closed, self.socks = target_port, threading.Event(), threading.Event(), []
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen()
        self.port = self.lsock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.target_port))
            self.socks += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a, b):
        a.settimeout(0.05)
        while not self.closed.is_set():
            if self.frozen.is_set():
                time.sleep(0.05)  # read nothing more: the peer's bytes pile up unanswered
                continue
            try:
                data = a.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                b.sendall(data)
            except OSError:
                return

    def freeze(self):
        self.frozen.set()

    def close(self):
        self.closed.set()
        self.lsock.close()
        for s in self.socks:
            s.close()


def test_stream_of_a_vanished_coordinator_frees_its_slot(monkeypatch):
    """A ProposeStream whose coordinator vanished without closing its connection (host down, network
    partition; here a relay that stops forwarding) holds a compute slot and an RPC thread while it
    waits for its next step: the worker's keepalive ping finds the dead peer and frees them (before,
    gRPC's default server keepalive of 2 h kept them that long)."""
    monkeypatch.setattr(tserver, "KEEPALIVE_TIME_MS", 300)
    monkeypatch.setattr(tserver, "KEEPALIVE_TIMEOUT_MS", 500)
    servicer = dserver.DraftServicer(ScriptedDrafter(4, 100), idle_ttl_s=0)
    server, port = dserver.start_server(servicer, "127.0.0.1:0", threads=4)
    proxy = BlackHoleProxy(port)
    ch = grpc.insecure_channel(f"127.0.0.1:{proxy.port}")
    stop = threading.Event()
    try:
        slots = servicer.slots
        call = wpbg.DraftWorkerStub(ch).ProposeStream(iter(stop.wait, True))  # sends nothing
        end = time.monotonic() + 10
        while slots.sem._value == slots.n and time.monotonic() < end:
            time.sleep(0.02)
        assert slots.sem._value == slots.n - 1, "the stream holds a slot"
        proxy.freeze()
        end = time.monotonic() + 10
        while slots.sem._value != slots.n and time.monotonic() < end:
            time.sleep(0.05)
        assert slots.sem._value == slots.n, "the vanished coordinator's stream still holds its slot"
        call.cancel()
    finally:
        stop.set()
        proxy.close()
        ch.close()
        server.stop(0).wait()
        servicer.close()


@pytest.mark.parametrize("transport", ["ipc", "grpc"])
@pytest.mark.parametrize("where", ["between_steps", "mid_propose"])
def test_client_cancel_frees_both_workers_stream_slots(stack, reference, where, transport):
    """A client cancel between two steps or while a Propose is on the drafter: the coordinator cancels
    both streams (IPC: closes both connections), and the workers' stream handlers give their compute
    slots back (not only the sequences)."""
    stub = via(stack, transport)
    _wait_slots_free(stack)  # the slow calls of the tests above have ended
    prompt = [8, 6, 7, 5, 3, 0, 4]
    ref, _ = reference(prompt, 200)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 1
    real, calls, inside = stack.drafter.propose, [0], threading.Event()

    def slow(*a, **kw):
        calls[0] += 1
        if where == "mid_propose" and calls[0] == 3:
            inside.set()
            time.sleep(1.0)
        return real(*a, **kw)

    stack.drafter.propose = slow
    try:
        call = stub.Generate(token_request(prompt, 200, ignore_eos=True), timeout=60)
        it = iter(call)
        next(it)
        if where == "mid_propose":
            assert inside.wait(10)
        else:
            next(it)
        taken = [(s.n - s.sem._value) for s in (stack.tservicer.slots, stack.dservicer.slots)]
        assert taken == [1, 1], taken  # one open stream per worker
        call.cancel()
        _wait_slots_free(stack)
    finally:
        del stack.drafter.propose
        stack.drafter.plan = None
    wait_released(stack)


class _FakeRpc:
    """A stream-stream call whose write / read / done_writing behave as given."""

    def __init__(self, read_exc=None, hang_close=False):
        self.read_exc, self.hang_close, self.cancelled = read_exc, hang_close, False

    def done(self):
        return self.cancelled

    async def write(self, msg):
        pass

    async def read(self):
        raise self.read_exc

    async def done_writing(self):
        import asyncio

        if self.hang_close:
            await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True
        return True


def test_worker_without_stream_methods_names_the_flag():
    """An older worker (no VerifyStream: UNIMPLEMENTED) fails the request with an error that names
    --no-worker-streams."""
    import asyncio

    from specd.coordinator.server import RequestError, WorkerStream

    exc = grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="Method not found!")
    ws = WorkerStream(lambda timeout=None: _FakeRpc(read_exc=exc), "verify", 5.0)

    async def run():
        with pytest.raises(RequestError) as ei:
            await ws.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None)
        return ei.value

    err = asyncio.run(run())
    assert err.code == grpc.StatusCode.INTERNAL and "--no-worker-streams" in err.message


def test_worker_stream_reads_while_its_write_completes():
    """The answer's read is posted before the write's completion is awaited: an answer that comes
    back before that completion reaches the event loop is not held up by it (here the write completes
    only once the read is posted: awaiting the write first would never return)."""
    import asyncio

    from specd.coordinator.server import WorkerStream

    class Rpc(_FakeRpc):
        async def write(self, msg):
            await self.reading.wait()

        async def read(self):
            self.reading.set()
            return wpb.VerifyResponse(accepted=3)

    async def run():
        rpc = Rpc()
        rpc.reading = asyncio.Event()
        ws = WorkerStream(lambda timeout=None: rpc, "verify", 5.0)
        return await asyncio.wait_for(ws.call(wpb.VerifyRequest(seq_id="s", tokens=[1]), None), 5)

    assert asyncio.run(run()).accepted == 3


@pytest.mark.parametrize("started", [False, True])
def test_worker_stream_failed_write_cancels_its_read(started):
    """A write that fails (before or after the read is posted) raises the mapped error and leaves no
    read task behind."""
    import asyncio

    from specd.coordinator.server import RequestError, WorkerStream

    exc = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="gone")

    class Rpc(_FakeRpc):
        async def write(self, msg):
            if started:
                await asyncio.sleep(0.01)  # the read task runs meanwhile
            raise exc

        async def read(self):
            await asyncio.sleep(3600)

    async def run():
        ws = WorkerStream(lambda timeout=None: Rpc(), "propose", 5.0)
        with pytest.raises(RequestError) as ei:
            await ws.call(wpb.ProposeRequest(seq_id="s"), None)
        await asyncio.sleep(0.01)  # the cancelled read unwinds
        return ei.value, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    err, left = asyncio.run(run())
    assert err.code == grpc.StatusCode.UNAVAILABLE and "propose" in err.message and left == []


def test_worker_stream_close_is_bounded():
    """A half-close that does not complete within its timeout cancels the stream instead of holding
    up the Releases after it."""
    import asyncio

    from specd.coordinator.server import WorkerStream

    rpc = _FakeRpc(hang_close=True)
    ws = WorkerStream(lambda timeout=None: rpc, "verify", 5.0)
    ws.rpc = rpc
    t0 = time.monotonic()
    asyncio.run(ws.close(True, 0.2))
    assert rpc.cancelled and time.monotonic() - t0 < 2.0


def test_warns_when_the_drafter_has_fewer_slots_than_the_target_admits_sequences(stack, caplog):
    """Info carries both workers' compute slots and the target's max_sequences; with worker streams a
    coordinator whose drafter has fewer slots than the target admits sequences warns at start-up,
    naming the drafter's --threads (the test stack: 16 threads = 14 slots, max_sequences 64)."""
    coord = stack.coords[0][0]
    assert coord.tinfo.max_sequences == 64 and coord.tinfo.compute_slots == 14 and coord.dinfo.compute_slots == 14
    caplog.set_level("WARNING", logger="specd.coordinator")
    stack.coordinator()
    assert any("14 compute slots but the target admits 64 sequences" in r.getMessage() and "--threads >= 66" in
               r.getMessage() for r in caplog.records)
    caplog.clear()
    stack.coordinator(worker_streams=False)  # unary calls take turns: no warning
    assert not any("compute slots" in r.getMessage() for r in caplog.records)


def test_a_second_server_on_a_taken_address_fails():
    """gRPC servers set SO_REUSEPORT by default, so a second worker on the same TCP port would start and
    take half the calls: the workers (and the coordinator) turn it off, and the second bind fails
    with an error naming the address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    first, _ = dserver.start_server(dserver.DraftServicer(ScriptedDrafter(4, 64)), addr, 4)
    try:
        with pytest.raises(RuntimeError, match=f"draft-worker: cannot listen on {addr}"):
            dserver.start_server(dserver.DraftServicer(ScriptedDrafter(4, 64)), addr, 4)
    finally:
        first.stop(0).wait()
