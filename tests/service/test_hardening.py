"""Service-layer hardening (review findings): worker leases and Release bookkeeping, the connect
window, FORCE without gate switches, stats cut at a stop, /dev/shm exhaustion, health not starved,
request-controlled sizes, assigned request ids, slow readers, typed options."""
from __future__ import annotations

import argparse
import asyncio
import errno
import threading
import time

import grpc
import pytest

from specd.coordinator.config import CoordinatorConfig
from specd.coordinator.policy import PolicyConfig
from specd.coordinator.server import Coordinator, start_server
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import generate_pb2_grpc as gpbg
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg
from specd.target_worker import feature_shm
from specd.target_worker import server as tserver

from .conftest import BLOCK, generate, streamed_ids, token_request
from .test_serving import wait_released, worker_live


def _code(stub, req, timeout=30):
    try:
        generate(stub, req, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _in_loop(stack, coro, timeout=30):
    return asyncio.run_coroutine_threadsafe(coro, stack.loop).result(timeout)


# ---------------------------------------------------------------- finding 1: leases / releases

def test_close_waits_for_releases_of_cancelled_streams(stack, reference):
    """server.stop cancels the in-flight stream; close() must let its Releases finish before the
    channels close (nothing leaks on the workers)."""
    stub = stack.coordinator()
    coord, server, channel = stack.coords[-1]
    prompt = [90, 91, 92]
    ref, _ = reference(prompt, 200)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 1
    slow = stack.tservicer.features.release

    def release(seq_id):  # a slow worker Release: the call is in flight when close() runs
        time.sleep(0.3)
        return slow(seq_id)

    stack.tservicer.features.release = release
    try:
        call = stub.Generate(token_request(prompt, 150, ignore_eos=True), timeout=60)
        next(iter(call))

        async def shutdown():
            await server.stop(0)
            await coord.close()

        _in_loop(stack, shutdown())
    finally:
        stack.tservicer.features.release = slow
    stack.coords.pop()
    channel.close()
    assert not coord._releases
    wait_released(stack, timeout=3)


def test_idle_sequences_are_reaped_on_both_workers(stack):
    """A sequence nobody releases (coordinator gone) is freed by the workers' idle TTL."""
    with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as tch, \
            grpc.insecure_channel(f"unix://{stack.dir}/d.sock") as dch:
        t, d = wpbg.TargetWorkerStub(tch), wpbg.DraftWorkerStub(dch)
        pre = t.Prefill(wpb.PrefillRequest(seq_id="orphan-1", tokens=[5, 6, 7], capacity=20), timeout=10)
        d.Propose(wpb.ProposeRequest(seq_id="orphan-1", start=0, new_tokens=[5, 6, 7], anchor=pre.first_token,
                                     max_tokens=2, features=pre.features), timeout=10)
    assert worker_live(stack) == (["orphan-1"], 1, ["orphan-1"])
    assert stack.tservicer.reap_idle() == [] and stack.dservicer.reap_idle() == []  # fresh: kept
    later = time.monotonic() + 10_000
    assert stack.tservicer.reap_idle(later) == ["orphan-1"]
    assert stack.dservicer.reap_idle(later) == ["orphan-1"]
    assert worker_live(stack) == ([], 0, [])


def test_idle_reaper_thread_runs(stack):
    class Fake:
        n = 0

        def reap_idle(self):
            Fake.n += 1

    r = tserver.IdleReaper(Fake(), 0.04)
    time.sleep(0.2)
    r.stop()
    assert Fake.n >= 2


# ---------------------------------------------------------------- finding 3: connect window

def test_calls_before_connect_are_unavailable(stack):
    cfg = CoordinatorConfig(listen=f"unix://{stack.dir}/early.sock", target=f"unix://{stack.dir}/nothing.sock",
                            drafter="", worker_timeout_s=3.0, metrics_port=0)
    coord = Coordinator(cfg)
    fut = asyncio.run_coroutine_threadsafe(start_server(coord), stack.loop)
    try:
        with grpc.insecure_channel(cfg.listen) as ch:
            stub = gpbg.SpecDecodeStub(ch)
            end = time.monotonic() + 2.5
            code = None
            while time.monotonic() < end:
                code, _ = _code(stub, token_request([1, 2], 3), timeout=2)
                if code != grpc.StatusCode.UNAVAILABLE or "connecting" in _:
                    break
                time.sleep(0.05)
            assert code == grpc.StatusCode.UNAVAILABLE and "connecting" in _, (code, _)
            with pytest.raises(grpc.RpcError) as ei:
                stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=2)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        with pytest.raises(Exception):
            fut.result(15)


