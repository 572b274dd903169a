"""Coordinator Prometheus metrics (serving.md §5.3, the coordinator subset).

One :class:`prometheus_client.CollectorRegistry` per coordinator, exposed over HTTP on
``CoordinatorConfig.metrics_port`` (0: not served; the registry still counts). Names use the ``specd_``
prefix, no colons; counters get ``_total`` from prometheus_client; labels ``model`` and ``drafter`` (no
request ids). PromQL (same as vLLM's shapes): acceptance rate = rate(accepted) / rate(draft tokens);
mean acceptance length = 1 + rate(accepted) / rate(drafts); conditional acceptance at position i =
rate(per_position{position=i}) / rate(reached{position=i}).

Series:

* requests: ``specd_requests_total{finish_reason,code}``, ``specd_requests_running``,
  ``specd_request_ttft_seconds``, ``specd_request_e2e_seconds``,
  ``specd_request_inter_chunk_latency_seconds``, ``specd_prompt_tokens_total``,
  ``specd_generation_tokens_total`` (tokens sent);
* speculation: ``specd_spec_drafts_total``, ``specd_spec_draft_tokens_total``,
  ``specd_spec_accepted_tokens_total``, ``specd_spec_accepted_tokens_per_position_total{position}``,
  ``specd_spec_reached_positions_total{position}`` (steps in which position i was offered and every
  earlier draft was accepted), ``specd_spec_requests_total{mode}``,
  ``specd_spec_policy_decisions_total{decision}`` (to_plain_gate / to_spec_probe / to_spec_budget = a
  reasoning budget not armed),
  ``specd_spec_draft_length`` (drafts offered per speculative step), ``specd_request_spec_acceptance_ratio``
  (accepted / draft tokens per finished request with drafts);
* steps: ``specd_step_seconds{phase=draft|verify}`` (worker call wall time; a plain run's steps each
  observe their share of the call), ``specd_loop_overhead_seconds`` (step wall time minus the workers'
  reported compute, per step, shared out the same way);
* transport: ``specd_worker_hot_path{worker=target|drafter,transport=ipc-stream|grpc-stream|unary}`` = 1
  for the transport each worker's per-step calls use (chosen at connect).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0)
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
LENGTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class CoordinatorMetrics:
    """The coordinator's metric families in their own registry (see the module docstring)."""

    def __init__(self, model: str, drafter: str):
        self.registry = r = CollectorRegistry()
        lab = ("model", "drafter")
        self._lv = (model, drafter)
        self.requests = Counter("specd_requests", "Finished requests", lab + ("finish_reason", "code"), registry=r)
        self.running = Gauge("specd_requests_running", "Requests being generated", lab, registry=r)
        self.ttft = Histogram("specd_request_ttft_seconds", "Time to first token", lab, buckets=TTFT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("specd_request_e2e_seconds", "Request wall time", lab, buckets=E2E_BUCKETS, registry=r)
        self.inter_chunk = Histogram("specd_request_inter_chunk_latency_seconds", "Time between streamed chunks",
                                     lab, buckets=ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specd_prompt_tokens", "Prompt tokens", lab, registry=r)
        self.generation_tokens = Counter("specd_generation_tokens", "Completion tokens sent", lab, registry=r)
        self.drafts = Counter("specd_spec_drafts", "Speculative steps with >= 1 draft", lab, registry=r)
        self.draft_tokens = Counter("specd_spec_draft_tokens", "Draft tokens verified", lab, registry=r)
        self.accepted = Counter("specd_spec_accepted_tokens", "Draft tokens accepted", lab, registry=r)
        self.per_position = Counter("specd_spec_accepted_tokens_per_position", "Accepted drafts by position",
                                    lab + ("position",), registry=r)
        self.reached = Counter("specd_spec_reached_positions", "Positions offered with all earlier drafts accepted",
                               lab + ("position",), registry=r)
        self.spec_requests = Counter("specd_spec_requests", "Requests by speculation mode", lab + ("mode",),
                                     registry=r)
        self.decisions = Counter("specd_spec_policy_decisions", "Adaptive-policy switches", lab + ("decision",),
                                 registry=r)
        self.draft_length = Histogram("specd_spec_draft_length", "Drafts offered per speculative step", lab,
                                      buckets=LENGTH_BUCKETS, registry=r)
        self.acceptance_ratio = Histogram("specd_request_spec_acceptance_ratio", "Accepted / draft tokens per request",
                                          lab, buckets=RATIO_BUCKETS, registry=r)
        self.step = Histogram("specd_step_seconds", "Worker call wall time per step", lab + ("phase",),
                              buckets=STEP_BUCKETS, registry=r)
        self.overhead = Histogram("specd_loop_overhead_seconds", "Step wall time outside worker compute", lab,
                                  buckets=STEP_BUCKETS, registry=r)
        self.hot_path = Gauge("specd_worker_hot_path", "Transport of each worker's per-step calls (1 = in use)",
                              lab + ("worker", "transport"), registry=r)
        lv = self._lv

        # the per-step series' children, looked up once (labels() takes a lock and hashes per call)
        self._drafts, self._draft_tokens = self.drafts.labels(*lv), self.draft_tokens.labels(*lv)
        self._accepted, self._draft_length = self.accepted.labels(*lv), self.draft_length.labels(*lv)
        self._step_draft, self._step_verify = self.step.labels(*lv, "draft"), self.step.labels(*lv, "verify")
        self._overhead = self.overhead.labels(*lv)
        self._ttft, self._inter_chunk = self.ttft.labels(*lv), self.inter_chunk.labels(*lv)
        self._reached: list = []       # position i -> child of reached{position=i}
        self._per_position: list = []  # position i -> child of per_position{position=i}

    def l(self, *extra):  # noqa: E743 - label tuple helper
        return (*self._lv, *extra)

    def _children(self, cache: list, family, n: int) -> list:
        """``cache`` grown to the children of positions 0..n-1 of ``family`` (created when first used,
        so /metrics lists only positions that occurred)."""
        while len(cache) < n:
            cache.append(family.labels(*self._lv, str(len(cache))))
        return cache

    def record_chunk(self, seconds: float, first: bool) -> None:
        """A chunk handed to gRPC ``seconds`` after the request started (``first``) or after the
        previous chunk."""
        (self._ttft if first else self._inter_chunk).observe(seconds)

    def record_step(self, drafts: int, accepted: int, draft_s: float, verify_s: float, overhead_s: float,
                    steps: int = 1) -> None:
        """One decode step: ``drafts`` offered (0: plain), ``accepted`` of them, times in seconds.
        ``steps`` > 1: that many plain steps of one plain run, each with the given (per-step) times."""
        for _ in range(steps - 1):
            self._step_verify.observe(verify_s)
            self._overhead.observe(overhead_s)
        if drafts:
            self._drafts.inc()
            self._draft_tokens.inc(drafts)
            self._accepted.inc(accepted)
            self._draft_length.observe(drafts)
            reached = min(accepted + 1, drafts)
            for c in self._children(self._reached, self.reached, reached)[:reached]:
                c.inc()
            for c in self._children(self._per_position, self.per_position, accepted)[:accepted]:
                c.inc()
            self._step_draft.observe(draft_s)
        self._step_verify.observe(verify_s)
        self._overhead.observe(overhead_s)
