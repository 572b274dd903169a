"""``specd serve``: start the target worker, the drafter worker and the coordinator on one machine.

The workers listen on Unix sockets in a private runtime directory (``--runtime-dir``, default a new
temporary directory), the coordinator on ``--listen``. Each child is ``python -m specd.coordinator.cli
<command> ...``, so each part can also be started alone with the same flags (that is how a Helm chart
runs them). The launcher waits for each child's ``READY`` line, then forwards SIGTERM/SIGINT to the
children (coordinator first, so it drains, then the workers, which unlink their shared memory) and
exits with the first non-zero child status. The children run in their own process groups, so a
terminal's Ctrl-C reaches only the launcher (and drains like SIGTERM), and die with it if it is
killed. ``--feature-transport`` and ``--ipc-streams`` / ``--no-ipc-streams`` (coordinator flags) also go
to both workers, and ``--worker-ipc-spin-us`` is their ``--ipc-spin-us``: with ``--no-ipc-streams`` the workers open no IPC stream
socket and the coordinator uses gRPC streams; ``--no-worker-streams`` (unary calls, no stream at all)
also sends ``--no-ipc-streams`` to the workers.

Drafter: with ``--drafter D.gguf`` (DFlash, DSpark or DFlash 2) the target captures the drafter's
``target_layer_ids`` (read from D.gguf) and the drafter worker runs D.gguf bound to the target's
embedding and head (``draft-worker --drafter D.gguf --target T.gguf --share-target-weights auto
--target-worker <target socket>``: on one GPU it maps the target worker's embedding / head through
CUDA IPC instead of loading its own copy, see target_worker/shared_weights.py); a drafter that does not fit the
target (hidden size, vocabulary, tap ids, mask id) stops start-up with an error naming both files,
before any child starts. ``--scripted-block N`` runs the scripted drafter instead: with ``--scripted-continuations FILE`` (the target's greedy continuations) it is the
oracle drafter of performance.md §6.6 (``--scripted-accept k`` forces acceptance k), without it every
draft is wrong (a worst-case drafter); neither runs plain decoding only.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .config import add_arguments as _add_config_arguments
from .config import config_from_args


@dataclasses.dataclass
class ServeConfig:
    """Launcher settings (``specd serve`` flags; the coordinator's own flags pass through).

    target: qwen35 target GGUF. Default "": the embedded demo target (``models/demo-target.gguf``,
        installed with specd as ``specd/models/``).
    drafter_gguf: drafter GGUF (DFlash / DSpark / DFlash 2); its target_layer_ids become the target's
        capture layers and the drafter worker runs it. Default "auto": the embedded demo DFlash 2
        drafter when the target is the embedded demo target (and no scripted drafter is asked for),
        else none; "none" runs without a drafter.
    drafter_kv_dtype: the drafter's context K/V cache type: f32 (default), f16 or q8_0.
    dspark_markov: the drafter worker's default DSpark Markov mode: fused (default), unfused
        (bitwise identical, per-row lm_head) or off (argmax of the base logits); ignored for
        non-DSpark drafters. Requests override it (SpeculationParams.dspark_markov).
    scripted_block: run the scripted drafter with this many drafts per step (0: off). Default 0.
    scripted_continuations: JSONL of {"prompt", "continuation"} for the oracle drafter. Default "".
    scripted_accept: right drafts per step of the scripted drafter (-1: all). Default -1.
    capture_layers: target capture layers when no drafter GGUF is given, "1,2,3". Default "".
    runtime_dir: directory for the worker sockets ("" = a new temporary directory, removed at exit).
    max_seq_len: target positions per sequence (0: the GGUF context_length, else 4096). Default 0.
    kv_dtype: target KV cache type: f16 (default), q8_0 or f32.
    device: where the target worker runs the target and the draft worker the drafter: auto (default:
        cuda when this build has a GPU backend and a GPU is present, else cpu), cpu or cuda (a clear
        error without a GPU). Passed as ``--device`` to both workers.
    cuda_graphs: the target worker replays chain verifies of up to 16 rows, and a model draft worker its
        greedy proposes, as captured CUDA graphs on the GPU (default True; ``--no-cuda-graphs`` runs
        every op from Python in both). Ignored on the CPU.
    max_graphs: most captured CUDA graphs the target worker keeps (LRU; ``--max-graphs``), >= 1.
        Default 16.
    drafter_max_graphs: most captured CUDA graphs a model draft worker keeps per sequence (LRU;
        ``--drafter-max-graphs``, the draft worker's ``--max-graphs``), >= 1. Default 4.
    slot_cache: released sequences' device states the target worker keeps with their CUDA graphs for
        the next requests of the same capacity class (``--slot-cache``), >= 0. Default 2.
    gemv_tiles: the target worker places its layers' IQ4_XS, Q4_K, Q5_K and Q6_K matrices (and an untied output
        head of those types) in the tensor-core GEMV's tiled layouts on a CUDA GPU (default True; bit-identical results; ``--no-gemv-tiles`` keeps GGUF order).
    share_target_weights: "auto" (default): the drafter worker maps the target worker's token_embd /
        output (CUDA IPC) when both run on the same GPU and the tensors' content fingerprints match
        the target GGUF's, else loads its own copy (logged); "off":
        always its own copy. Passed as ``--share-target-weights`` with ``--target-worker`` (the target
        worker's socket) to the drafter worker; the target worker exports the two tensors only with
        "auto" and a drafter GGUF (``--export-head``, else ``--no-export-head``: the legacy CUDA IPC
        mapping of an exported buffer is writable by the importer).
    worker_ipc_spin_us: both workers' ``--ipc-spin-us`` (a worker busy-polls for a stream's next
        request, specd.target_worker.ipc_stream), an int in 0..100000 (0 = off) or -1 (the default,
        auto): each worker spins 1000 us on a GPU and not at all on the CPU
        (:func:`specd.target_worker.ipc_stream.resolve_spin_us`). On the H200 the workers' spin with
        wake-ahead took the AL 5 step's loop overhead from 6.6 to 5.7 % (exact drafts) and 5.8 to 5.0 %
        (block 8) (BENCHMARKS.md, session of 2026-12-02 11:53 UTC); on the 2-core VM spinning workers
        took cores from the CPU compute (+27 %, session of 2026-12-02 06:00 UTC). The coordinator's own
        spin is ``--ipc-spin-us`` (default 1000). The
        coordinator's ``--ipc-wake-ahead`` / ``--no-ipc-wake-ahead`` is passed to both workers too.
    start_timeout_s: wait for each child's READY line. Default 600.
    """

    target: str = ""
    drafter_gguf: str = "auto"
    drafter_kv_dtype: str = "f32"
    dspark_markov: str = "fused"
    scripted_block: int = 0
    scripted_continuations: str = ""
    scripted_accept: int = -1
    capture_layers: str = ""
    runtime_dir: str = ""
    max_seq_len: int = 0
    kv_dtype: str = "f16"
    device: str = "auto"
    cuda_graphs: bool = True
    max_graphs: int = 16
    drafter_max_graphs: int = 4
    slot_cache: int = 2
    gemv_tiles: bool = True
    share_target_weights: str = "auto"
    worker_ipc_spin_us: int = -1
    start_timeout_s: float = 600.0

    def resolve_models(self) -> None:
        """Fill the embedded defaults: "" target -> the demo target, "auto" drafter -> the demo
        DFlash 2 drafter for the demo target (none otherwise, or with a scripted drafter), "none" -> "".
        Raises FileNotFoundError naming the path when an embedded model is not installed."""
        if not self.target:
            self.target = embedded_model(DEMO_TARGET)
        if self.drafter_gguf == "auto":
            demo = _is_embedded(self.target, DEMO_TARGET) and not self.scripted_block
            self.drafter_gguf = embedded_model(DEMO_DRAFTER) if demo else ""
        elif self.drafter_gguf == "none":
            self.drafter_gguf = ""

    def validate(self) -> None:
        self.resolve_models()
        if self.drafter_gguf and self.scripted_block:
            raise ValueError("serve: give --drafter or --scripted-block, not both")
        if self.scripted_block < 0 or self.scripted_accept < -1 or self.max_seq_len < 0 or self.start_timeout_s <= 0:
            raise ValueError("serve: --scripted-block >= 0, --scripted-accept >= -1, --max-seq-len >= 0 and "
                             "--start-timeout-s > 0 required")
        if self.scripted_continuations and not self.scripted_block:
            raise ValueError("serve: --scripted-continuations needs --scripted-block")
        if self.max_graphs < 1:
            raise ValueError(f"serve: --max-graphs must be >= 1, got {self.max_graphs}")
        if self.drafter_max_graphs < 1:
            raise ValueError(f"serve: --drafter-max-graphs must be >= 1, got {self.drafter_max_graphs}")
        if self.slot_cache < 0:
            raise ValueError(f"serve: --slot-cache must be >= 0, got {self.slot_cache}")
        from specd.target_worker.shared_weights import check_share_mode

        check_share_mode(self.share_target_weights, "serve")
        from specd.target_worker.ipc_stream import check_spin_us

        check_spin_us(self.worker_ipc_spin_us, "serve", "worker_ipc_spin_us", auto=True)
        if self.kv_dtype not in ("f16", "q8_0", "f32"):
            raise ValueError(f"serve: --kv-dtype must be f16, q8_0 or f32, got {self.kv_dtype!r}")
        from specd.target_worker.server import check_device

        check_device(self.device, "serve")
        if self.drafter_kv_dtype not in ("f16", "q8_0", "f32"):
            raise ValueError(f"serve: --drafter-kv-dtype must be f16, q8_0 or f32, got {self.drafter_kv_dtype!r}")
        if self.dspark_markov not in ("fused", "unfused", "off"):
            raise ValueError(f"serve: --dspark-markov must be fused, unfused or off, got {self.dspark_markov!r}")
        if self.capture_layers:
            try:
                [int(x) for x in self.capture_layers.split(",") if x.strip()]
            except ValueError as exc:
                raise ValueError(f"serve: --capture-layers must be comma-separated integers: {exc}") from exc


DEMO_TARGET = "demo-target.gguf"
DEMO_DRAFTER = "demo-dflash2.gguf"  # the demo drafter with the highest measured acceptance (BENCHMARKS.md)


def embedded_model(name: str) -> str:
    """Path of an embedded demo model: ``models/<name>`` beside the package's Python folders (the
    installed ``specd/models/``, or ``models/`` of a source checkout). Raises FileNotFoundError."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # specd/ installed, the repo in a checkout
    path = os.path.join(root, "models", name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"serve: embedded model {path} not found (is specd installed with its models?); "
                                "pass --target / --drafter")
    return path


