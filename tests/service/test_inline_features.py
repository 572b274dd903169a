"""feature_transport = "inline" (serving.md §3.1: inline bytes when the workers are not on one host),
real gRPC over Unix sockets: the target returns the rows each call committed, the coordinator
forwards them unread in the next Propose, the drafter ingests them from a private ring.

(a) streamed ids equal plain greedy (scripted drafter at every acceptance length, and real tiny
drafters in chain and DDTree mode); (b) C09: every feature row the drafter ingested equals the
target's, after mixed spec / plain steps; (c) no /dev/shm segment is created; (d) a transport
mismatch between the coordinator and either worker is a start-up error naming both sides; plus the
bounded-message rules (prompt rows cap, rows per Propose) and the shm drafter refusing inline rows.
"""
from __future__ import annotations

import glob
import os

import grpc
import numpy as np
import pytest

from specd.coordinator.config import CoordinatorConfig
from specd.coordinator.policy import PolicyConfig
from specd.draft_worker import server as dserver
from specd.draft_worker.scripted import ScriptedDrafter
from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg
from specd.target_worker.feature_inline import decode_rows, encode_rows, inline_max_rows

from .conftest import BLOCK, Stack, generate, streamed_ids, token_request


def _descends_from(pid: int, root: int) -> bool:
    """Whether process ``pid`` is ``root`` or one of its descendants (Linux /proc); segments that
    other test runs on the machine create concurrently are not this server's."""
    for _ in range(64):
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: ppid
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def _segments():
    return set(glob.glob(f"/dev/shm/specd-ft-{os.getpid()}-*"))


@pytest.fixture(scope="module")
def istack(target_gguf):
    before = _segments()
    s = Stack(target_gguf, feature_transport="inline", policy=PolicyConfig(step_ratio=0))
    s.segments_before = before
    yield s
    s.stop()


def prompts_for(rng, n, vocab):
    return [[int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 20)))] for _ in range(n)]


def test_encode_decode_roundtrip_little_endian():
    rows = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    start, n, w, data = encode_rows(5, rows)
    assert (start, n, w, len(data)) == (5, 3, 4, 48)
    assert data == rows.astype("<f4").tobytes()
    assert np.frombuffer(data[4:8], "<f4")[0] == rows[0, 1]
    np.testing.assert_array_equal(decode_rows(n, w, data), rows)
    with pytest.raises(ValueError):
        decode_rows(2, 4, data)
    assert inline_max_rows(256 << 20, 256) == ((256 << 20) - (1 << 20)) // 1024


def test_info_reports_inline(istack):
    with grpc.insecure_channel(f"unix://{istack.dir}/t.sock") as ch:
        ti = wpbg.TargetWorkerStub(ch).Info(wpb.InfoRequest(), timeout=10)
    with grpc.insecure_channel(f"unix://{istack.dir}/d.sock") as ch:
        di = wpbg.DraftWorkerStub(ch).Info(wpb.InfoRequest(), timeout=10)
    assert ti.feature_transport == di.feature_transport == "inline"
    assert ti.inline_max_rows == inline_max_rows(istack.tservicer.cfg.max_message_bytes, ti.feature_width)


@pytest.mark.parametrize("plan", [None, -1] + list(range(BLOCK + 1)))
def test_a_every_acceptance_length_equals_plain_greedy(istack, reference, rng, plan):
    vocab = istack.tservicer.model.hp.n_vocab
    for prompt in prompts_for(rng, 3, vocab):
        max_tokens = int(rng.integers(1, 3 * BLOCK + 3))
        ref, _ = reference(prompt, max_tokens + BLOCK + 2)
        istack.drafter.continuations[tuple(prompt)] = ref
        istack.drafter.plan = plan
        chunks, done = generate(istack.stub, token_request(prompt, max_tokens, ignore_eos=True))
        assert streamed_ids(chunks) == ref[:max_tokens], f"plan {plan} prompt {prompt}"
        sp = done.speculation
        if plan is None and max_tokens > 2:
            assert sp.num_accepted_tokens == sp.num_draft_tokens > 0


