"""Real processes: `specd serve` (three processes on Unix sockets; the hot path over the workers' IPC
stream sockets) answering `specd generate`, and shared-memory segments and IPC stream sockets removed
when a worker is stopped by SIGTERM while holding sequences."""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from specd.protos.v1 import generate_pb2 as gpb
from specd.protos.v1 import generate_pb2_grpc as gpbg
from specd.protos.v1 import worker_pb2 as wpb
from specd.protos.v1 import worker_pb2_grpc as wpbg

from .conftest import CAPTURE

CLI = [sys.executable, "-m", "specd.coordinator.cli"]


def _leaked_segments(before: set) -> list[str]:
    """Feature-ring segments created since ``before`` whose owner process (the pid in the name,
    specd-ft-<pid>-<n>) is gone: a leak. Segments of live processes (other tests running on the
    same machine) are not ours to judge."""
    leaked = []
    for seg in set(glob.glob("/dev/shm/specd-ft-*")) - before:
        pid = int(os.path.basename(seg).split("-")[2])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            leaked.append(seg)
        except PermissionError:
            pass
    return leaked


def _start(argv, timeout=120, new_session=False):
    p = subprocess.Popen(CLI + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=new_session)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline()
        if line.startswith("READY"):
            return p
        if not line and p.poll() is not None:
            raise AssertionError(f"{argv[0]} exited {p.returncode}: {p.stderr.read()[-3000:]}")
    p.kill()
    raise AssertionError(f"{argv[0]} not ready")


def _stop(p, timeout=30):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise AssertionError("did not stop on SIGTERM")
    return p.returncode


