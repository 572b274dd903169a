"""Fixtures for service tests: a tiny random qwen35 target (tests/target tinymodels, converted to GGUF),
its plain greedy reference runs, and an in-process stack — target worker and scripted-drafter worker
(sync gRPC servers on Unix sockets) plus a coordinator (grpc.aio on its own event-loop thread) —
always stopped at the end."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading

import grpc
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import specd.native as sn  # noqa: E402
from specd.coordinator.config import CoordinatorConfig  # noqa: E402
from specd.coordinator.policy import PolicyConfig  # noqa: E402
from specd.coordinator.server import Coordinator, start_server  # noqa: E402
from specd.draft_worker import server as dserver  # noqa: E402
from specd.draft_worker.scripted import ScriptedDrafter  # noqa: E402
from specd.protos.v1 import generate_pb2 as gpb  # noqa: E402
from specd.protos.v1 import generate_pb2_grpc as gpbg  # noqa: E402
from specd.target_worker import server as tserver  # noqa: E402
from specd.target_worker.convert import convert  # noqa: E402
from specd.target_worker.gguf_loader import load_qwen35  # noqa: E402
from specd.target_worker.model import Qwen35Model  # noqa: E402

from target.tinymodels import SPECS, build_checkpoint  # noqa: E402

MODEL = "condgen"  # has a tokenizer (EOS <|im_end|>, added tokens) and a chat template
CAPTURE = (0, 2)
BLOCK = 6  # scripted drafter: drafts per step


def build_gguf(tmp_path_factory, name: str) -> str:
    ck = build_checkpoint(SPECS[name], tmp_path_factory.mktemp(f"hf-{name}"))
    out = tmp_path_factory.mktemp("gguf") / f"{name}.gguf"
    convert(ck.path, out, "f32")
    return str(out)


@pytest.fixture(scope="session")
def target_gguf(tmp_path_factory):
    return build_gguf(tmp_path_factory, MODEL)


@pytest.fixture(scope="session")
def plain_model(target_gguf):
    """A separate Qwen35Model over the same GGUF for plain greedy reference runs."""
    return Qwen35Model(load_qwen35(target_gguf), capture_layers=CAPTURE, kv_dtype=sn.DType.F32)


@pytest.fixture(scope="session")
def reference(plain_model):
    """reference(prompt, n) -> (greedy tokens [n], features of positions 0..len(prompt)+n-2): plain
    prefill + token-by-token decode, no EOS handling (cached)."""
    return make_reference(plain_model)


def make_reference(plain_model):
    cache = {}

    def get(prompt, n):
        key = tuple(prompt)
        if key not in cache or len(cache[key][0]) < n:
            st = plain_model.new_sequence(len(prompt) + n + 1)
            logits = plain_model.prefill(st, list(prompt))
            out = []
            for _ in range(n):
                t = int(logits.argmax())
                out.append(t)
                logits = plain_model.decode(st, t)
            cache[key] = (out, st.features.read(0, st.committed))
        toks, feats = cache[key]
        return toks[:n], feats
    return get


class Stack:
    """Target worker + drafter worker + coordinator, in process, on Unix sockets."""

    def __init__(self, target_gguf, block=BLOCK, feature_transport="shm", capture_layers=CAPTURE, max_seq_len=256,
                 device="auto", **coord_kw):
        self.dir = tempfile.mkdtemp(prefix="specd-test-")
        self.transport = feature_transport
        tcfg = tserver.TargetWorkerConfig(target=target_gguf, listen=f"unix://{self.dir}/t.sock",
                                          capture_layers=capture_layers, max_seq_len=max_seq_len, kv_dtype="f32",
                                          threads=16, device=device,
                                          feature_transport=feature_transport)
        self.tservicer = tserver.load_servicer(tcfg)
        self.tserver, _ = tserver.start_server(self.tservicer, tcfg.listen, tcfg.threads)
        hp = self.tservicer.model.hp
        self.drafter = ScriptedDrafter(block, hp.n_vocab)
        self.dservicer = dserver.DraftServicer(self.drafter, idle_ttl_s=900.0, feature_transport=feature_transport)
        self.dserver, _ = dserver.start_server(self.dservicer, f"unix://{self.dir}/d.sock", 16)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coords = []
        self.default = self.coordinator(**coord_kw)

    def coordinator(self, policy: PolicyConfig | None = None, drafter_override: str | None = None, **kw):
        """Starts one more coordinator over the same workers (or another drafter address); returns a
        SpecDecode stub for it."""
        n = len(self.coords)
        kw.setdefault("metrics_port", 0)
        kw.setdefault("feature_transport", self.transport)
        cfg = CoordinatorConfig(listen=f"unix://{self.dir}/c{n}.sock", target=f"unix://{self.dir}/t.sock",
                                drafter=drafter_override or f"unix://{self.dir}/d.sock", policy=policy or PolicyConfig(),
                                **kw)
        cfg.validate()
        coord = Coordinator(cfg)
        server, _ = asyncio.run_coroutine_threadsafe(start_server(coord), self.loop).result(30)
        channel = grpc.insecure_channel(cfg.listen)
        self.coords.append((coord, server, channel))
        return gpbg.SpecDecodeStub(channel)

    def default_tokenizer(self):
        return self.coords[0][0].tok.tokenizer

    @property
    def stub(self):
        return self.default

    def stop(self):
        for coord, server, channel in self.coords:
            channel.close()
            asyncio.run_coroutine_threadsafe(server.stop(0), self.loop).result(10)
            asyncio.run_coroutine_threadsafe(coord.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.dserver.stop(0).wait()
        self.tserver.stop(0).wait()
        self.dservicer.close()
        self.tservicer.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # the sockets' directory


@pytest.fixture
def serve_argvs(serve_children, target_gguf):
    """argvs(*flags): the argv of each child `specd serve --target <demo target> --drafter none
    --scripted-block 2 *flags` starts, in order (target-worker, draft-worker, coordinator), without
    starting any (tests/conftest.py's serve_children; the coordinator's launch ends the run)."""

    def argvs(*flags):
        seen = serve_children(["--target", target_gguf, "--drafter", "none", "--scripted-block", "2",
                               "--runtime-dir", "", *flags], stop_at="coordinator")
        assert [a[0] for a in seen] == ["target-worker", "draft-worker", "coordinator"]
        return seen

    return argvs


@pytest.fixture(scope="session")
def stack(target_gguf):
    s = Stack(target_gguf, policy=PolicyConfig(step_ratio=0))  # policy off: speculate every step
    yield s
    s.stop()


def generate(stub, req, timeout=60):
    """Runs Generate; returns (chunks, complete)."""
    chunks, complete = [], None
    for r in stub.Generate(req, timeout=timeout):
        if r.HasField("chunk"):
            assert complete is None, "chunk after complete"
            chunks.append(r.chunk)
        else:
            assert complete is None, "two complete messages"
            complete = r.complete
    assert complete is not None, "stream ended without complete"
    return chunks, complete


def streamed_ids(chunks):
    return [t for c in chunks for t in c.token_ids]


def token_request(prompt, max_tokens, **kw):
    spec = kw.pop("speculation", None)
    stop = gpb.StoppingParams(max_tokens=max_tokens, **kw)
    req = gpb.GenerateRequest(tokenized=gpb.TokenizedInput(input_ids=prompt), stopping=stop)
    if spec is not None:
        req.speculation.CopyFrom(spec)
    return req