def test_a_random_acceptance_and_caps_equal_plain_greedy(istack, reference, rng):
    vocab = istack.tservicer.model.hp.n_vocab
    for prompt in prompts_for(rng, 4, vocab):
        choices = [None, -1] + list(range(BLOCK + 1))
        seq = [choices[i] for i in rng.integers(0, len(choices), size=200)]
        istack.drafter.plan = lambda p, step, seq=seq: seq[step]
        max_tokens = int(rng.integers(8, 40))
        ref, _ = reference(prompt, max_tokens + BLOCK + 2)
        istack.drafter.continuations[tuple(prompt)] = ref
        spec = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, max_draft_tokens=int(rng.integers(1, BLOCK + 1)))
        chunks, _ = generate(istack.stub, token_request(prompt, max_tokens, ignore_eos=True, speculation=spec))
        assert streamed_ids(chunks) == ref[:max_tokens]


def test_b_c09_drafter_features_equal_target_after_spec_and_plain_mix(istack, reference, rng):
    """Spec steps accepting >= 2 drafts, no-proposal steps, and whole plain (mode OFF-like policy
    burst) stretches: each ingested row equals the plain run's row for its position (bitwise)."""
    vocab = istack.tservicer.model.hp.n_vocab
    # a policy that runs plain bursts, so the drafter catches up over several steps' rows at once
    coord = istack.coordinator(policy=PolicyConfig(step_ratio=3.0, gate_factor=1.0, burst_len=3, max_burst_len=3,
                                                   accept_prior=0.0, measure_times=False))
    for i, prompt in enumerate(prompts_for(rng, 4, vocab)):
        seq = [[-1, 2, 3, None, 0][j] for j in rng.integers(0, 5, size=200)]
        istack.drafter.plan = lambda p, step, seq=seq: seq[step]
        max_tokens = 30
        ref, feats = reference(prompt, max_tokens + BLOCK + 2)
        istack.drafter.continuations[tuple(prompt)] = ref
        req = token_request(prompt, max_tokens, ignore_eos=True)
        req.request_id = f"ic09-{i}-{rng.integers(1 << 30)}"
        stub = istack.stub if i % 2 == 0 else coord
        chunks, done = generate(stub, req)
        assert streamed_ids(chunks) == ref[:max_tokens]
        seq_ids = [s for s in istack.drafter.seen if s.startswith(req.request_id + "#")]
        assert len(seq_ids) == 1
        seen = istack.drafter.seen[seq_ids[0]]
        full = list(prompt) + ref
        assert sorted(seen) == list(range(len(seen))) and len(seen) >= len(prompt)
        for pos, (tok, row) in seen.items():
            assert tok == full[pos]
            np.testing.assert_array_equal(row, feats[pos], err_msg=f"feature row {pos}")
        if i % 2 == 1:
            assert done.speculation.num_plain_steps > 0, "the burst policy ran no plain step"


def test_b_unary_worker_calls_forward_the_same_rows(istack, reference, rng):
    """--no-worker-streams (one unary call per step) with inline rows: the same tokens as plain greedy
    and the same feature rows at the drafter as the stream path (C09)."""
    vocab = istack.tservicer.model.hp.n_vocab
    coord = istack.coordinator(policy=PolicyConfig(step_ratio=0), worker_streams=False)
    for i, prompt in enumerate(prompts_for(rng, 2, vocab)):
        seq = [[-1, 2, None, 0][j] for j in rng.integers(0, 4, size=200)]
        istack.drafter.plan = lambda p, step, seq=seq: seq[step]
        ref, feats = reference(prompt, 24 + BLOCK + 2)
        istack.drafter.continuations[tuple(prompt)] = ref
        req = token_request(prompt, 24, ignore_eos=True)
        req.request_id = f"iunary-{i}-{rng.integers(1 << 30)}"
        chunks, _ = generate(coord, req)
        assert streamed_ids(chunks) == ref[:24]
        seen = istack.drafter.seen[next(s for s in istack.drafter.seen if s.startswith(req.request_id + "#"))]
        for pos, (tok, row) in seen.items():
            np.testing.assert_array_equal(row, feats[pos], err_msg=f"feature row {pos}")


def test_a_real_tiny_drafters_chain_and_tree(istack, target_gguf, reference, tmp_path_factory):
    from specd.draft_worker.engine import open_model_drafter

    from .test_drafters import FAMILIES, MAX_TOKENS, PROMPTS, make_gguf

    tmp = tmp_path_factory.mktemp("inline-drafters")
    for fam in FAMILIES:
        d = open_model_drafter(make_gguf(tmp, fam), target_gguf)
        svc = dserver.DraftServicer(d, feature_transport="inline")
        addr = f"unix://{istack.dir}/d-inline-{fam}.sock"
        srv, _ = dserver.start_server(svc, addr, 8)
        try:
            stub = istack.coordinator(drafter_override=addr)
            for prompt in PROMPTS:
                for extra in ({}, {"draft_mode": gpb.DRAFT_MODE_TREE, "tree_budget": 5}):
                    sp = gpb.SpeculationParams(mode=gpb.SPECULATION_MODE_FORCE, **extra)
                    chunks, done = generate(stub, token_request(prompt, MAX_TOKENS, ignore_eos=True, speculation=sp))
                    assert streamed_ids(chunks) == reference(prompt, MAX_TOKENS)[0], (fam, prompt, extra)
                    assert done.speculation.num_drafts > 0
            assert d.live() == []
        finally:
            srv.stop(0).wait()
            svc.close()


