"""The estimator the policies call: fast path = kernel-by-kernel model, units, layers, contention,
online refinement, persistence, cost."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.calibration import PHASES, Calibration
from estimator.contention import ContentionModel
from estimator.estimator import Estimator
from estimator.ops import ExecutionState
from estimator.profile import EstimatorProfile
from estimator.profile import load_estimator, save_estimator
from estimator.reference.data import A100_LLAMA3_8B_DECODE_MS, A100_LLAMA3_8B_PREFILL_MS
from estimator.reference.profiles import SHIPPED_PROFILE


@pytest.fixture(scope="module")
def shipped() -> Estimator:
    return load_estimator(SHIPPED_PROFILE)


@pytest.fixture(scope="module")
def kernel_level(shipped) -> Estimator:
    """The shipped profile without its end-to-end (phase) samples: what `breakdown` describes."""
    samples = [s for s in shipped.calibration.samples if s.kind not in PHASES]
    return Estimator(shipped.model, shipped.hardware, Calibration(samples=samples))


def slow_prefill(est: Estimator, seq_lens, units, layers=None, head=True):
    rows = est.breakdown(ExecutionState(prefill_lens=tuple(seq_lens)), units)
    layer = sum(t for name, _, t in rows[:-3])
    return layer * (layers if layers is not None else est.model.num_hidden_layers) + (
        sum(t for _, _, t in rows[-3:]) if head else 0.0)


def slow_decode(est: Estimator, ctx, units, scale=1.0):
    rows = est.breakdown(ExecutionState(decode_ctx_lens=tuple(ctx)), units, scale)
    return sum(t for _, _, t in rows[:-3]) * est.model.num_hidden_layers + sum(t for _, _, t in rows[-3:])


@settings(max_examples=60, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 9000), min_size=1, max_size=5), units=st.integers(1, 54).map(lambda u: 2 * u),
       layers=st.one_of(st.none(), st.integers(1, 32)), head=st.booleans())
def test_fast_prefill_equals_kernel_by_kernel(kernel_level, seq_lens, units, layers, head):
    fast = kernel_level.prefill_time(seq_lens, units, num_layers=layers, include_head=head)
    assert fast == pytest.approx(slow_prefill(kernel_level, seq_lens, units, layers, head), rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(ctx=st.lists(st.integers(1, 8000), min_size=1, max_size=80), units=st.integers(1, 108))
def test_fast_decode_equals_kernel_by_kernel(kernel_level, shipped, ctx, units):
    assert kernel_level.decode_time_for(ctx, units) == pytest.approx(slow_decode(kernel_level, ctx, units), rel=1e-9)
    assert shipped.decode_time(len(ctx), sum(ctx), units) == shipped.decode_time_for(ctx, units)


def test_phase_samples_scale_the_kernel_level_prediction(kernel_level, shipped):
    """Decode phase samples at batch 1 and 128: alpha interpolated in log(batch) between them."""
    ratios = [shipped.decode_time(b, b * 1024, 108) / kernel_level.decode_time(b, b * 1024, 108)
              for b in (1, 2, 8, 32, 128, 512)]
    assert ratios[0] != ratios[-2] and ratios[-1] == pytest.approx(ratios[-2])  # flat past the last sample
    low, high = sorted((ratios[0], ratios[-2]))
    assert all(low * (1 - 1e-12) <= r <= high * (1 + 1e-12) for r in ratios)


def test_more_units_never_slower(shipped):
    for units_a, units_b in zip(range(2, 108, 2), range(4, 110, 2)):
        assert shipped.prefill_time([1500, 700], units_a) >= shipped.prefill_time([1500, 700], units_b)
        assert shipped.decode_time(48, 48 * 1500, units_a) >= shipped.decode_time(48, 48 * 1500, units_b)


def test_decode_saturates_while_prefill_keeps_scaling(shipped):
    """Bullet Fig. 3: decode gains little past the bandwidth inflection, prefill keeps gaining."""
    decode_gain = shipped.decode_time(32, 32 * 1024, 54) / shipped.decode_time(32, 32 * 1024, 108)
    prefill_gain = shipped.prefill_time([4096], 54) / shipped.prefill_time([4096], 108)
    assert decode_gain < 1.1 and prefill_gain > 1.8


def test_layers_and_head_add_up(shipped):
    whole = shipped.prefill_time([3000], 64)
    per_layer = shipped.prefill_time([3000], 64, num_layers=1, include_head=False)
    head = whole - shipped.prefill_time([3000], 64, include_head=False)
    assert whole == pytest.approx(32 * per_layer + head)
    assert 0 < head < per_layer


def test_against_numbers_md_end_to_end(shipped):
    """numbers.md totals (linear + attention, no LM head), Llama-3-8B on A100, all 108 SMs."""
    for tokens, ms in A100_LLAMA3_8B_PREFILL_MS.items():  # none of these is a sample
        assert 1e3 * shipped.prefill_time([tokens], 108, include_head=False) == pytest.approx(ms, rel=0.1)
    for (batch, ctx), ms in A100_LLAMA3_8B_DECODE_MS.items():  # batch 1 and 128 are phase samples
        assert 1e3 * shipped.decode_time(batch, batch * ctx, 108, include_head=False) == pytest.approx(ms, rel=0.05)


def test_contention_slows_decode_and_prefill(llama3_8b, a100):
    contention = ContentionModel()
    contention.add_bandwidth(54, 512, 0.9)
    contention.add_bandwidth(54, 8192, 0.6)
    contention.add_slowdown(64, 1.05)
    est = Estimator(llama3_8b, a100, contention=contention)
    alone = est.decode_time(64, 64 * 2000, 54)
    assert est.decode_time(64, 64 * 2000, 54, co_prefill_tokens=8192) == pytest.approx(
        slow_decode(est, [2000] * 64, 54, 0.6), rel=1e-9)
    assert alone < est.decode_time(64, 64 * 2000, 54, co_prefill_tokens=512) < est.decode_time(
        64, 64 * 2000, 54, co_prefill_tokens=8192)
    assert est.prefill_time([2048], 54, co_decode_batch=64) == pytest.approx(1.05 * est.prefill_time([2048], 54))


def test_contention_table_interpolates_in_log_prefill_length():
    model = ContentionModel()
    model.add_bandwidth(20, 1000, 0.9)
    model.add_bandwidth(20, 100000, 0.5)
    assert model.decode_bandwidth_fraction(0, 20) == 1.0
    assert model.decode_bandwidth_fraction(500, 20) == pytest.approx(0.95)  # from 1.0 at sl = 0
    assert model.decode_bandwidth_fraction(10000, 20) == pytest.approx(0.7)
    assert model.decode_bandwidth_fraction(10 ** 7, 20) == pytest.approx(0.5)
    assert model.decode_bandwidth_fraction(10000, 100) == pytest.approx(0.7)  # nearest profiled units


def test_online_refinement_moves_toward_observations(llama3_8b, a100):
    est = Estimator(llama3_8b, a100)
    before = est.decode_time(16, 16 * 900, 30)
    prefill_before = est.prefill_time([1024], 78)
    errors = []
    for _ in range(16):
        est.observe_decode([900] * 16, 30, 1.3 * before)
        errors.append(abs(est.decode_time(16, 16 * 900, 30) - 1.3 * before))
    assert all(b <= a for a, b in zip(errors, errors[1:])) and errors[-1] < 0.01 * before
    # neighbours borrow the phase-level correction; prefill is untouched
    assert est.decode_time(20, 20 * 900, 80) > Estimator(llama3_8b, a100).decode_time(20, 20 * 900, 80) * 1.2
    assert est.prefill_time([1024], 78) == prefill_before
    est.observe_prefill([1024], 78, 0.5 * prefill_before)
    # one observation moves the prediction a quarter of the way (EWMA weight 0.25)
    assert est.prefill_time([1024], 78) == pytest.approx(0.875 * prefill_before)


def test_save_load_round_trip(tmp_path, shipped):
    est = Estimator(shipped.model, shipped.hardware, shipped.calibration.model_copy(deep=True),
                    ContentionModel(decode_bandwidth=[{"units": 40, "prefill_tokens": 4096, "fraction": 0.8}]))
    est.observe_decode([1000] * 8, 40, 0.02)
    path = tmp_path / "profile.json"
    save_estimator(est, path)
    data = json.loads(path.read_text())
    assert data["format"] == "bullet-estimator-profile" and data["version"] == 1
    assert {"model", "hardware", "calibration", "contention"} <= set(data)
    back = load_estimator(path)
    for state in ([100, 2000], [7000]):
        assert back.prefill_time(state, 50) == est.prefill_time(state, 50)
    assert back.decode_time(8, 8000, 40, co_prefill_tokens=4096) == est.decode_time(8, 8000, 40, co_prefill_tokens=4096)
    assert EstimatorProfile.read(path) == EstimatorProfile.from_estimator(est)


def test_load_refuses_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not an estimator profile"):
        load_estimator(path)


def test_bad_arguments(shipped):
    with pytest.raises(ValueError):
        shipped.decode_time(-1, 2, 10)
    with pytest.raises(ValueError):
        shipped.prefill_time([100], 0)
    with pytest.raises(ValueError):
        shipped.decode_time_for([100], 109)
    assert shipped.prefill_time([], 10) == 0.0 and shipped.decode_time_for([], 10) == 0.0


def test_hybrid_step_costs_more_than_either_part(shipped):
    hybrid = ExecutionState(prefill_lens=(1024,), decode_ctx_lens=(2000,) * 32)
    step = shipped.step_time(hybrid, 108)
    assert step > shipped.prefill_time([1024], 108) and step > shipped.decode_time_for([2000] * 32, 108)


def test_prediction_is_cheap(shipped):
    """Paper: 10.2 us mean. Loose bound here (shared 2-core machine); the benchmark measures it."""
    ctx = (64, 64 * 1800)
    shipped.decode_time_for(ctx, 54)
    start = time.perf_counter()
    for units in range(2000):
        shipped.decode_time_for(ctx, 2 + units % 100)
        shipped.prefill_time([900, 1200, 64, 3000], 2 + units % 100, num_layers=4, include_head=False)
    assert (time.perf_counter() - start) / 4000 < 60e-6


def test_a_fresh_calibration_is_the_raw_roofline(llama3_8b, a100):
    est = Estimator(llama3_8b, a100, Calibration())
    rows = est.breakdown(ExecutionState(prefill_lens=(256,)), 108)
    assert all(srm == calibrated for _, srm, calibrated in rows)


def test_a_lone_spike_is_not_learnt_a_lasting_shift_is(llama3_8b, a100):
    """An observation 3x off the current correction waits for the next one: a one-off (an H200's
    first step of a new prompt length: 10x) is dropped, two in a row the same way are both folded."""
    est = Estimator(llama3_8b, a100)
    base = est.prefill_time([1024], 78)
    online = est.calibration.online
    est.observe_prefill([1024], 78, 10 * base)  # held
    assert est.prefill_time([1024], 78) == base
    est.observe_prefill([1024], 78, 1.2 * base)  # not confirmed: the spike is dropped, this one folded
    assert est.prefill_time([1024], 78) == pytest.approx(1.05 * base) and online.spikes_held == 1
    est.observe_prefill([1024], 78, 0.1 * base)  # held (the other way)
    est.observe_prefill([1024], 78, 10 * base)  # the other direction: drops the held one, holds itself
    assert est.prefill_time([1024], 78) == pytest.approx(1.05 * base) and online.spikes_held == 2
    est.observe_prefill([1024], 78, 10 * base)  # confirmed: both folded, in order
    after_one = 1.05 + 0.25 * (10 - 1.05)
    assert est.prefill_time([1024], 78) == pytest.approx((after_one + 0.25 * (10 - after_one)) * base)
    # phases are held apart: a decode spike does not confirm a prefill one
    est.calibration.online.reset()
    est.observe_prefill([1024], 78, 10 * base)
    decode = est.decode_time(16, 16 * 900, 30)
    est.observe_decode([900] * 16, 30, 10 * decode)
    assert est.prefill_time([1024], 78) == base and est.decode_time(16, 16 * 900, 30) == decode


def test_co_run_steps_learn_apart_from_solo_steps(llama3_8b, a100):
    """A step beside the other worker's corrects co-run predictions only, starting from the solo
    correction of its state: a co-run that costs twice its price does not make solo steps look slow,
    and solo steps' error still reaches co-run predictions that have not been observed."""
    est = Estimator(llama3_8b, a100)
    solo, co = est.decode_time(16, 16 * 900, 30), est.decode_time(16, 16 * 900, 30, co_prefill_tokens=2048)
    est.observe_decode([900] * 16, 30, 1.2 * solo)  # solo: 1.05
    assert est.decode_time(16, 16 * 900, 30, co_prefill_tokens=2048) == pytest.approx(1.05 * co)  # borrowed
    est.observe_decode([900] * 16, 30, 2.0 * co, co_prefill_tokens=2048)  # from 1.05, a quarter of the way to 2
    assert est.decode_time(16, 16 * 900, 30, co_prefill_tokens=2048) == pytest.approx((1.05 + 0.25 * 0.95) * co)
    assert est.decode_time(16, 16 * 900, 30) == pytest.approx(1.05 * solo)  # solo untouched
    for _ in range(20):
        est.observe_decode([900] * 16, 30, 2.0 * co, co_prefill_tokens=2048)
    assert est.decode_time(16, 16 * 900, 30, co_prefill_tokens=2048) == pytest.approx(2.0 * co, rel=0.01)
    assert list(est.decode_times(16, 16 * 900, [30], co_prefill_tokens=2048)) == [
        est.decode_time(16, 16 * 900, 30, co_prefill_tokens=2048)]  # the batched form agrees
    assert est.decode_time(16, 16 * 900, 30) == pytest.approx(1.05 * solo)
    # the same for prefill beside a decode batch; a prefill worker's estimator that only saw co-runs corrects
    p_co = est.prefill_time([1024], 78, co_decode_batch=16)
    p_solo = est.prefill_time([1024], 78)
    est.observe_prefill([1024], 78, 1.8 * p_co, co_decode_batch=16)
    assert est.prefill_time([1024], 78, co_decode_batch=16) == pytest.approx(1.2 * p_co)
    assert list(est.prefill_times([1024], [78], co_decode_batch=16)) == [pytest.approx(1.2 * p_co)]
    assert est.prefill_time([1024], 78) == p_solo