# ---------------------------------------------------------------- finding 4: FORCE

def test_force_mode_reports_no_gate_switches(stack, reference):
    stub = stack.coordinator(policy=PolicyConfig(step_ratio=1.9, burst_len=4, measure_times=False))
    prompt = [31, 32, 33]
    ref, _ = reference(prompt, 60)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 0  # every draft wrong: AUTO would gate
    req = token_request(prompt, 20, ignore_eos=True, speculation=gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE))
    chunks, done = generate(stub, req)
    assert streamed_ids(chunks) == ref[:20]
    assert list(done.speculation.policy_switches) == []
    assert done.speculation.num_drafts >= done.timing.steps - 1  # the last step has room for no draft


# ---------------------------------------------------------------- finding 5: stats = what was sent

def test_accepted_counts_stop_at_a_stop_inside_the_block(stack, reference):
    stub = stack.coordinator()
    coord = stack.coords[-1][0]
    prompt = [12, 14, 16, 18]
    ref, _ = reference(prompt, 40)
    j = next(i for i in range(2, BLOCK) if ref[i] not in ref[:i])
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = None  # oracle: the whole block is accepted
    chunks, done = generate(stub, token_request(prompt, 30, ignore_eos=True, stop_token_ids=[ref[j]]))
    assert streamed_ids(chunks) == ref[:j] and done.finish_reason == "stop"
    sp = done.speculation
    assert sp.num_accepted_tokens == j  # d_1..d_j consumed (d_j the stop), not the whole block
    assert sum(sp.accepted_per_position) == sp.num_accepted_tokens
    assert all(c.accepted_in_step <= j for c in chunks)
    reg = coord.metrics.registry
    lab = {"model": "condgen.gguf", "drafter": "scripted"}
    assert reg.get_sample_value("specd_spec_accepted_tokens_total", lab) == j


def test_unexpected_error_is_internal_and_counted_as_such(stack):
    stub = stack.coordinator()
    coord = stack.coords[-1][0]

    def boom(deadline):
        raise RuntimeError("boom")

    coord._timeout = boom
    code, _ = _code(stub, token_request([5, 6], 4))
    assert code == grpc.StatusCode.INTERNAL
    reg = coord.metrics.registry
    lab = {"model": "condgen.gguf", "drafter": "scripted"}
    end = time.monotonic() + 3
    while time.monotonic() < end and not reg.get_sample_value("specd_requests_total", {**lab, "finish_reason": "error",
                                                                                       "code": "INTERNAL"}):
        time.sleep(0.02)
    assert reg.get_sample_value("specd_requests_total", {**lab, "finish_reason": "error", "code": "INTERNAL"}) == 1
    assert not reg.get_sample_value("specd_requests_total", {**lab, "finish_reason": "abort", "code": "CANCELLED"})
    assert not reg.get_sample_value("specd_request_ttft_seconds_count", lab)  # nothing was sent
    wait_released(stack)


# ---------------------------------------------------------------- finding 6: /dev/shm full