def test_c_no_shared_memory_segment(istack, reference):
    prompt = [3, 1, 4, 1, 5, 9]
    ref, _ = reference(prompt, 12)
    istack.drafter.continuations[tuple(prompt)] = ref
    istack.drafter.plan = 2
    generate(istack.stub, token_request(prompt, 12, ignore_eos=True))
    assert _segments() == istack.segments_before
    assert istack.tservicer.features.live() == []
    with grpc.insecure_channel(f"unix://{istack.dir}/t.sock") as ch:
        assert wpbg.TargetWorkerStub(ch).Info(wpb.InfoRequest(), timeout=10).live_shm_segments == 0


def test_d_mismatched_transport_is_a_startup_error(istack, stack):
    # inline workers, shm coordinator
    with pytest.raises(RuntimeError, match="feature_transport.*'shm'.*target worker.*'inline'"):
        istack.coordinator(feature_transport="shm")
    # shm workers, inline coordinator
    with pytest.raises(RuntimeError, match="feature_transport.*'inline'.*target worker.*'shm'"):
        stack.coordinator(feature_transport="inline")
    # inline target, shm drafter
    svc = dserver.DraftServicer(ScriptedDrafter(BLOCK, istack.tservicer.model.hp.n_vocab))
    addr = f"unix://{istack.dir}/d-shm.sock"
    srv, _ = dserver.start_server(svc, addr, 8)
    try:
        with pytest.raises(RuntimeError, match="drafter worker.*'shm'"):
            istack.coordinator(drafter_override=addr)
    finally:
        srv.stop(0).wait()
        svc.close()
    with pytest.raises(ValueError, match="feature_transport"):
        CoordinatorConfig(feature_transport="rdma").validate()
    from specd.target_worker.server import TargetWorkerConfig

    with pytest.raises(ValueError, match="feature_transport"):
        TargetWorkerConfig(target="x.gguf", feature_transport="rdma").validate()
    with pytest.raises(ValueError, match="feature_transport"):
        dserver.DraftWorkerConfig(vocab=8, feature_transport="rdma").validate()


def test_d_handle_of_the_other_kind_refused_by_the_drafter(istack, stack):
    """A Propose whose handle kind does not match the drafter's transport: FAILED_PRECONDITION."""
    with grpc.insecure_channel(f"unix://{istack.dir}/t.sock") as ch:
        pre = wpbg.TargetWorkerStub(ch).Prefill(wpb.PrefillRequest(seq_id="kind-x", tokens=[1, 2], capacity=8), timeout=10)
    try:
        assert pre.features.kind == "inline" and pre.rows.n == 2 and pre.rows.start == 0
        with grpc.insecure_channel(f"unix://{stack.dir}/d.sock") as ch:  # the shm drafter
            with pytest.raises(grpc.RpcError) as e:
                wpbg.DraftWorkerStub(ch).Propose(wpb.ProposeRequest(seq_id="kind-x", start=0, new_tokens=[1, 2],
                                                                    anchor=pre.first_token, max_tokens=2,
                                                                    features=pre.features, rows=[pre.rows]), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "feature_transport" in e.value.details()
    finally:
        with grpc.insecure_channel(f"unix://{istack.dir}/t.sock") as ch:
            wpbg.TargetWorkerStub(ch).Release(wpb.ReleaseRequest(seq_id="kind-x"), timeout=10)


def test_bounded_messages(istack, reference):
    """Prompt rows above inline_max_rows are refused at Prefill; with a small cap the coordinator
    makes steps speculative so no Propose carries more than the cap and the output stays exact."""
    svc = istack.tservicer
    old = svc.inline_max_rows
    svc.inline_max_rows = 20
    ingested = []
    orig_ingest = istack.drafter.ingest

    def spy(seq_id, start, tokens, feats):
        ingested.append(len(tokens))
        return orig_ingest(seq_id, start, tokens, feats)

    istack.drafter.ingest = spy
    try:
        stub = istack.coordinator(policy=PolicyConfig(step_ratio=3.0, gate_factor=1.0, burst_len=50,
                                                      max_burst_len=50, accept_prior=0.0, measure_times=False))
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, token_request(list(range(1, 22)), 4, ignore_eos=True))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inline" in e.value.details()
        prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
        ref, _ = reference(prompt, 60 + BLOCK + 2)
        istack.drafter.continuations[tuple(prompt)] = ref
        istack.drafter.plan = 0  # nothing accepted: the policy wants long plain bursts
        chunks, done = generate(stub, token_request(prompt, 60, ignore_eos=True))
        assert streamed_ids(chunks) == ref[:60]
        assert ingested and max(ingested) <= 20, ingested
        assert done.speculation.num_drafts >= 60 // 20
        # nothing is accepted, so a chunk of several tokens is a plain run: runs happened, cut to the room
        # the cap leaves before the next Propose
        assert max(len(c.token_ids) for c in chunks) > 1
    finally:
        svc.inline_max_rows = old
        del istack.drafter.ingest