def _is_embedded(path: str, name: str) -> bool:
    """Whether ``path`` is the embedded model ``name`` itself (not merely a file of that name)."""
    try:
        return os.path.samefile(path, embedded_model(name))
    except OSError:
        return False


def add_arguments(p) -> None:
    d = ServeConfig()
    p.add_argument("--target", default=d.target,
                   help="qwen35 target GGUF (default: the embedded demo target)")
    p.add_argument("--drafter-gguf", "--drafter", dest="drafter_gguf", default=d.drafter_gguf,
                   help="drafter GGUF: DFlash, DSpark or DFlash 2 (its taps set the target's capture layers); "
                        "'auto' (default): the embedded demo DFlash 2 drafter with the embedded demo target, "
                        "else none; 'none': no drafter")
    p.add_argument("--drafter-kv-dtype", default=d.drafter_kv_dtype, choices=["f32", "f16", "q8_0"],
                   help=f"drafter context K/V cache type (default {d.drafter_kv_dtype})")
    p.add_argument("--dspark-markov", default=d.dspark_markov, choices=["fused", "unfused", "off"],
                   help=f"drafter worker's default DSpark Markov mode (default {d.dspark_markov}; unfused is "
                        "bitwise identical; off = argmax of the base logits; ignored for non-DSpark drafters)")
    p.add_argument("--scripted-block", type=int, default=d.scripted_block,
                   help="run the scripted drafter with this many drafts per step (default 0: off)")
    p.add_argument("--scripted-continuations", default=d.scripted_continuations,
                   help="scripted drafter: JSONL of prompt/continuation pairs (oracle drafter, default none)")
    p.add_argument("--scripted-accept", type=int, default=d.scripted_accept,
                   help="scripted drafter: right drafts per step (-1 all, default)")
    p.add_argument("--capture-layers", default=d.capture_layers,
                   help="target capture layers when no drafter GGUF is given (default none)")
    p.add_argument("--runtime-dir", default=d.runtime_dir, help="directory for the worker sockets (default: a new temp dir)")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="target positions per sequence (default 0: GGUF)")
    p.add_argument("--kv-dtype", default=d.kv_dtype, choices=["f16", "q8_0", "f32"], help="KV cache type (default f16)")
    from specd.target_worker.server import add_device_argument

    add_device_argument(p, d.device, "target and the drafter")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=d.cuda_graphs,
                   help="replay the target's chain verifies (<= 16 rows) and the drafter's greedy proposes as CUDA "
                        "graphs on the GPU (default on)")
    p.add_argument("--max-graphs", type=int, default=d.max_graphs,
                   help=f"most captured CUDA graphs the target worker keeps, >= 1 (default {d.max_graphs})")
    p.add_argument("--drafter-max-graphs", type=int, default=d.drafter_max_graphs,
                   help="most captured CUDA graphs a model draft worker keeps per sequence, >= 1 "
                        f"(default {d.drafter_max_graphs})")
    p.add_argument("--slot-cache", type=int, default=d.slot_cache,
                   help="released sequences' device states the target worker keeps, with their CUDA graphs, for "
                        f"the next requests of the same capacity class, >= 0 (default {d.slot_cache})")
    p.add_argument("--gemv-tiles", action=argparse.BooleanOptionalAction, default=d.gemv_tiles,
                   help="the target's IQ4_XS / Q4_K / Q5_K / Q6_K layer matrices and untied output head in the "
                        "GEMV's tiled layouts on a CUDA GPU (default on)")
    from specd.draft_worker.server import add_share_argument

    add_share_argument(p, d.share_target_weights)
    p.add_argument("--worker-ipc-spin-us", type=int, default=d.worker_ipc_spin_us,
                   help="both workers' --ipc-spin-us: busy-poll for a stream's next request for up to this many "
                        f"microseconds (0..100000, 0 = off; default {d.worker_ipc_spin_us} = auto: 1000 on a GPU, "
                        "off on the CPU)")
    p.add_argument("--start-timeout-s", type=float, default=d.start_timeout_s,
                   help="wait for each child's READY (default 600)")
    before = len(p._actions)
    _add_config_arguments(p, skip=("target", "drafter", "tokenizer"))
    p.set_defaults(_coord_actions=list(p._actions[before:]))


