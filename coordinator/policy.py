"""The adaptive speculation policy of spec-loop.md §9.1a (specd's default), with §9.4 re-entry.

Per sequence, in the coordinator; decisions use only past steps, so the policy is lossless.

* ``ema`` — EMA of accepted draft tokens per speculative step (bonus excluded), alpha
  ``accept_alpha``; the first speculative step after a plain burst (a *probe*) uses ``probe_alpha``
  (0.5) so a stream that became predictable leaves plain decoding at once.
* ``t_spec`` / ``t_plain`` — EMAs (alpha ``time_alpha``) of the measured wall time of a speculative
  step (propose + verify + commit, seconds) and of a plain step (seed-only verify; a step of a plain
  run — several plain steps in one worker call — counts its share of the call's wall time, so t_plain
  includes the round trip divided over the run). The step-cost
  ratio is rho = t_spec / t_plain once both are measured, ``step_ratio`` before (default 1.9).
  A speculative step emits a + 1 tokens in t_spec, a plain one 1 token in t_plain, so speculation pays
  iff a > rho - 1.
* Gate: after a speculative step, if ema < ``gate_factor`` * (rho - 1) (0.8 biases toward
  speculating), run a burst of ``burst_len`` plain steps (40), then probe with one speculative step.
  A probe that trips the gate again doubles the burst (capped at ``max_burst_len``); one that passes
  resets it.
* ``step_ratio`` = 0 disables the policy (always speculate).

Every switch is recorded as (step index, to_speculative, reason) with reason "gate" or "probe".
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class PolicyConfig:
    """Adaptive-policy settings (coordinator flags ``--policy-*``).

    step_ratio: prior t_spec / t_plain until both are measured; 0 disables the policy. Default 1.9.
    gate_factor: speculate while ema >= gate_factor * (rho - 1). Default 0.8.
    burst_len: plain steps per burst. Default 40. max_burst_len: cap when probes keep failing, 320.
    accept_alpha: EMA weight of a new acceptance observation, 0.25; probe_alpha: after a burst, 0.5.
    time_alpha: EMA weight of a new step-time measurement, 0.2.
    accept_prior: the acceptance EMA's starting value (one observation does not decide alone);
        -1 (default) = the break-even of the prior, step_ratio - 1; else >= 0.
    measure_times: use measured step times (True) or keep rho = step_ratio (False, deterministic).
    """

    step_ratio: float = 1.9
    gate_factor: float = 0.8
    burst_len: int = 40
    max_burst_len: int = 320
    accept_alpha: float = 0.25
    probe_alpha: float = 0.5
    time_alpha: float = 0.2
    measure_times: bool = True
    accept_prior: float = -1.0

    def validate(self) -> None:
        for name in ("step_ratio", "gate_factor", "accept_prior", "accept_alpha", "probe_alpha", "time_alpha"):
            if not math.isfinite(getattr(self, name)):  # nan passes every comparison below
                raise ValueError(f"policy {name} must be finite, got {getattr(self, name)}")
        if self.step_ratio < 0 or (0 < self.step_ratio < 1):
            raise ValueError(f"policy step_ratio must be 0 (off) or >= 1, got {self.step_ratio}")
        if self.gate_factor <= 0:
            raise ValueError(f"policy gate_factor must be > 0, got {self.gate_factor}")
        if self.burst_len < 1 or self.max_burst_len < self.burst_len:
            raise ValueError(f"policy needs 1 <= burst_len <= max_burst_len, got {self.burst_len}, {self.max_burst_len}")
        if self.accept_prior < 0 and self.accept_prior != -1:
            raise ValueError(f"policy accept_prior must be -1 (auto) or >= 0, got {self.accept_prior}")
        for name in ("accept_alpha", "probe_alpha", "time_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"policy {name} must be in (0, 1], got {getattr(self, name)}")


class AdaptivePolicy:
    """State of the policy for one sequence (see the module docstring)."""

    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        prior = cfg.accept_prior if cfg.accept_prior >= 0 else max(0.0, cfg.step_ratio - 1.0)
        self.ema: float = float(prior)
        self.t_spec: float | None = None
        self.t_plain: float | None = None
        self.burst_left = 0
        self.burst = cfg.burst_len
        self.probing = False
        self.switches: list[tuple[int, bool, str]] = []

    @property
    def enabled(self) -> bool:
        return self.cfg.step_ratio > 0

    @property
    def ratio(self) -> float:
        if self.cfg.measure_times and self.t_spec is not None and self.t_plain is not None and self.t_plain > 0:
            return self.t_spec / self.t_plain
        return self.cfg.step_ratio

    def speculate_next(self) -> bool:
        return not self.enabled or self.burst_left == 0

    def _ema_time(self, old, dt):
        return dt if old is None else old + self.cfg.time_alpha * (dt - old)

    def record_plain(self, step: int, dt: float) -> None:
        """A plain step ran (index ``step``, ``dt`` seconds)."""
        self.t_plain = self._ema_time(self.t_plain, dt)
        if self.burst_left > 0:
            self.burst_left -= 1
            if self.burst_left == 0:
                self.probing = True
                self.switches.append((step + 1, True, "probe"))

    def plain_left(self) -> int | None:
        """Plain steps left in the current burst before the probe (None: no burst running); a plain
        run is capped to it so the probe comes at the step it would with single steps."""
        return self.burst_left if self.enabled and self.burst_left > 0 else None

    def record_plain_run(self, step: int, steps: int, dt: float) -> None:
        """``steps`` plain steps of one plain run (indices ``step`` .. ``step + steps - 1``), each
        taking ``dt`` seconds (its share of the call's wall time, round trip included)."""
        for i in range(steps):
            self.record_plain(step + i, dt)

    def record_spec(self, step: int, accepted: int, dt: float | None, gate: bool = True) -> None:
        """A speculative step ran and accepted ``accepted`` drafts. ``dt`` None: the step's time is
        not representative (the drafter also ingested a prompt or a catch-up after plain steps) and
        stays out of t_spec. ``gate`` False (speculation FORCE): only the time is recorded."""
        if dt is not None:
            self.t_spec = self._ema_time(self.t_spec, dt)
        if not self.enabled or not gate:
            return
        alpha = self.cfg.probe_alpha if self.probing else self.cfg.accept_alpha
        self.ema = self.ema + alpha * (accepted - self.ema)
        if self.ema < self.cfg.gate_factor * (self.ratio - 1.0):
            self.burst = min(2 * self.burst, self.cfg.max_burst_len) if self.probing else self.cfg.burst_len
            self.burst_left = self.burst
            self.switches.append((step + 1, False, "gate"))
        elif self.probing:
            self.burst = self.cfg.burst_len
        self.probing = False