def test_serve_and_generate_cli(target_gguf, reference, tmp_path):
    """`specd serve` with the oracle scripted drafter (continuations from a JSONL file): the first
    request is all-accepted (AL = 5 with block 4), the second (unknown prompt) all-rejected; both lossless."""
    sock = f"unix://{tmp_path}/c.sock"
    before = set(glob.glob("/dev/shm/specd-ft-*"))
    ref, _ = reference([9, 8, 7, 6], 30)
    cont = tmp_path / "oracle.jsonl"
    cont.write_text(json.dumps({"prompt": [9, 8, 7, 6], "continuation": ref}) + "\n")
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        mport = so.getsockname()[1]
    serve = _start(["serve", "--target", target_gguf, "--scripted-block", "4", "--listen", sock,
                    "--metrics-port", str(mport), "--metrics-addr", "127.0.0.1",
                    "--scripted-continuations", str(cont), "--policy-step-ratio", "0",
                    "--capture-layers", ",".join(map(str, CAPTURE)), "--max-seq-len", "128", "--kv-dtype", "f32",
                    "--runtime-dir", str(tmp_path / "rt")], new_session=True)  # its own group: Ctrl-C below
    try:
        with grpc.insecure_channel(sock) as ch:  # the hot path runs over both workers' IPC stream sockets
            info = gpbg.SpecDecodeStub(ch).GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
        assert (info.target_hot_path, info.drafter_hot_path) == ("ipc-stream", "ipc-stream")
        ipc_dirs = []
        for name, stub in (("target", wpbg.TargetWorkerStub), ("draft", wpbg.DraftWorkerStub)):
            with grpc.insecure_channel(f"unix://{tmp_path}/rt/{name}.sock") as ch:
                ipc_dirs.append(os.path.dirname(stub(ch).Info(wpb.InfoRequest(), timeout=30).ipc_stream_socket))
        assert all(os.path.isdir(d) for d in ipc_dirs)
        prompt = [9, 8, 7, 6]
        out = subprocess.run(CLI + ["generate", "--server", sock, "--token-ids", ",".join(map(str, prompt)),
                                    "--max-tokens", "10", "--ignore-eos", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        done = json.loads(out.stdout)
        assert [int(t) for t in done["output_ids"]] == ref[:10]
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 10
        sp = done["speculation"]
        # prefill 1 token, then 4 drafts + bonus, then 3 drafts (budget) + bonus: 10 tokens, 7 accepted
        assert int(sp["num_accepted_tokens"]) == int(sp["num_draft_tokens"]) == 7
        other, _ = reference([9, 8, 7], 6)
        out = subprocess.run(CLI + ["generate", "--server", sock, "--token-ids", "9,8,7", "--max-tokens", "6",
                                    "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
        done = json.loads(out.stdout)
        assert [int(t) for t in done["output_ids"]] == other
        assert "num_accepted_tokens" not in done["speculation"]  # 0: all drafts wrong
        out = subprocess.run(CLI + ["generate", "--server", sock, "--prompt", "The quick", "--max-tokens", "5"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "finish=" in out.stderr, out.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        assert 'specd_spec_accepted_tokens_total{drafter="scripted",model="condgen.gguf"} 7.0' in body
        assert "specd_requests_total" in body and "specd_request_ttft_seconds_bucket" in body
        # drain: Ctrl-C in serve's terminal (SIGINT to its whole process group) while a stream is in
        # flight; only the launcher gets it (the children have their own groups: a worker stopping at
        # once would cut a stream longer than its 2 s grace), the stream completes, then everything exits 0
        children = Path(f"/proc/{serve.pid}/task/{serve.pid}/children")
        if children.exists():  # Linux
            kids = [int(c) for c in children.read_text().split()]
            assert len(kids) == 3 and all(os.getpgid(k) == k for k in kids)
        gen = subprocess.Popen(CLI + ["generate", "--server", sock, "--token-ids", "5,5,5", "--max-tokens", "100",
                                      "--ignore-eos", "--ids", "--token-by-token"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = os.read(gen.stdout.fileno(), 1).decode()  # the stream has started (unbuffered read)
        os.killpg(serve.pid, signal.SIGINT)
        out, err = gen.communicate(timeout=120)
        assert gen.returncode == 0, err
        assert "completion=100" in err and len((first + out).split()) == 100, (err, first + out)
    finally:
        assert _stop(serve, 90) == 0
    assert not _leaked_segments(before)
    assert not any(os.path.exists(d) for d in ipc_dirs)  # the workers removed their IPC stream sockets


def test_sigterm_unlinks_shared_memory_of_live_sequences_and_the_ipc_socket(target_gguf, tmp_path):
    sock = f"unix://{tmp_path}/t.sock"
    worker = _start(["target-worker", "--target", target_gguf, "--listen", sock,
                     "--capture-layers", ",".join(map(str, CAPTURE)), "--max-seq-len", "64"])
    try:
        with grpc.insecure_channel(sock) as ch:
            stub = wpbg.TargetWorkerStub(ch)
            names = []
            for i in range(3):
                r = stub.Prefill(wpb.PrefillRequest(seq_id=f"s{i}", tokens=[1, 2, 3], capacity=32), timeout=60)
                names.append(r.features.name)
            assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
            assert stub.Info(wpb.InfoRequest(), timeout=10).live_shm_segments == 3
            stub.Release(wpb.ReleaseRequest(seq_id="s0"), timeout=10)
            assert not os.path.exists(f"/dev/shm/{names[0]}")
            ipc = stub.Info(wpb.InfoRequest(), timeout=10).ipc_stream_socket
            assert os.path.exists(ipc)
    finally:
        assert _stop(worker) == 0
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert not os.path.exists(os.path.dirname(ipc))


def test_serve_with_a_real_drafter_chain_and_tree(target_gguf, reference, tmp_path):
    """`specd serve --target T --drafter D` (a tiny random DSpark drafter at the target's dims; the
    target captures its taps): chain and DDTree requests from `specd generate` equal the plain run.
    `--dspark-markov unfused` reaches the drafter worker (the applied mode is reported) and
    `specd generate --dspark-markov` overrides it per request."""
    from .test_drafters import make_gguf

    drafter = make_gguf(tmp_path, "dspark")
    sock = f"unix://{tmp_path}/c.sock"
    serve = _start(["serve", "--target", target_gguf, "--drafter", drafter, "--listen", sock, "--metrics-port", "0",
                    "--policy-step-ratio", "0", "--max-seq-len", "128", "--kv-dtype", "f32",
                    "--draft-mode", "tree", "--tree-budget", "5", "--runtime-dir", str(tmp_path / "rt"),
                    "--dspark-markov", "unfused"])
    try:
        prompt = [9, 8, 7, 6]
        ref, _ = reference(prompt, 12)
        for extra in ([], ["--draft-mode", "chain", "--confidence-threshold", "0.3"],
                      ["--tree-budget", "12", "--no-tree-chain-seed"], ["--dspark-markov", "off"],
                      ["--draft-mode", "chain", "--dspark-markov", "fused"]):
            out = subprocess.run(CLI + ["generate", "--server", sock, "--token-ids", ",".join(map(str, prompt)),
                                        "--max-tokens", "12", "--ignore-eos", "--speculation", "force", "--json",
                                        *extra], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            done = json.loads(out.stdout)
            assert [int(t) for t in done["output_ids"]] == ref, extra
            sp = done["speculation"]
            assert int(sp["num_drafts"]) > 0
            assert ("num_tree_steps" in sp) == ("chain" not in extra), sp
            want = extra[extra.index("--dspark-markov") + 1] if "--dspark-markov" in extra else "unfused"
            assert sp["dspark_markov"] == "DSPARK_MARKOV_" + want.upper(), sp
    finally:
        assert _stop(serve, 90) == 0


def test_bad_pair_stops_start_up_with_both_files_named(target_gguf, tmp_path):
    from .test_drafters import make_gguf

    bad = make_gguf(tmp_path, "dflash", vocab=512, mask=500)
    tmp = tmp_path / "tmp"  # the processes' TMPDIR: `serve` makes its runtime directory there
    tmp.mkdir()
    for argv in (["draft-worker", "--drafter", bad, "--target", target_gguf, "--listen", f"unix://{tmp_path}/d.sock"],
                 ["serve", "--target", target_gguf, "--drafter", bad, "--listen", f"unix://{tmp_path}/c.sock",
                  "--metrics-port", "0"]):
        out = subprocess.run(CLI + argv, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "TMPDIR": str(tmp)})
        assert out.returncode == 2, out.stderr
        assert "vocabulary" in out.stderr and bad in out.stderr and target_gguf in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert list(tmp.iterdir()) == [], f"{argv[0]} left {list(tmp.iterdir())}"  # nothing left behind


def test_cli_picks_grpcs_iomgr_tcp_stack_unless_the_caller_chose(monkeypatch):
    """main() sets GRPC_EXPERIMENTS (cli.GRPC_EXPERIMENTS: the iomgr TCP client / listener, half the
    gRPC CPU time per message of the EventEngine ones) before any command module imports grpc, which
    reads it only at import; a value the caller set is kept."""
    from specd.coordinator import cli

    # `python -m specd.coordinator.cli` loads no grpc before main(): else the setting would come too late
    out = subprocess.run([sys.executable, "-c", "import sys, specd.coordinator.cli; print('grpc' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")
    monkeypatch.delenv("GRPC_EXPERIMENTS")  # restored (unset) after the test
    for before, after in ((None, cli.GRPC_EXPERIMENTS), ("-event_engine_client", "-event_engine_client")):
        if before is not None:
            monkeypatch.setenv("GRPC_EXPERIMENTS", before)
        with pytest.raises(SystemExit):
            cli.main(["--help"])
        assert os.environ["GRPC_EXPERIMENTS"] == after
