"""The policies' view of the simulated device is wrong by the stated amount, the same way for the
same seed, and online refinement learns that error from what it observes, as a worker's would."""

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


@pytest.mark.parametrize("learnable", [True, False])
def test_online_refinement_learns_the_error_only_when_it_can_see_it(est, learnable):
    p = PerturbedPredictor(est.__class__(est.model, est.hardware, est.calibration.model_copy(deep=True),
                                         est.contention, est.dtype), 0.10, seed=4, learnable=learnable)
    lens, units = [1200] * 24, 54
    truth = est.decode_time_for(lens, units)  # what the simulated device charges (without noise)
    first = abs(p.decode_time_for(lens, units) / truth - 1)
    assert first > 0.01  # this region starts wrong
    for _ in range(40):
        p.observe_decode(lens, units, truth)
    last = abs(p.decode_time_for(lens, units) / truth - 1)
    if learnable:
        assert last < 0.01 < first
    else:
        assert last == pytest.approx(first, rel=1e-6)
