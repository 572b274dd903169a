"""Typed coordinator configuration: every option is a dataclass field with a CLI flag, a documented
default and validation (``specd coordinator --help`` lists them)."""
from __future__ import annotations

import argparse
import dataclasses
import math

from .policy import PolicyConfig


@dataclasses.dataclass
class CoordinatorConfig:
    """Coordinator settings.

    listen: public gRPC address, default "0.0.0.0:50051" (``unix:///path`` also works).
    target: target worker address, default "unix:///tmp/specd-target.sock".
    drafter: drafter worker address; "" runs without speculation (every step plain).
    tokenizer: GGUF to read the tokenizer and chat template from; "" = the target worker's model path.
    default_max_tokens: max_tokens when a request leaves it unset (clipped to the context), 1024.
    max_draft_tokens: server cap on drafts per step (0: the drafter's block), default 0.
    max_prompt_tokens: longest prompt accepted (0: the target's max_seq_len - 1), default 0.
    worker_timeout_s: per worker call when the request has no deadline, default 600 s.
    public_max_message_bytes: public send/receive limit, default 64 MiB.
    internal_max_message_bytes: coordinator -> worker limit, default 256 MiB.
    keepalive_min_ping_interval_ms: accept client pings this often while no data flows (server arg
        ``grpc.http2.min_ping_interval_without_data_ms``, C-core GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_
        WITHOUT_DATA_MS; gRPC default 300000). Default 5000, so clients pinging every 10 s (vLLM, SGLang
        practice) keep a channel through a long prefill with margin for timer jitter (C28).
    keepalive_time_ms: server pings idle connections this often, default 7200000 (2 h, gRPC default).
    keepalive_timeout_ms: wait for the ping ack, default 20000.
    max_ping_strikes: pings faster than that tolerated before GOAWAY too_many_pings (0: unlimited),
        default 2 (the gRPC default).
    reflection: serve gRPC reflection, default on.
    health_poll_s: how often readiness re-checks both workers' gRPC health, default 5 s.
    metrics_port: Prometheus /metrics HTTP port (0: not served), default 9464.
    metrics_addr: address the metrics server binds, default "0.0.0.0".
    draft_mode: "chain" (default) or "tree" (DDTree, spec-loop.md §7): how a request that does not
        choose (DRAFT_MODE_DEFAULT) drafts and verifies.
    tree_budget: DDTree node budget (non-root nodes per tree), default 12; >= 1 and clipped per step
        to the target's max_verify - 1.
    tree_chain_seed: DDTree inserts the top-1 chain first (spec-loop.md §7.2), default on
        (``--no-tree-chain-seed`` turns it off).
    tree_top_k: DDTree candidates per position; 0 (default) = auto: 8 if budget > depth else 1
        (spec-loop.md §7.1), clipped to the drafter's max_top_k.
    tree_temperature: T of the drafter's top-k log-probs log_softmax(logits / T), finite > 0, default 1.0.
    confidence_threshold: DSpark confidence gate default in [0, 1); 0 = off (default). Needs a drafter
        with a confidence head (checked at connect).
    drain_timeout_s: on SIGTERM, in-flight streams may finish this long, default 30 s (``specd serve``
        forwards it).
    release_timeout_s: per worker Release call, and how long close() waits for Releases still in
        flight before closing the worker channels, default 10 s.
    health_timeout_s: per worker health Check of the readiness loop, default 2 s; also bounds the IPC
        probe at connect and each sequence's IPC connect + hello (a socket not answering by then is
        given up for gRPC streams).
    max_request_id_bytes: longest request_id accepted (INVALID_ARGUMENT beyond), default 256.
    max_stop_strings: most stop strings per request, default 16; max_stop_string_bytes: longest one
        (UTF-8 bytes), default 256.
    max_prompt_bytes: most UTF-8 bytes of text / chat input, checked before tokenising, default 4 MiB.
    send_stall_timeout_s: a stream whose client does not take a message for this long ends with
        RESOURCE_EXHAUSTED (slow reader), default 60 s.
    reasoning_budget: default reasoning budget (thinking tokens) for requests that leave it unset,
        default 0 = thinking unmanaged (spec-loop.md §10, reasoning.py).
    reply_reserve: a budget B is armed only when max_tokens > B + reply_reserve (room for the answer
        after a forced close), default 64; otherwise the request runs unmanaged and reports a
        PolicySwitch "budget".
    reasoning_close: text whose tokenization is forced when the budget is spent, default
        "\n</think>\n\n" (what Qwen3.5 writes when it closes thinking itself); must contain </think>.
        The first token replaces the step's bonus (no extra step); each further one costs a plain step.
    worker_streams: send a sequence's Verify / Propose calls over one VerifyStream / ProposeStream per
        worker (worker.proto), default on: a message on an open stream costs about half a unary
        call's round trip. ``--no-worker-streams`` makes one unary call per step (workers without
        the stream methods).
    ipc_streams: with worker_streams on, use a worker's IPC stream socket when its Info offers one and
        it can be reached from this host (a probe hello at connect, bounded by health_timeout_s), else
        the gRPC streams (logged once per worker at connect; a probe failure that may pass, a timeout
        or RESOURCE_EXHAUSTED, is probed again by the readiness loop), default on: the same messages as
        length-prefixed frames on a Unix socket, about a quarter of a gRPC stream message's round
        trip (specd.target_worker.ipc_stream). ``--no-ipc-streams``: gRPC streams even when offered.
    ipc_spin_us: an IPC stream call whose answer is not there right after its request was sent may
        busy-poll its socket for up to this many microseconds before waiting in the event loop
        (server.IpcSpin: only while no other IPC call waits for its answer, and only for a kind of
        call whose answers came within the spin lately): an answer arriving within the spin skips the
        coordinator's wake-up (~0.15 ms on the H200 host, a VM). Costs a busy core, and blocks the
        event loop, for up to that long per spinning call. An int in 0..100000 (0 = off); default
        1000: measured on the H200 (27B, AL 5) it cut the speculative step's loop overhead from 0.99 /
        1.12 to 0.75 / 0.95 ms (exact / block-8 drafts), and on the 2-core CPU VM by a quarter
        (BENCHMARKS.md, session of 2026-12-02 06:00 UTC). ``specd serve`` gives the workers
        ``--worker-ipc-spin-us`` instead (launcher.ServeConfig).
    ipc_wake_ahead: with ipc_spin_us > 0, a call whose answer is predicted (from its stream's last
        answers) to come later than half the spin window sleeps in the event loop until half a window
        before it and then spins (server.IpcStream._timed_spin, :class:`specd.target_worker.ipc_stream.
        WakeAhead`), so the answer to a verify longer than the spin is caught by a spin too. Default
        True; ``--no-ipc-wake-ahead`` spins right after the request only. ``specd serve`` passes it to
        the workers as well (their ``--ipc-wake-ahead``, which acts with ``--worker-ipc-spin-us``).
    plain_steps_per_call: plain decode steps the target worker runs per Verify call (a plain run,
        worker.proto ``plain_steps``), default 8; 1 = one call per plain token. A run saves the
        coordinator round trip of all but one of its steps (the loop overhead per plain token falls
        by about that factor) and streams its tokens as one chunk. Runs are cut to the tokens left,
        the reasoning budget, the policy's plain burst, the deadline and the worker's
        ``max_plain_steps``; the tokens are those of single steps.
    policy: the adaptive policy (spec-loop.md §9.1a), see PolicyConfig.
    feature_transport: how drafter feature rows travel: "shm" (default; the target's shared-memory
        ring, both workers on one host) or "inline" (the target returns the rows it committed in its
        responses and the coordinator forwards them, unread, in the next Propose; workers on different
        hosts) or "cuda-ipc" (a device-memory ring the target exports to the drafter through CUDA/HIP
        IPC; both workers --device cuda on one GPU). Both workers must run the same transport (checked
        at connect).
    """

    listen: str = "0.0.0.0:50051"
    target: str = "unix:///tmp/specd-target.sock"
    drafter: str = "unix:///tmp/specd-draft.sock"
    tokenizer: str = ""
    default_max_tokens: int = 1024
    max_draft_tokens: int = 0
    max_prompt_tokens: int = 0
    worker_timeout_s: float = 600.0
    public_max_message_bytes: int = 64 << 20
    internal_max_message_bytes: int = 256 << 20
    keepalive_min_ping_interval_ms: int = 5_000
    keepalive_time_ms: int = 7_200_000
    keepalive_timeout_ms: int = 20_000
    max_ping_strikes: int = 2
    reflection: bool = True
    health_poll_s: float = 5.0
    metrics_port: int = 9464
    metrics_addr: str = "0.0.0.0"
    draft_mode: str = "chain"
    tree_budget: int = 12
    tree_chain_seed: bool = True
    tree_top_k: int = 0
    tree_temperature: float = 1.0
    confidence_threshold: float = 0.0
    drain_timeout_s: float = 30.0
    release_timeout_s: float = 10.0
    health_timeout_s: float = 2.0
    max_request_id_bytes: int = 256
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_prompt_bytes: int = 4 << 20
    send_stall_timeout_s: float = 60.0
    reasoning_budget: int = 0
    reply_reserve: int = 64
    reasoning_close: str = "\n</think>\n\n"
    feature_transport: str = "shm"
    worker_streams: bool = True
    ipc_streams: bool = True
    ipc_spin_us: int = 1000
    ipc_wake_ahead: bool = True
    plain_steps_per_call: int = 8
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)

    def validate(self) -> None:
        if not self.target:
            raise ValueError("coordinator: target address is required")
        from specd.target_worker.feature_inline import check_transport

        check_transport(self.feature_transport, "coordinator")
        from specd.target_worker.server import check_bool

        for name in ("worker_streams", "ipc_streams", "ipc_wake_ahead"):
            check_bool(getattr(self, name), name, "coordinator")
        from specd.target_worker.ipc_stream import check_spin_us

        check_spin_us(self.ipc_spin_us, "coordinator")
        for name in ("default_max_tokens", "worker_timeout_s", "health_poll_s", "public_max_message_bytes",
                     "internal_max_message_bytes", "keepalive_min_ping_interval_ms", "keepalive_time_ms",
                     "keepalive_timeout_ms", "release_timeout_s", "health_timeout_s", "max_request_id_bytes",
                     "max_stop_strings", "max_stop_string_bytes", "max_prompt_bytes", "send_stall_timeout_s",
                     "plain_steps_per_call"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):  # nan / inf: a timer never set
                raise ValueError(f"coordinator: {name} must be > 0 and finite, got {getattr(self, name)}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"coordinator: metrics_port must be in 0..65535, got {self.metrics_port}")
        for name in ("max_draft_tokens", "max_prompt_tokens", "max_ping_strikes", "drain_timeout_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"coordinator: {name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.reasoning_budget < 0 or self.reply_reserve < 0:
            raise ValueError(f"coordinator: reasoning_budget and reply_reserve must be >= 0, got "
                             f"{self.reasoning_budget}, {self.reply_reserve}")
        if "</think>" not in self.reasoning_close:
            raise ValueError(f"coordinator: reasoning_close must contain </think>, got {self.reasoning_close!r}")
        if self.draft_mode not in ("chain", "tree"):
            raise ValueError(f"coordinator: draft_mode must be chain or tree, got {self.draft_mode!r}")
        if self.tree_budget < 1 or self.tree_top_k < 0:
            raise ValueError(f"coordinator: tree_budget must be >= 1 and tree_top_k >= 0, got "
                             f"{self.tree_budget}, {self.tree_top_k}")
        if not (self.tree_temperature > 0 and math.isfinite(self.tree_temperature)):
            raise ValueError(f"coordinator: tree_temperature must be finite > 0, got {self.tree_temperature}")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError(f"coordinator: confidence_threshold must be in [0, 1), got {self.confidence_threshold}")
        self.policy.validate()

    def server_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_send_message_length", self.public_max_message_bytes),
                ("grpc.max_receive_message_length", self.public_max_message_bytes),
                ("grpc.http2.min_ping_interval_without_data_ms", self.keepalive_min_ping_interval_ms),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.keepalive_time_ms", self.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
                ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
                ("grpc.so_reuseport", 0)]  # a second coordinator on a taken port fails instead of sharing it

    def channel_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_send_message_length", self.internal_max_message_bytes),
                ("grpc.max_receive_message_length", self.internal_max_message_bytes)]


_FLAGS = [  # (field, type, help)
    ("listen", str, "public gRPC address"),
    ("target", str, "target worker address"),
    ("drafter", str, "drafter worker address ('' = no speculation)"),
    ("tokenizer", str, "GGUF with the tokenizer ('' = the target worker's model)"),
    ("default_max_tokens", int, "max_tokens when unset"),
    ("max_draft_tokens", int, "cap on drafts per step (0 = drafter block)"),
    ("max_prompt_tokens", int, "longest prompt (0 = context - 1)"),
    ("worker_timeout_s", float, "worker call timeout without a request deadline"),
    ("public_max_message_bytes", int, "public message size limit"),
    ("internal_max_message_bytes", int, "worker message size limit"),
    ("keepalive_min_ping_interval_ms", int, "accepted client ping interval"),
    ("keepalive_time_ms", int, "server keepalive ping interval"),
    ("keepalive_timeout_ms", int, "keepalive ack timeout"),
    ("max_ping_strikes", int, "bad pings before GOAWAY (0 = unlimited)"),
    ("health_poll_s", float, "readiness re-check interval of the workers"),
    ("metrics_port", int, "Prometheus metrics HTTP port (0 = off)"),
    ("metrics_addr", str, "Prometheus metrics bind address"),
    ("draft_mode", str, "default draft mode: chain or tree (DDTree)"),
    ("tree_budget", int, "DDTree node budget"),
    ("tree_top_k", int, "DDTree candidates per position (0 = auto)"),
    ("tree_temperature", float, "temperature of the DDTree top-k log-probs"),
    ("confidence_threshold", float, "default DSpark confidence gate (0 = off)"),
    ("drain_timeout_s", float, "on SIGTERM, let in-flight streams finish this long"),
    ("release_timeout_s", float, "worker Release timeout; close() waits this long for pending Releases"),
    ("health_timeout_s", float, "worker health check timeout"),
    ("max_request_id_bytes", int, "longest request_id"),
    ("max_stop_strings", int, "most stop strings per request"),
    ("max_stop_string_bytes", int, "longest stop string (bytes)"),
    ("max_prompt_bytes", int, "most bytes of text/chat input (checked before tokenising)"),
    ("send_stall_timeout_s", float, "end a stream whose client reads nothing this long (RESOURCE_EXHAUSTED)"),
    ("reasoning_budget", int, "default reasoning budget in thinking tokens (0 = unmanaged)"),
    ("reply_reserve", int, "arm a reasoning budget B only when max_tokens > B + reply_reserve"),
    ("reasoning_close", str, "text forced to close thinking when the budget is spent (must contain </think>)"),
    ("plain_steps_per_call", int, "plain decode steps per target Verify call (1 = one call per token)"),
    ("ipc_spin_us", int, "the coordinator's spin: busy-poll an IPC stream for an answer due soon for up to this many "
                         "microseconds before waiting in the event loop (0 = off; 0..100000; specd serve's workers: "
                         "--worker-ipc-spin-us)"),
    ("feature_transport", str, "drafter feature rows: shm (shared memory, one host), inline (bytes via the coordinator) or cuda-ipc (GPU ring shared through CUDA IPC; --device cuda)"),
]
_POLICY_FLAGS = [
    ("step_ratio", float, "prior t_spec/t_plain (0 disables the policy)"),
    ("gate_factor", float, "speculate while EMA >= factor*(ratio-1)"),
    ("burst_len", int, "plain steps per burst"),
    ("max_burst_len", int, "burst cap"),
    ("accept_alpha", float, "acceptance EMA weight"),
    ("probe_alpha", float, "acceptance EMA weight after a burst"),
    ("time_alpha", float, "step-time EMA weight"),
    ("accept_prior", float, "starting acceptance EMA (-1 = step_ratio - 1)"),
]


def add_arguments(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    d = CoordinatorConfig()
    for name, typ, help_text in _FLAGS:
        if name in skip:
            continue
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=getattr(d, name),
                       help=f"{help_text} (default {getattr(d, name)!r})")
    p.add_argument("--no-reflection", action="store_true", help="disable gRPC server reflection")
    p.add_argument("--no-worker-streams", action="store_true",
                   help="one unary Verify / Propose call per step instead of one stream per sequence and worker "
                        "(specd serve: the workers then open no IPC stream socket either)")
    p.add_argument("--ipc-streams", action=argparse.BooleanOptionalAction, default=d.ipc_streams,
                   help="with worker streams, use a worker's IPC stream socket when its Info offers one and this host "
                        "reaches it, else gRPC streams (default on; --no-ipc-streams: gRPC streams; specd serve passes it "
                        "to the workers too, which then open no socket)")
    p.add_argument("--ipc-wake-ahead", action=argparse.BooleanOptionalAction, default=d.ipc_wake_ahead,
                   help="with --ipc-spin-us, a call whose answer is predicted from its stream's last answers to come "
                        "later than half the spin window sleeps until half a window before it, then spins (default on; "
                        "--no-ipc-wake-ahead: spin right after the request only; specd serve passes it to the "
                        "workers too)")
    p.add_argument("--no-tree-chain-seed", action="store_true",
                   help="DDTree: do not insert the top-1 chain first (default: chain seed on)")
    for name, typ, help_text in _POLICY_FLAGS:
        p.add_argument("--policy-" + name.replace("_", "-"), type=typ, default=getattr(d.policy, name),
                       help=f"{help_text} (default {getattr(d.policy, name)!r})")
    p.add_argument("--policy-fixed-ratio", action="store_true",
                   help="do not measure step times; keep the ratio at --policy-step-ratio")


def config_from_args(args, **override) -> CoordinatorConfig:
    kw = {name: getattr(args, name) for name, _, _ in _FLAGS if hasattr(args, name)}
    kw.update(override)
    pol = PolicyConfig(**{name: getattr(args, "policy_" + name) for name, _, _ in _POLICY_FLAGS},
                       measure_times=not args.policy_fixed_ratio)
    cfg = CoordinatorConfig(**kw, reflection=not args.no_reflection,
                            tree_chain_seed=not getattr(args, "no_tree_chain_seed", False),
                            worker_streams=not getattr(args, "no_worker_streams", False),
                            ipc_streams=getattr(args, "ipc_streams", True),
                            ipc_wake_ahead=getattr(args, "ipc_wake_ahead", True), policy=pol)
    cfg.validate()
    return cfg