def test_serve_cli_inline_and_mismatch_processes(target_gguf, reference, tmp_path):
    """Real processes: `specd serve --feature-transport inline` is lossless and creates no segment;
    a coordinator process whose flag differs from its workers' exits at start-up naming the flag."""
    import json
    import subprocess

    from .conftest import CAPTURE
    from .test_processes import CLI, _start, _stop

    before = set(glob.glob("/dev/shm/specd-ft-*"))
    prompt = [9, 8, 7, 6]
    ref, _ = reference(prompt, 30)
    cont = tmp_path / "oracle.jsonl"
    cont.write_text(json.dumps({"prompt": prompt, "continuation": ref}) + "\n")
    sock = f"unix://{tmp_path}/c.sock"
    serve = _start(["serve", "--target", target_gguf, "--scripted-block", "4", "--listen", sock, "--metrics-port", "0",
                    "--scripted-continuations", str(cont), "--policy-step-ratio", "0", "--feature-transport", "inline",
                    "--capture-layers", ",".join(map(str, CAPTURE)), "--max-seq-len", "128", "--kv-dtype", "f32",
                    "--runtime-dir", str(tmp_path / "rt")])
    try:
        out = subprocess.run(CLI + ["generate", "--server", sock, "--token-ids", "9,8,7,6", "--max-tokens", "10",
                                    "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        done = json.loads(out.stdout)
        assert [int(t) for t in done["output_ids"]] == ref[:10]
        assert int(done["speculation"]["num_accepted_tokens"]) == 7
        new = set(glob.glob("/dev/shm/specd-ft-*")) - before
        assert {f for f in new if _descends_from(int(f.split("-")[-2]), serve.pid)} == set()
    finally:
        assert _stop(serve) == 0
    # mismatch across processes: inline target worker, shm (default) drafter and coordinator
    tsock, dsock = f"unix://{tmp_path}/t2.sock", f"unix://{tmp_path}/d2.sock"
    t = _start(["target-worker", "--target", target_gguf, "--listen", tsock, "--capture-layers", "0,2",
                "--max-seq-len", "64", "--kv-dtype", "f32", "--feature-transport", "inline"])
    d = _start(["draft-worker", "--listen", dsock, "--vocab", "320", "--scripted-block", "4"])
    try:
        c = subprocess.run(CLI + ["coordinator", "--target", tsock, "--drafter", dsock, "--listen",
                                  f"unix://{tmp_path}/c2.sock", "--metrics-port", "0", "--worker-timeout-s", "20"],
                           capture_output=True, text=True, timeout=120)
        assert c.returncode != 0
        assert "feature_transport" in c.stderr and "'inline'" in c.stderr and "--feature-transport" in c.stderr, \
            c.stderr[-2000:]
        c = subprocess.run(CLI + ["coordinator", "--target", tsock, "--drafter", dsock, "--listen",
                                  f"unix://{tmp_path}/c3.sock", "--metrics-port", "0", "--feature-transport", "inline",
                                  "--worker-timeout-s", "20"], capture_output=True, text=True, timeout=120)
        assert c.returncode != 0 and "drafter worker" in c.stderr and "'shm'" in c.stderr, c.stderr[-2000:]
    finally:
        _stop(t)
        _stop(d)
    bad = subprocess.run(CLI + ["target-worker", "--target", target_gguf, "--feature-transport", "rdma"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "feature-transport" in bad.stderr
