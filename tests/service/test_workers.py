"""The internal worker protocol directly: chain verify acceptance and limits, deferred commit, error
codes, and the drafter's ring reads."""
from __future__ import annotations

import grpc
import pytest

from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg


@pytest.fixture
def target(stack):
    with grpc.insecure_channel(f"unix://{stack.dir}/t.sock") as ch:
        yield wpbg.TargetWorkerStub(ch)


def _err(fn, *a, **k):
    with pytest.raises(grpc.RpcError) as e:
        fn(*a, timeout=30, **k)
    return e.value.code()


def test_verify_accepts_prefix_respects_limit_and_deferred_commit_matches(target, reference):
    prompt = [7, 7, 7, 1]
    ref, _ = reference(prompt, 12)
    for sid in ("w-a", "w-b"):
        r = target.Prefill(wpb.PrefillRequest(seq_id=sid, tokens=prompt, capacity=40), timeout=30)
        assert r.first_token == ref[0] and r.committed == len(prompt)
    drafts = ref[1:5] + [(ref[5] + 1) % 320]  # 4 right, then wrong
    v = target.Verify(wpb.VerifyRequest(seq_id="w-a", tokens=[ref[0]] + drafts, return_argmax=True), timeout=30)
    assert v.accepted == 4 and list(v.emitted) == ref[1:6] and v.committed == len(prompt) + 5
    assert list(v.argmax[:5]) == ref[1:6]
    # limit: accept at most 2 even though 4 match; deferred, then committed by Commit
    v = target.Verify(wpb.VerifyRequest(seq_id="w-b", tokens=[ref[0]] + drafts, max_accept=2, defer_commit=True),
                      timeout=30)
    assert v.accepted == 2 and list(v.emitted) == ref[1:4] and v.committed == len(prompt)
    assert _err(target.Verify, wpb.VerifyRequest(seq_id="w-b", tokens=[ref[3]])) == grpc.StatusCode.FAILED_PRECONDITION
    assert target.Commit(wpb.CommitRequest(seq_id="w-b", n=3), timeout=30).committed == len(prompt) + 3
    v = target.Verify(wpb.VerifyRequest(seq_id="w-b", tokens=[ref[3], ref[4], ref[5]]), timeout=30)
    assert list(v.emitted) == ref[4:7]
    for sid in ("w-a", "w-b"):
        assert target.Release(wpb.ReleaseRequest(seq_id=sid), timeout=30).existed


def test_worker_error_codes(target, stack):
    S = grpc.StatusCode
    assert _err(target.Verify, wpb.VerifyRequest(seq_id="nope", tokens=[1])) == S.NOT_FOUND
    target.Prefill(wpb.PrefillRequest(seq_id="e1", tokens=[1, 2], capacity=8), timeout=30)
    try:
        assert _err(target.Prefill, wpb.PrefillRequest(seq_id="e1", tokens=[1], capacity=8)) == S.ALREADY_EXISTS
        assert _err(target.Verify, wpb.VerifyRequest(seq_id="e1", tokens=[1] * 40)) == S.INVALID_ARGUMENT
        assert _err(target.Verify, wpb.VerifyRequest(seq_id="e1", tokens=[1] * 7)) == S.INVALID_ARGUMENT  # capacity
        assert _err(target.Verify, wpb.VerifyRequest(seq_id="e1", tokens=[10_000])) == S.INVALID_ARGUMENT
        assert _err(target.Commit, wpb.CommitRequest(seq_id="e1", n=1)) == S.FAILED_PRECONDITION
        assert _err(target.Prefill, wpb.PrefillRequest(seq_id="e2", tokens=[1] * 300, capacity=400)) == S.INVALID_ARGUMENT
    finally:
        target.Release(wpb.ReleaseRequest(seq_id="e1"), timeout=30)
    # released ids stay dead: a Prefill overtaken by its Release does not resurrect the sequence
    assert _err(target.Prefill, wpb.PrefillRequest(seq_id="e1", tokens=[1], capacity=8)) == S.CANCELLED
    assert not target.Info(wpb.InfoRequest(), timeout=30).live_sequences


