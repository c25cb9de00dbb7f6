"""The policies' view of the simulated device is wrong by the stated amount, the same way for the
same seed, and still learns from what it observes."""

from __future__ import annotations

import statistics

import pytest

from bullet.sim.config import SimConfig, device_estimator, policy_estimator
from bullet.sim.perturbed import PerturbedPredictor


@pytest.fixture(scope="module")
def est():
    return device_estimator(SimConfig())


def test_predictions_are_off_by_the_stated_error_on_average(est):
    p = PerturbedPredictor(est, 0.10, seed=1)
    errors = []
    for tokens in (16, 64, 256, 1024, 4096, 16384):
        for units in (14, 28, 54, 80, 108):
            errors.append(abs(p.prefill_time([tokens], units) / est.prefill_time([tokens], units) - 1))
    for batch in (1, 4, 16, 64, 256):
        for units in (14, 54, 108):
            errors.append(abs(p.decode_time(batch, batch * 1000, units) / est.decode_time(batch, batch * 1000, units) - 1))
    assert 0.05 < statistics.mean(errors) < 0.16  # about 10 %, over 45 regions
    assert p.prefill_time([1000], 54) == p.prefill_time([1000], 54)  # a region keeps its error


def test_a_seed_fixes_the_errors_and_roles_differ(est):
    config = SimConfig(seed=3)
    a, b = policy_estimator(config, est, "prefill"), policy_estimator(config, est, "prefill")
    c = policy_estimator(config, est, "decode")
    assert a.prefill_time([700], 40) == b.prefill_time([700], 40)
    assert a.prefill_time([700], 40) != c.prefill_time([700], 40)
    exact = PerturbedPredictor(est, 0.0)
    assert exact.decode_time_for([500, 900], 30) == est.decode_time_for([500, 900], 30)


def test_observations_reach_the_estimator_underneath(est):
    config = SimConfig()
    p = policy_estimator(config, est, "decode")
    before = p.decode_time_for([900] * 16, 30)
    for _ in range(30):
        p.observe_decode([900] * 16, 30, 1.3 * p.est.decode_time_for([900] * 16, 30))
    assert p.decode_time_for([900] * 16, 30) > before * 1.1