def test_shm_exhaustion_is_resource_exhausted_naming_the_size(stack, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(feature_shm, "_fallocate", full, raising=False)
    code, details = _code(stack.stub, token_request([7, 8, 9], 5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "byte" in details and "/dev/shm" in details, details
    monkeypatch.undo()
    assert not feature_shm.FeatureWriter().live()
    wait_released(stack)
    chunks, _ = generate(stack.stub, token_request([7, 8, 9], 3))  # the worker still serves
    assert len(streamed_ids(chunks)) == 3


# ---------------------------------------------------------------- finding 7: health not starved

def test_health_answers_while_every_worker_thread_is_busy(stack):
    """Compute calls take at most threads - LIGHT_RESERVE threads (one more is refused at once), so
    Health / Release / Info always find a thread."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    listen = f"unix://{stack.dir}/t1.sock"
    slots0 = stack.tservicer.slots
    server, _ = tserver.start_server(stack.tservicer, listen, threads=2 + tserver.LIGHT_RESERVE)
    slow = stack.tservicer.model.prefill
    entered = threading.Event()

    def prefill(*a, **k):
        entered.set()
        time.sleep(1.0)
        return slow(*a, **k)

    stack.tservicer.model.prefill = prefill
    try:
        with grpc.insecure_channel(listen) as ch:
            t = wpbg.TargetWorkerStub(ch)
            futs = [t.Prefill.future(wpb.PrefillRequest(seq_id=f"busy-{i}", tokens=[1, 2, 3], capacity=10), timeout=10)
                    for i in range(2)]
            assert entered.wait(5)
            time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as ei:  # a third compute call: refused, not queued
                t.Prefill(wpb.PrefillRequest(seq_id="busy-2", tokens=[1, 2, 3], capacity=10), timeout=5)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for _ in range(3):
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
                t.Info(wpb.InfoRequest(), timeout=0.5)
            for f in futs:
                f.result()
            for i in range(3):
                t.Release(wpb.ReleaseRequest(seq_id=f"busy-{i}"), timeout=5)
    finally:
        stack.tservicer.model.prefill = slow
        stack.tservicer.slots = slots0
        if hasattr(server, "reaper"):
            server.reaper.stop()
        server.stop(0).wait()
    wait_released(stack)


def test_worker_threads_are_sized_from_max_sequences():
    cfg = tserver.TargetWorkerConfig(target="x.gguf", max_sequences=64)
    cfg.validate()
    assert cfg.rpc_threads == 72
    assert tserver.TargetWorkerConfig(target="x.gguf", threads=5).rpc_threads == 5


# ---------------------------------------------------------------- finding 8: request-controlled sizes

@pytest.mark.parametrize("mutate", [
    lambda r: setattr(r, "request_id", "x" * 300),
    lambda r: r.stopping.stop.extend([f"s{i}" for i in range(17)]),
    lambda r: r.stopping.stop.append("y" * 300),
])
def test_request_controlled_sizes_are_capped(stack, mutate):
    req = token_request([1, 2, 3], 4)
    mutate(req)
    code, _ = _code(stack.stub, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, _


def test_text_bytes_are_checked_before_tokenising(stack):
    stub = stack.coordinator(max_prompt_bytes=64)
    coord = stack.coords[-1][0]
    calls = []
    orig = coord.tok.tokenizer
    enc = orig.encode

    class Tok:
        def __getattr__(self, name):
            return getattr(orig, name)

        def encode(self, *a, **k):
            calls.append(threading.current_thread().name)
            return enc(*a, **k)

    import dataclasses

    coord.tok = dataclasses.replace(coord.tok, tokenizer=Tok())
    req = gpb.GenerateRequest(text="a" * 65)
    req.stopping.max_tokens = 2
    code, _ = _code(stub, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_bytes" in _ and not calls
    req.text = "hello"
    generate(stub, req)
    assert calls and calls[0] != stack.thread.name  # tokenised off the event loop


# ---------------------------------------------------------------- finding 9: assigned ids

def test_assigned_request_id_is_returned_random_and_abortable(stack, reference):
    prompt = [44, 45, 46]
    ref, _ = reference(prompt, 200)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 1
    call = stack.stub.Generate(token_request(prompt, 150, ignore_eos=True), timeout=60)
    md = dict(call.initial_metadata())
    rid = md["specd-request-id"]
    assert rid.startswith("req-") and len(rid) >= 4 + 32
    resp = stack.stub.Abort(gpb.AbortRequest(request_ids=[rid]), timeout=10)
    assert list(resp.aborted) == [rid]
    done = [r.complete for r in call if r.HasField("complete")]
    assert done and done[0].finish_reason == "abort"
    wait_released(stack)


# ---------------------------------------------------------------- finding 10: slow readers

class _StalledContext:
    """A server context whose client never takes a message."""

    def __init__(self):
        self.code = self.details = None

    def time_remaining(self):
        return None

    async def send_initial_metadata(self, md):
        pass

    async def write(self, msg):
        await asyncio.Event().wait()

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise grpc.aio.AbortError()


def test_slow_reader_ends_with_resource_exhausted(stack):
    stack.coordinator(send_stall_timeout_s=0.2)
    coord = stack.coords[-1][0]
    ctx = _StalledContext()
    req = token_request([3, 4, 5], 20, ignore_eos=True)

    async def run():
        with pytest.raises(grpc.aio.AbortError):
            await coord.Generate(req, ctx)

    t0 = time.monotonic()
    _in_loop(stack, run(), 10)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "send_stall_timeout_s" in ctx.details
    assert time.monotonic() - t0 < 5
    wait_released(stack)


# ---------------------------------------------------------------- finding 11: typed options

def test_typed_options_have_flags_defaults_and_validation():
    from specd.coordinator.cli import build_parser
    from specd.coordinator.config import config_from_args
    from specd.draft_worker import server as dserver

    p = build_parser()
    a = p.parse_args(["coordinator", "--drain-timeout-s", "5", "--release-timeout-s", "3", "--health-timeout-s", "1.5",
                      "--max-request-id-bytes", "64", "--max-stop-strings", "4", "--max-stop-string-bytes", "32",
                      "--max-prompt-bytes", "1000", "--send-stall-timeout-s", "9", "--policy-accept-prior", "1.0"])
    cfg = config_from_args(a)
    assert (cfg.drain_timeout_s, cfg.release_timeout_s, cfg.health_timeout_s, cfg.max_request_id_bytes,
            cfg.max_stop_strings, cfg.max_stop_string_bytes, cfg.max_prompt_bytes, cfg.send_stall_timeout_s,
            cfg.policy.accept_prior) == (5, 3, 1.5, 64, 4, 32, 1000, 9, 1.0)
    d = CoordinatorConfig()
    assert (d.drain_timeout_s, d.release_timeout_s, d.health_timeout_s) == (30.0, 10.0, 2.0)
    for bad in (["--release-timeout-s", "0"], ["--drain-timeout-s", "-1"], ["--max-stop-strings", "0"],
                ["--send-stall-timeout-s", "0"], ["--health-timeout-s", "0"]):
        with pytest.raises(ValueError):
            config_from_args(p.parse_args(["coordinator", *bad]))
    # serve forwards the drain timeout to the coordinator
    from specd.coordinator.launcher import _passthrough

    s = p.parse_args(["serve", "--target", "t.gguf", "--drain-timeout-s", "7"])
    fw = _passthrough(s)
    assert fw[fw.index("--drain-timeout-s") + 1] == "7.0"
    t = p.parse_args(["target-worker", "--target", "t.gguf", "--idle-ttl-s", "60", "--tombstone-cap", "10",
                      "--shutdown-grace-s", "1", "--max-concurrent-rpcs", "100"])
    tc = tserver.config_from_args(t)
    assert (tc.idle_ttl_s, tc.tombstone_cap, tc.shutdown_grace_s, tc.max_concurrent_rpcs) == (60, 10, 1, 100)
    assert tc.cuda_graphs  # on by default (used on the GPU only)
    assert not tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf",
                                                      "--no-cuda-graphs"])).cuda_graphs
    assert p.parse_args(["serve"]).cuda_graphs and not p.parse_args(["serve", "--no-cuda-graphs"]).cuda_graphs
    for bad in (["--idle-ttl-s", "-1"], ["--tombstone-cap", "0"], ["--shutdown-grace-s", "-1"]):
        with pytest.raises(ValueError):
            tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", *bad]))
    dc = dserver.DraftWorkerConfig(vocab=10, idle_ttl_s=-1)
    with pytest.raises(ValueError):
        dc.validate()
    dd = p.parse_args(["draft-worker", "--vocab", "10", "--idle-ttl-s", "5", "--tombstone-cap", "7"])
    assert (dd.idle_ttl_s, dd.tombstone_cap, dd.shutdown_grace_s) == (5, 7, 2.0)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_numbers_are_refused_by_every_config(value):
    """nan passes a "< 0" or "<= 0" test and inf makes a timer or a drain wait forever: every float option
    of the coordinator (timeouts, the policy), the target worker and the draft worker refuses both by name."""
    from specd.coordinator.cli import build_parser
    from specd.coordinator.config import config_from_args
    from specd.draft_worker import server as dserver

    p = build_parser()
    for flag in ("--worker-timeout-s", "--release-timeout-s", "--health-timeout-s", "--send-stall-timeout-s",
                 "--drain-timeout-s", "--health-poll-s", "--policy-gate-factor", "--policy-accept-prior",
                 "--policy-step-ratio", "--policy-time-alpha"):
        with pytest.raises(ValueError, match=flag[2:].replace("-", "_").removeprefix("policy_")):
            config_from_args(p.parse_args(["coordinator", flag, value]))
    for flag in ("--idle-ttl-s", "--shutdown-grace-s"):
        with pytest.raises(ValueError, match=flag[2:].replace("-", "_")):
            tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", flag, value]))
    for name in ("idle_ttl_s", "shutdown_grace_s", "target_watch_s"):
        with pytest.raises(ValueError, match=name if name != "target_watch_s" else "target-watch-s"):
            dserver.DraftWorkerConfig(vocab=10, **{name: float(value)}).validate()


def test_prefill_chunk_default_flag_and_validation():
    """--prefill-chunk: 2048 tokens by default (config, flag, its help), > 0, passed to the config as given."""
    from specd.coordinator.cli import build_parser

    p = build_parser()
    assert tserver.TargetWorkerConfig().prefill_chunk == 2048
    assert tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf"])).prefill_chunk == 2048
    tc = tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--prefill-chunk", "512"]))
    assert tc.prefill_chunk == 512
    for bad in ("0", "-1"):
        with pytest.raises(ValueError, match="prefill_chunk must be > 0"):
            tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--prefill-chunk", bad]))
    ap = argparse.ArgumentParser()
    tserver.add_arguments(ap)
    assert "--prefill-chunk PREFILL_CHUNK tokens per prefill forward, > 0 (default 2048)" in " ".join(ap.format_help().split())


def test_graph_flags_default_validation_and_serve_forwarding(monkeypatch):
    """--max-graphs and --slot-cache: defaults, validation on both commands, forwarded by specd serve."""
    from specd.coordinator import launcher
    from specd.coordinator.cli import build_parser

    p = build_parser()
    assert tserver.TargetWorkerConfig().max_graphs == 16
    tc = tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf"]))
    assert tc.max_graphs == 16
    tc = tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--max-graphs", "3"]))
    assert tc.max_graphs == 3
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match="max_graphs must be > 0"):
            tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--max-graphs", bad]))
    assert p.parse_args(["serve"]).max_graphs == 16
    with pytest.raises(ValueError, match="--max-graphs must be >= 1"):
        launcher.ServeConfig(target="t.gguf", drafter_gguf="", max_graphs=0).validate()
    assert tserver.TargetWorkerConfig().slot_cache == 2 and p.parse_args(["serve"]).slot_cache == 2
    tc = tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--slot-cache", "0"]))
    assert tc.slot_cache == 0
    with pytest.raises(ValueError, match="slot_cache must be >= 0"):
        tserver.config_from_args(p.parse_args(["target-worker", "--target", "t.gguf", "--slot-cache", "-1"]))
    with pytest.raises(ValueError, match="--slot-cache must be >= 0"):
        launcher.ServeConfig(target="t.gguf", drafter_gguf="", slot_cache=-1).validate()
    seen = []

    class Stop(Exception):
        pass

    def child(argv, *a, **k):
        seen.append(list(argv))
        raise Stop

    monkeypatch.setattr(launcher, "_child", child)
    with pytest.raises(Stop):
        launcher.run(p.parse_args(["serve", "--target", "t.gguf", "--drafter", "none", "--max-graphs", "5",
                                   "--slot-cache", "3"]))
    argv = seen[0]
    assert argv[0] == "target-worker" and argv[argv.index("--max-graphs") + 1] == "5"
    assert argv[argv.index("--slot-cache") + 1] == "3"


def test_release_and_reap_free_the_model_state_under_the_model_lock(stack):
    """Release, the idle reaper and a failed Prefill hand the sequence to model.release (graphs,
    device state) while holding model_lock; a call that still holds a released sequence is refused."""
    ts = stack.tservicer
    calls = []
    real = ts.model.release

    def release(st):
        calls.append((id(st), ts.model_lock.locked()))
        return real(st)

    ts.model.release = release
    try:
        with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
            t = wpbg.TargetWorkerStub(ch)
            t.Prefill(wpb.PrefillRequest(seq_id="rel-1", tokens=[5, 6, 7], capacity=20), timeout=10)
            t.Prefill(wpb.PrefillRequest(seq_id="rel-2", tokens=[5, 6, 7], capacity=20), timeout=10)
            s1 = ts.seqs["rel-1"]
            assert t.Release(wpb.ReleaseRequest(seq_id="rel-1"), timeout=5).existed
            assert s1.released and s1.st.released and calls == [(id(s1.st), True)]
            s2 = ts.seqs["rel-2"]
            assert ts.reap_idle(time.monotonic() + 10_000) == ["rel-2"]
            assert s2.st.released and calls[-1] == (id(s2.st), True)
            with pytest.raises(grpc.RpcError) as err:  # invalid tokens: the state it built is freed
                t.Prefill(wpb.PrefillRequest(seq_id="rel-3", tokens=[10**6], capacity=20), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(calls) == 3 and calls[-1][1] and "rel-3" not in ts.seqs
        ts.seqs["held"] = s1  # a call that found the sequence before its Release
        try:
            class Ctx:
                def abort(self, code, msg):
                    raise RuntimeError(code)

            with pytest.raises(RuntimeError, match="NOT_FOUND"):
                ts._verify(wpb.VerifyRequest(seq_id="held", tokens=[1]), Ctx())
        finally:
            ts.seqs.pop("held", None)
    finally:
        del ts.model.release


def test_tombstone_cap_bounds_the_tombstones(stack):
    cap0 = stack.tservicer.cfg.tombstone_cap
    stack.tservicer.cfg.tombstone_cap = 3
    try:
        with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
            t = wpbg.TargetWorkerStub(ch)
            for i in range(6):
                t.Release(wpb.ReleaseRequest(seq_id=f"tomb-{i}"), timeout=5)
        assert list(stack.tservicer.tombstones)[-3:] == ["tomb-3", "tomb-4", "tomb-5"]
        assert len(stack.tservicer.tombstones) <= 3
    finally:
        stack.tservicer.cfg.tombstone_cap = cap0


def test_target_worker_config_validates_kv_dtype_and_max_seq_len():
    with pytest.raises(ValueError, match="kv_dtype must be f16, q8_0 or f32"):
        tserver.TargetWorkerConfig(target="x.gguf", kv_dtype="q4_0").validate()
    with pytest.raises(ValueError, match="max_seq_len must be >= 0"):
        tserver.TargetWorkerConfig(target="x.gguf", max_seq_len=-1).validate()