def test_drafter_rejects_gaps_and_unknown_sequences(stack):
    with grpc.insecure_channel(f"unix://{stack.dir}/d.sock") as ch:
        d = wpbg.DraftWorkerStub(ch)
        assert _err(d.Propose, wpb.ProposeRequest(seq_id="x", anchor=1, max_tokens=2)) == grpc.StatusCode.FAILED_PRECONDITION
        info = d.Info(wpb.InfoRequest(), timeout=10)
        assert info.block_size == stack.drafter.block_size and info.shm_namespace_id


def test_drafter_checks_a_sequences_options_whenever_they_change(target, stack):
    """The drafter parses and checks a sequence's options once while they stay the same; a request
    that changes them is checked again (a refused one is not remembered), so valid options after a
    refused request are served and invalid ones are refused every time."""
    prompt = [7, 7, 7, 1]
    pre = target.Prefill(wpb.PrefillRequest(seq_id="opts", tokens=prompt, capacity=40), timeout=30)
    try:
        with grpc.insecure_channel(f"unix://{stack.dir}/d.sock") as ch:
            d = wpbg.DraftWorkerStub(ch)
            ok = d.Propose(wpb.ProposeRequest(seq_id="opts", start=0, new_tokens=prompt, anchor=pre.first_token,
                                              max_tokens=2, features=pre.features), timeout=30)
            assert len(ok.tokens) == 2
            too_many = wpb.ProposeRequest(seq_id="opts", start=len(prompt), anchor=pre.first_token, max_tokens=2,
                                          top_k=1000)
            for _ in range(2):
                assert _err(d.Propose, too_many) == grpc.StatusCode.INVALID_ARGUMENT
            again = d.Propose(wpb.ProposeRequest(seq_id="opts", start=len(prompt), anchor=pre.first_token,
                                                 max_tokens=2), timeout=30)
            assert list(again.tokens) == list(ok.tokens)
            bad_markov = wpb.ProposeRequest(seq_id="opts", start=len(prompt), anchor=pre.first_token, max_tokens=2,
                                            dspark_markov=9)
            assert _err(d.Propose, bad_markov) == grpc.StatusCode.INVALID_ARGUMENT
            d.Release(wpb.ReleaseRequest(seq_id="opts"), timeout=30)
    finally:
        target.Release(wpb.ReleaseRequest(seq_id="opts"), timeout=30)


def test_info_reports_memory(target, stack):
    """TargetInfo.memory carries the worker's MemoryReport (weights, per-token and per-sequence
    state at max_seq_len, fit); the numbers equal what the model allocates for one sequence."""
    m = target.Info(wpb.InfoRequest(), timeout=30).memory
    svc = stack.tservicer
    rep = svc.memory_report(measure=False)
    model, hp = svc.model, svc.model.hp
    assert m.max_seq_len == svc.max_seq_len == 256 and m.max_sequences == svc.cfg.max_sequences
    assert m.verify_width == svc.cfg.max_verify and m.kv_dtype == "F32"
    for f in ("weight_bytes", "kv_bytes_per_token", "kv_bytes_per_sequence", "recurrent_bytes_per_sequence",
              "conv_bytes_per_sequence", "verify_bytes_per_sequence", "sequence_bytes",
              "feature_ring_bytes_per_sequence", "workspace_bytes", "total_bytes", "host_feature_bytes"):
        assert getattr(m, f) == getattr(rep, f) > 0, f
    assert dict(m.weight_bytes_by_type) == rep.weight_bytes_by_type
    assert m.weight_bytes == sum(m.weight_bytes_by_type.values())
    st = model.new_sequence(256)
    assert m.kv_bytes_per_sequence == sum(k.nbytes + v.nbytes for k, v in st.kv.values())
    assert m.recurrent_bytes_per_sequence == sum(a.nbytes for a in st.ssm.values())
    assert m.conv_bytes_per_sequence == sum(a.nbytes for a in st.conv.values())
    assert m.feature_ring_bytes_per_sequence == 64 + 256 * (8 + 4 * len(model.capture_layers) * hp.n_embd)
    if m.device == "cpu":
        assert m.fits_sequences == -1 and m.device_total_bytes == 0
    else:  # a GPU worker reports the measured device memory and the fit on it
        assert m.device_total_bytes >= m.device_free_bytes > 0 and m.fits_sequences >= 0