def _child(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specd.coordinator.cli", *argv], stdout=subprocess.PIPE,
                            text=True, preexec_fn=_own_group_dying_with_parent())


def _own_group_dying_with_parent():
    """The children's pre-exec step: each child gets its own process group, so a terminal's Ctrl-C
    (SIGINT to the foreground group) reaches only the launcher, which then stops the children in
    order (coordinator first: it drains the streams in flight) instead of every process dying at
    once; on Linux each child also gets SIGTERM when the launcher dies (PR_SET_PDEATHSIG), so none
    outlives a killed launcher. libc is loaded here, before the fork (nothing is imported after it)."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def pre_exec():
        os.setpgrp()
        if prctl is not None:
            prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the launcher died before the prctl: nobody would stop us
                os._exit(1)
    return pre_exec


class StartFailed(RuntimeError):
    """A child of ``specd serve`` exited or stalled before READY (its own error is in its output)."""


def _wait_ready(proc: subprocess.Popen, name: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line.startswith("READY"):
            return
        if not line and proc.poll() is not None:
            raise StartFailed(f"{name} exited with {proc.returncode} before READY (its error is above)")
    raise StartFailed(f"{name} not ready after {timeout} s")


def _passthrough(args) -> list[str]:
    """The coordinator flags given to `serve`, forwarded verbatim."""
    out = []
    for action in args._coord_actions:
        v = getattr(args, action.dest)
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: both values are explicit
            out.append(action.option_strings[0 if v else 1])
        elif isinstance(v, bool):
            if v:
                out.append(action.option_strings[0])
        else:
            out += [action.option_strings[0], str(v)]
    return out


def run(args) -> int:
    cfg = ServeConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)})
    cfg.validate()
    print(f"specd serve: target {cfg.target}, drafter {cfg.drafter_gguf or 'none'}", file=sys.stderr, flush=True)
    config_from_args(args, target="unix:///unused", drafter="")  # validates the coordinator flags up front
    from specd.target_worker.device import default_device
    from specd.target_worker.feature_cuda_ipc import check_device_transport

    check_device_transport(args.feature_transport, default_device() if cfg.device == "auto" else cfg.device, "serve")
    ns, args = args, cfg
    capture = args.capture_layers
    if args.drafter_gguf:
        from specd.draft_worker.gguf_loader import check_pair, load_drafter
        from specd.target_worker.gguf_loader import open_gguf, read_hparams

        dhp = load_drafter(args.drafter_gguf).hparams
        check_pair(dhp, args.drafter_gguf, read_hparams(open_gguf(args.target), args.target), args.target)
        capture = ",".join(str(i) for i in dhp.target_layer_ids)
    # Created only once nothing above can fail: the finally below removes it on every later exit.
    rt = args.runtime_dir or tempfile.mkdtemp(prefix="specd-")
    own_rt = not args.runtime_dir
    os.makedirs(rt, exist_ok=True)
    tsock, dsock = f"unix://{rt}/target.sock", f"unix://{rt}/draft.sock"
    # without worker streams the coordinator makes unary calls: a socket the workers opened would go unused
    ipc = "--ipc-streams" if ns.ipc_streams and not getattr(ns, "no_worker_streams", False) else "--no-ipc-streams"
    wake = "--ipc-wake-ahead" if getattr(ns, "ipc_wake_ahead", True) else "--no-ipc-wake-ahead"
    ipc_flags = ["--feature-transport", ns.feature_transport, ipc, "--ipc-spin-us", str(args.worker_ipc_spin_us), wake]
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        t = _child(["target-worker", "--target", args.target, "--listen", tsock, "--capture-layers", capture,
                    "--max-seq-len", str(args.max_seq_len), "--kv-dtype", args.kv_dtype, "--device", args.device,
                    *ipc_flags,
                    "--cuda-graphs" if args.cuda_graphs else "--no-cuda-graphs", "--max-graphs", str(args.max_graphs),
                    "--slot-cache", str(args.slot_cache),
                    "--gemv-tiles" if args.gemv_tiles else "--no-gemv-tiles",
                    # export the head only for a drafter that may map it (legacy CUDA IPC mappings are writable)
                    "--export-head" if args.drafter_gguf and args.share_target_weights == "auto" else "--no-export-head"])
        procs.append(("target-worker", t))
        _wait_ready(t, "target-worker", args.start_timeout_s)
        drafter = ""
        if args.drafter_gguf or args.scripted_block:
            from gguf import GGUFReader

            vocab = int(next(x for x in GGUFReader(args.target).tensors if x.name == "token_embd.weight").shape[1])
            dargv = ["draft-worker", "--listen", dsock, "--vocab", str(vocab),
                     *ipc_flags,
                     "--device", args.device]
            dargv += ["--drafter", args.drafter_gguf, "--target", args.target,
                      "--drafter-kv-dtype", args.drafter_kv_dtype,
                      "--dspark-markov", getattr(args, "dspark_markov", "fused"),
                      "--cuda-graphs" if args.cuda_graphs else "--no-cuda-graphs",
                      "--max-graphs", str(args.drafter_max_graphs),
                      "--share-target-weights", args.share_target_weights, "--target-worker", tsock] if args.drafter_gguf else [
                "--scripted-block", str(args.scripted_block), "--scripted-accept", str(args.scripted_accept),
                "--scripted-continuations", args.scripted_continuations]
            d = _child(dargv)
            procs.append(("draft-worker", d))
            _wait_ready(d, "draft-worker", args.start_timeout_s)
            drafter = dsock
        c = _child(["coordinator", "--target", tsock, "--drafter", drafter, "--tokenizer", args.target,
                    *_passthrough(ns)])
        procs.append(("coordinator", c))
        _wait_ready(c, "coordinator", args.start_timeout_s)
        print(f"READY {ns.listen}", flush=True)
        stop = {"sig": None}

        def on_signal(signum, frame):  # noqa: ARG001
            stop["sig"] = signum

        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, on_signal)
        while stop["sig"] is None and all(p.poll() is None for _, p in procs):
            time.sleep(0.2)
        return next((p.returncode for _, p in procs if p.poll() not in (None, 0)), 0)
    except StartFailed as exc:
        print(f"specd serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for _, p in reversed(procs):  # coordinator first (drain), then the workers
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60 + ns.drain_timeout_s + ns.release_timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
        if own_rt:
            shutil.rmtree(rt, ignore_errors=True)
