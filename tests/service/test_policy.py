"""The adaptive policy (spec-loop.md §9.1a, §9.4) as a unit: gate, bursts, probes, break-even from
measured step times."""
from __future__ import annotations

import pytest

from specd.coordinator.policy import AdaptivePolicy, PolicyConfig


def run_steps(p, accepts, t_spec=2.0, t_plain=1.0):
    """Drives the policy with acceptance values for its speculative steps; returns the step kinds."""
    kinds, it, step = [], iter(accepts), 0
    while True:
        step += 1
        if p.speculate_next():
            try:
                a = next(it)
            except StopIteration:
                return kinds
            p.record_spec(step, a, t_spec)
            kinds.append("S")
        else:
            p.record_plain(step, t_plain)
            kinds.append("P")


def test_gate_burst_probe_and_doubling():
    p = AdaptivePolicy(PolicyConfig(step_ratio=1.9, burst_len=3, max_burst_len=5, measure_times=False,
                                    accept_prior=0.0))
    kinds = run_steps(p, [0, 0, 0, 4])
    assert "".join(kinds) == "S" + "PPP" + "S" + "PPPPP" + "S" + "PPPPP" + "S"  # 3, doubled to 6 -> capped 5
    assert [(s[1], s[2]) for s in p.switches] == [(False, "gate"), (True, "probe"), (False, "gate"),
                                                  (True, "probe"), (False, "gate"), (True, "probe")]
    assert p.ema == pytest.approx(2.0)  # the probe after a burst weighs 0.5: 0 + 0.5 * 4
    assert p.speculate_next() and p.burst == 3  # a passing probe resets the burst


def test_break_even_uses_measured_step_times():
    # rho = 3.0 / 1.0 measured: speculation pays only if EMA >= 0.8 * 2 = 1.6
    p = AdaptivePolicy(PolicyConfig(step_ratio=1.1, burst_len=2, time_alpha=1.0))
    p.record_plain(0, 1.0)
    p.record_spec(1, 1, 3.0)  # ema 1 < 1.6 -> gate (with the 1.1 prior it would pass: 0.08)
    assert not p.speculate_next() and p.ratio == pytest.approx(3.0)
    q = AdaptivePolicy(PolicyConfig(step_ratio=1.1, burst_len=2, measure_times=False))
    q.record_plain(0, 1.0)
    q.record_spec(1, 1, 3.0)
    assert q.speculate_next() and q.ratio == pytest.approx(1.1)


def test_disabled_policy_always_speculates():
    p = AdaptivePolicy(PolicyConfig(step_ratio=0))
    for i in range(10):
        assert p.speculate_next()
        p.record_spec(i, 0, 5.0)
    assert not p.switches


def test_acceptance_ema_is_seeded_from_the_prior():
    """One observation does not set the EMA alone: it starts at the prior (step_ratio - 1 by default)."""
    p = AdaptivePolicy(PolicyConfig(step_ratio=1.9, accept_alpha=0.25, measure_times=False))
    assert p.ema == pytest.approx(0.9)
    p.record_spec(1, 4, 1.0)
    assert p.ema == pytest.approx(0.9 + 0.25 * (4 - 0.9))
    q = AdaptivePolicy(PolicyConfig(step_ratio=1.9, accept_prior=3.0, accept_alpha=0.5))
    q.record_spec(1, 0, 1.0)  # one zero from a prior of 3: 1.5 >= 0.72, still speculating
    assert q.ema == pytest.approx(1.5) and q.speculate_next() and not q.switches


def test_untimed_step_stays_out_of_t_spec_and_force_skips_the_gate():
    p = AdaptivePolicy(PolicyConfig(step_ratio=1.9, time_alpha=1.0))
    p.record_spec(1, 3, None)  # a Propose that ingested the prompt: not a representative time
    assert p.t_spec is None
    p.record_spec(2, 3, 0.5)
    assert p.t_spec == pytest.approx(0.5)
    f = AdaptivePolicy(PolicyConfig(step_ratio=1.9, burst_len=3))
    for i in range(5):
        f.record_spec(i, 0, 1.0, gate=False)  # FORCE: no gate bookkeeping, no switches
    assert f.switches == [] and f.speculate_next() and f.t_spec == pytest.approx(1.0)


@pytest.mark.parametrize("kw", [dict(step_ratio=0.5), dict(accept_prior=-2), dict(burst_len=0), dict(burst_len=10, max_burst_len=5),
                                dict(accept_alpha=0), dict(probe_alpha=1.5), dict(gate_factor=0)])
def test_config_validation(kw):
    with pytest.raises(ValueError):
        PolicyConfig(**kw).validate()
