"""Serving behaviour: concurrent isolation, cancellation (C25), adaptive policy switches, admission
errors and status codes, deadlines, health, reflection, keepalive during a long prefill (C28)."""
from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np
import pytest

from specd.coordinator.policy import PolicyConfig
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg

from .conftest import BLOCK, generate, streamed_ids, token_request


def worker_live(stack):
    with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
        t = wpbg.TargetWorkerStub(ch).Info(wpb.InfoRequest(), timeout=5)
    with grpc.insecure_channel(f"unix://{stack.dir}/d.sock") as ch:
        d = wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest(), timeout=5)
    return list(t.live_sequences), int(t.live_shm_segments), list(d.live_sequences)


def wait_released(stack, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        live = worker_live(stack)
        if live == ([], 0, []):
            return
        time.sleep(0.05)
    raise AssertionError(f"sequences still live: {live}")


def test_eight_concurrent_streams_are_isolated(stack, reference, rng):
    vocab = stack.tservicer.model.hp.n_vocab
    prompts = [[int(t) for t in rng.integers(0, vocab, size=int(rng.integers(2, 15)))] for _ in range(8)]
    refs = [reference(p, 40 + BLOCK)[0] for p in prompts]
    for p, r in zip(prompts, refs):
        stack.drafter.continuations[tuple(p)] = r
    plans = {tuple(p): i % (BLOCK + 2) - 1 for i, p in enumerate(prompts)}  # -1 .. BLOCK
    stack.drafter.plan = lambda p, step: plans.get(p, 0)
    results = [None] * 8

    def run(i):
        results[i] = generate(stack.stub, token_request(prompts[i], 40, ignore_eos=True), timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(8):
        assert results[i] is not None
        assert streamed_ids(results[i][0]) == refs[i][:40], f"stream {i}"
    wait_released(stack)


def test_c25_cancel_releases_both_workers_and_next_request_is_clean(stack, reference):
    prompt = [8, 6, 7, 5, 3, 0, 9]
    ref, _ = reference(prompt, 200 + BLOCK)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 1
    call = stack.stub.Generate(token_request(prompt, 200, ignore_eos=True), timeout=60)
    got = []
    for r in call:
        got.extend(r.chunk.token_ids)
        if len(got) >= 5:
            break
    live = worker_live(stack)
    assert len(live[0]) == 1 and live[1] == 1 and len(live[2]) == 1  # mid-stream: held on both workers
    call.cancel()
    other = [1, 2, 3]
    oref, _ = reference(other, 20)
    stack.drafter.continuations[tuple(other)] = oref
    chunks, done = generate(stack.stub, token_request(other, 12, ignore_eos=True))
    assert streamed_ids(chunks) == oref[:12]
    wait_released(stack)


class _Errors(logging.Handler):
    """Collects ERROR records of the gRPC server ("Exception calling application": a worker raised)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        logging.getLogger("grpc").addHandler(self)
        logging.getLogger("grpc._server").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("grpc").removeHandler(self)
        logging.getLogger("grpc._server").removeHandler(self)
        assert not self.records, [r.getMessage() + str(r.exc_info) for r in self.records]


def test_c25_cancel_during_prefill_releases_everything(stack):
    """The client goes away while the target is still in Prefill: the coordinator's Release overtakes
    the Prefill; the ring must stay mapped until the Prefill ends (no worker exception), and the
    worker must free the sequence (and its shared memory) when the Prefill ends."""
    slow = stack.tservicer.model.prefill
    entered = threading.Event()

    def prefill(*a, **k):
        entered.set()
        time.sleep(0.5)
        return slow(*a, **k)

    stack.tservicer.model.prefill = prefill
    try:
        with _Errors():
            call = stack.stub.Generate(token_request([60, 61, 62], 50, ignore_eos=True), timeout=30)
            assert entered.wait(10)
            call.cancel()
            time.sleep(0.8)
            wait_released(stack)
    finally:
        stack.tservicer.model.prefill = slow
    wait_released(stack)


def test_release_stops_a_chunked_prefill_between_chunks(stack):
    """Release of a sequence whose (chunked) Prefill runs: the Prefill stops at the next chunk
    boundary, answers CANCELLED, frees the ring, and nothing raises in the worker."""
    model = stack.tservicer.model
    slow, chunk0 = model.verify, model.prefill_chunk
    calls = []
    entered = threading.Event()

    def verify(*a, **k):
        calls.append(1)
        entered.set()
        time.sleep(0.03)
        return slow(*a, **k)

    model.verify, model.prefill_chunk = verify, 1
    result = {}
    try:
        with _Errors(), grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
            t = wpbg.TargetWorkerStub(ch)

            def run():
                try:
                    t.Prefill(wpb.PrefillRequest(seq_id="chunked-1", tokens=list(range(1, 60)), capacity=100), timeout=30)
                    result["code"] = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    result["code"] = exc.code()

            th = threading.Thread(target=run)
            th.start()
            assert entered.wait(10)
            assert t.Release(wpb.ReleaseRequest(seq_id="chunked-1"), timeout=10).existed
            th.join(30)
    finally:
        model.verify, model.prefill_chunk = slow, chunk0
    assert result["code"] == grpc.StatusCode.CANCELLED
    assert len(calls) < 50
    wait_released(stack)


def test_policy_switches_to_plain_when_drafts_wrong_and_back_when_right(stack, reference):
    stub = stack.coordinator(policy=PolicyConfig(step_ratio=1.9, burst_len=4, max_burst_len=8, measure_times=False))
    prompt = [21, 22, 23]
    ref, _ = reference(prompt, 120)
    stack.drafter.continuations[tuple(prompt)] = ref
    switch_at = 4  # drafter calls 0..3 all wrong (the first, then 3 failed probes), then all right
    stack.drafter.plan = lambda p, step: 0 if step < switch_at else None
    req = token_request(prompt, 100, ignore_eos=True)
    req.request_id = "policy-switch"
    chunks, done = generate(stub, req)
    assert streamed_ids(chunks) == ref[:100]
    # C09 across bursts: the drafter was not called during plain bursts and caught up from the ring
    _, feats = reference(prompt, 120)
    seen = next(v for k, v in stack.drafter.seen.items() if k.startswith("policy-switch#"))
    assert sorted(seen) == list(range(len(seen))) and len(seen) > len(prompt) + 30
    for pos, (tok, row) in seen.items():
        assert tok == (prompt + ref)[pos]
        np.testing.assert_array_equal(row, feats[pos])
    sw = [(s.to_speculative, s.reason) for s in done.speculation.policy_switches]
    assert sw[0] == (False, "gate")  # first all-wrong spec step trips the gate (0 < 0.8 * 0.9)
    assert (True, "probe") in sw
    assert sw[-1] == (True, "probe")  # ends speculating once the drafts are right
    assert done.speculation.num_plain_steps >= 4 + 8
    tail = [c.accepted_in_step for c in chunks[-3:]]
    assert max(tail) > 0
    # bursts grow while probes fail: 4, 8, 8 (capped)
    assert sum(1 for s in sw if s == (False, "gate")) >= 3


def test_policy_stays_speculative_when_drafts_right(stack, reference):
    stub = stack.coordinator(policy=PolicyConfig(step_ratio=1.9, measure_times=False))
    prompt = [31, 32]
    ref, _ = reference(prompt, 60)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = None
    chunks, done = generate(stub, token_request(prompt, 50, ignore_eos=True))
    assert streamed_ids(chunks) == ref[:50]
    assert not done.speculation.policy_switches and done.speculation.num_plain_steps <= 1


def _code(stub, req, timeout=30):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, req, timeout=timeout)
    return e.value.code(), e.value.details()


@pytest.mark.parametrize("mutate,code", [
    (lambda r: r.sampling.__setattr__("temperature", 0.7), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.sampling.__setattr__("top_p", 0.9), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.stopping.__setattr__("max_tokens", 0), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.stopping.__setattr__("max_tokens", 10_000), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.tokenized.input_ids.append(10_000), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.tokenized.ClearField("input_ids"), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.ClearField("tokenized"), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.stopping.stop_token_ids.append(-1), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: (r.speculation.__setattr__("mode", gpb.SPECULATION_MODE_FORCE),
                r.speculation.__setattr__("max_draft_tokens", 0)), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_invalid_requests_are_rejected_and_service_keeps_serving(stack, mutate, code):
    req = token_request([1, 2, 3], 4)
    mutate(req)
    got, details = _code(stack.stub, req)
    assert got == code, details
    chunks, done = generate(stack.stub, token_request([1, 2, 3], 3))
    assert done.usage.completion_tokens == len(streamed_ids(chunks))


def test_target_full_is_resource_exhausted(stack):
    """The target's max_sequences reached: Generate fails with RESOURCE_EXHAUSTED (retryable) and the
    service keeps serving once a slot frees."""
    with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
        t = wpbg.TargetWorkerStub(ch)
        saved = stack.tservicer.cfg.max_sequences
        stack.tservicer.cfg.max_sequences = 1
        try:
            t.Prefill(wpb.PrefillRequest(seq_id="hog", tokens=[1, 2], capacity=8), timeout=30)
            got, details = _code(stack.stub, token_request([1, 2, 3], 4))
            assert got == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            t.Release(wpb.ReleaseRequest(seq_id="hog"), timeout=30)
            chunks, done = generate(stack.stub, token_request([1, 2, 3], 4))
            assert done.usage.completion_tokens == len(streamed_ids(chunks))
        finally:
            stack.tservicer.cfg.max_sequences = saved
    wait_released(stack)


def test_temperature_zero_set_explicitly_is_greedy(stack, reference):
    ref, _ = reference([4, 5], 10)
    req = token_request([4, 5], 5, ignore_eos=True)
    req.sampling.temperature = 0.0
    chunks, _ = generate(stack.stub, req)
    assert streamed_ids(chunks) == ref[:5]


def test_abort_ends_stream_with_abort_and_releases(stack, reference):
    prompt = [70, 71, 72]
    ref, _ = reference(prompt, 300)
    stack.drafter.continuations[tuple(prompt)] = ref
    stack.drafter.plan = 1
    req = token_request(prompt, 250, ignore_eos=True)
    req.request_id = "to-abort"
    chunks, done = [], None
    for r in stack.stub.Generate(req, timeout=60):
        if r.HasField("chunk"):
            chunks.append(r.chunk)
            if len(chunks) == 3:
                resp = stack.stub.Abort(gpb.AbortRequest(request_ids=["to-abort", "unknown"]), timeout=10)
                assert list(resp.aborted) == ["to-abort"]
        else:
            done = r.complete
    assert done is not None and done.finish_reason == "abort" and done.finish == gpb.FINISH_REASON_ABORT
    sent = streamed_ids(chunks)
    assert sent == ref[: len(sent)] and len(sent) < 250 and done.usage.completion_tokens == len(sent)
    wait_released(stack)


def test_duplicate_live_request_id_and_deadline(stack, reference):
    prompt = [40, 41]
    stack.drafter.plan = 0
    req = token_request(prompt, 200, ignore_eos=True)
    req.request_id = "dup"
    call = stack.stub.Generate(req, timeout=60)
    next(iter(call))
    got, _ = _code(stack.stub, req)
    assert got == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    wait_released(stack)
    # a deadline that expires mid-generation ends the stream with DEADLINE_EXCEEDED and frees everything
    slow = stack.tservicer.model.verify

    def verify(*a, **k):
        time.sleep(0.05)
        return slow(*a, **k)

    stack.tservicer.model.verify = verify
    try:
        got, _ = _code(stack.stub, token_request(prompt, 200, ignore_eos=True), timeout=0.5)
    finally:
        stack.tservicer.model.verify = slow
    assert got == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_released(stack)


def test_model_info_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    info = stack.stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=5)
    assert info.vocab_size == stack.tservicer.model.hp.n_vocab and info.max_draft_tokens == BLOCK
    assert info.has_tokenizer and info.drafter_name == "scripted"
    rep = stack.tservicer.memory_report(measure=False)
    assert info.target_weight_bytes == rep.weight_bytes > 0 and info.target_sequence_bytes == rep.sequence_bytes > 0
    if rep.device == "cpu":
        assert not info.HasField("target_fits_sequences")  # unknown on a CPU
    else:
        assert info.target_fits_sequences >= 0  # measured at connect time
    assert info.drafter_weight_bytes == 0  # the scripted drafter reports no memory
    ch = stack.coords[0][2]
    h = health_pb2_grpc.HealthStub(ch)
    for name in ("", "specd.v1.SpecDecode"):
        assert h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    r = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert "specd.v1.SpecDecode" in names and "grpc.health.v1.Health" in names


def test_c28_client_keepalive_pings_during_long_prefill(stack, reference):
    """C28 scaled down in time: a client pings every second (keepalive_time 1 s, also without calls)
    while a prefill takes 5 s. A coordinator configured to accept pings every 0.5 s (the shipped
    default is 5 s for 10 s clients) completes the request; the control with gRPC's default 300 s
    interval (and one strike allowed, for timing margin) answers GOAWAY too_many_pings, which shows the
    test exercises the ping policy."""
    from specd.protos.v1 import generate_pb2_grpc as gpbg

    slow = stack.tservicer.model.new_sequence  # runs outside the model lock: both prefills wait at once

    def prefill(*a, **k):
        time.sleep(5.0)
        return slow(*a, **k)

    ok = stack.coordinator(keepalive_min_ping_interval_ms=500)
    bad = stack.coordinator(keepalive_min_ping_interval_ms=300_000, max_ping_strikes=1)
    opts = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    ref, _ = reference([50, 51], 10)
    stack.tservicer.model.new_sequence = prefill
    results = {}

    def run(name, listen):
        with grpc.insecure_channel(listen, options=opts) as ch:
            try:
                chunks, _ = generate(gpbg.SpecDecodeStub(ch), token_request([50, 51], 4, ignore_eos=True), timeout=30)
                results[name] = streamed_ids(chunks)
            except grpc.RpcError as exc:
                results[name] = (exc.code(), exc.details())

    try:
        threads = [threading.Thread(target=run, args=(n, stack.coords[-2 + i][0].cfg.listen))
                   for i, n in enumerate(("ok", "bad"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        stack.tservicer.model.new_sequence = slow
    del ok, bad
    assert results["ok"] == ref[:4]
    assert results["bad"][0] == grpc.StatusCode.UNAVAILABLE and "ping" in results["bad"][1].lower(), results["bad"]
    wait_released(stack)


def test_readiness_follows_workers_and_dead_drafter_is_unavailable(stack):
    """Readiness (health of "specd.v1.SpecDecode") is SERVING only while both workers are; a request
    whose drafter is gone ends with UNAVAILABLE; the sequence is still released on the target."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specd.draft_worker import server as dserver
    from specd.draft_worker.scripted import ScriptedDrafter

    ds = dserver.DraftServicer(ScriptedDrafter(BLOCK, stack.tservicer.model.hp.n_vocab))
    dsrv, _ = dserver.start_server(ds, f"unix://{stack.dir}/d2.sock", 4)
    try:
        stub = stack.coordinator(drafter_override=f"unix://{stack.dir}/d2.sock", health_poll_s=0.1)
        ch = stack.coords[-1][2]
        h = health_pb2_grpc.HealthStub(ch)
        ready = lambda: h.Check(health_pb2.HealthCheckRequest(service="specd.v1.SpecDecode"), timeout=5).status  # noqa: E731
        assert ready() == health_pb2.HealthCheckResponse.SERVING
        dsrv.stop(0).wait()
        end = time.monotonic() + 10
        while ready() != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < end:
            time.sleep(0.05)
        assert ready() == health_pb2.HealthCheckResponse.NOT_SERVING
        got, details = _code(stub, token_request([1, 2, 3], 8, ignore_eos=True))
        assert got == grpc.StatusCode.UNAVAILABLE, details
        assert h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        dsrv.stop(0).wait()
        ds.close()
    end = time.monotonic() + 10  # the release runs after the reply, behind the dead drafter's release retries
    while (live := worker_live(stack))[:2] != ([], 0) and time.monotonic() < end:
        time.sleep(0.05)
    assert live[0] == [] and live[1] == 0


def test_metrics_agree_with_responses(stack, reference):
    """Counters equal the sums of what the responses reported (usage, drafts, accepted, per position)."""
    stub = stack.coordinator()
    coord = stack.coords[-1][0]
    prompts = [[81, 82], [83, 84, 85]]
    plans = {tuple(prompts[0]): None, tuple(prompts[1]): 2}
    stack.drafter.plan = lambda p, step: plans.get(p, 0)
    dones, n_chunks = [], 0
    for p in prompts:
        ref, _ = reference(p, 40)
        stack.drafter.continuations[tuple(p)] = ref
        chunks, done = generate(stub, token_request(p, 25, ignore_eos=True))
        dones.append(done)
        n_chunks += len(chunks)
    reg = coord.metrics.registry
    lab = {"model": "condgen.gguf", "drafter": "scripted"}
    val = lambda name, **kw: reg.get_sample_value(name, {**lab, **kw}) or 0.0  # noqa: E731
    assert val("specd_requests_total", finish_reason="length", code="OK") == 2
    assert val("specd_generation_tokens_total") == sum(d.usage.completion_tokens for d in dones) == 50
    assert val("specd_prompt_tokens_total") == 5
    assert val("specd_spec_drafts_total") == sum(d.speculation.num_drafts for d in dones)
    assert val("specd_spec_draft_tokens_total") == sum(d.speculation.num_draft_tokens for d in dones)
    assert val("specd_spec_accepted_tokens_total") == sum(d.speculation.num_accepted_tokens for d in dones)
    for i in range(BLOCK):
        per = sum(d.speculation.accepted_per_position[i] for d in dones if i < len(d.speculation.accepted_per_position))
        assert val("specd_spec_accepted_tokens_per_position_total", position=str(i)) == per
    assert val("specd_requests_running") == 0
    # step and chunk series are recorded off the step's critical path (event loop callbacks), all
    # before the request's stream ends
    assert val("specd_request_ttft_seconds_count") == 2
    assert val("specd_request_inter_chunk_latency_seconds_count") == n_chunks - 2
    steps = sum(d.timing.steps for d in dones)
    assert val("specd_step_seconds_count", phase="verify") == val("specd_loop_overhead_seconds_count") == steps
    assert val("specd_step_seconds_count", phase="draft") == val("specd_spec_draft_length_count") == \
        sum(d.speculation.num_drafts for d in dones)


def test_proto_sources_ship_with_the_stubs():
    """The stubs are generated at build time from protos/; the installed .proto copies must equal the
    repository's (a stale install would fail here)."""
    import pathlib

    import specd.protos.v1 as pv

    repo = pathlib.Path(__file__).resolve().parents[2] / "protos" / "specd" / "v1"
    installed = pathlib.Path(pv.__file__).parent
    for src in repo.glob("*.proto"):
        assert (installed / src.name).read_text() == src.read_text(), f"{src.name} is stale: rebuild specd"
