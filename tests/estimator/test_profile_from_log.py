"""The H200 profile rebuilt from its printed log: the shipped file is what the converter makes of the
shipped log, keeps its provenance, reproduces the steps the log printed, and the simulator runs that
device when given it."""

from __future__ import annotations

import json

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.sim.config import device_estimator, measured_contention, step_overhead
from estimator.profile import EstimatorProfile
from estimator.profiler.from_log import parse_case, parse_log
from estimator.profiler.prediction_errors import predict
from estimator.reference.profiles import H200_LOG, H200_LOG_PROFILE, h200_profile


@pytest.fixture(scope="module")
def profile() -> EstimatorProfile:
    return EstimatorProfile.read(H200_LOG_PROFILE)


def test_shipped_profile_is_the_conversion_of_the_shipped_log(profile):
    regenerated = json.loads(json.dumps(h200_profile().model_dump(mode="json")))
    assert json.loads(H200_LOG_PROFILE.read_text()) == regenerated, (
        "h200-llama-3.1-8b-green-ctx.json is stale: run `python -m estimator.reference.profiles --h200`")


def test_labels_and_lines_as_the_profiler_prints_them():
    assert parse_case("prefill[512+512]") == {"kind": "prefill", "prefill_lens": (512, 512), "num_layers": None,
                                              "include_head": True}
    assert parse_case("prefill[2048] x4L")["num_layers"] == 4
    assert parse_case("decode[32x1024]") == {"kind": "decode", "decode_batch": 32, "decode_context": 32768}
    with pytest.raises(ValueError):
        parse_case("decode[32]")
    flops, bandwidth, sweeps, phases = parse_log(H200_LOG.read_text().splitlines())
    assert flops == {24: 166e12, 40: 270e12, 72: 480e12, 132: 793e12}
    assert bandwidth[132] == pytest.approx(4203e9)
    assert len(sweeps) == 20 and ("decode[128x512]", 132, pytest.approx(3.78e-3)) in sweeps
    beside = [s for s in phases if s.co_running]
    assert len(phases) == 48 and len(beside) == 16
    assert {s.co_running for s in beside if s.kind == "decode"} == {512, 2048}  # prefill tokens beside
    assert {s.co_running for s in beside if s.kind == "prefill"} == {32, 128}  # decode batch beside


def test_provenance_and_what_was_filled_in(profile):
    assert profile.provenance.torch_version == "2.11.0+cu130" and profile.provenance.measured_at.startswith("2026-11-26")
    notes = " ".join(profile.notes)
    for fact in ("H200", "580.159.04", "CUDA 13.0", "green-ctx", "MPS", "bf16", "not in the log"):
        assert fact in notes
    hw = profile.hardware
    assert hw.units == 132 and hw.measured_bandwidth[131] == pytest.approx(4203e9)
    assert hw.partition_sizes()[:3] == [8, 16, 24] and hw.partition_sizes()[-1] == 132


def test_the_fit_reproduces_the_printed_steps(profile):
    """Solo steps as printed (alpha by size goes through them; prefill of 2048 tokens averages three
    states of one size), steps beside the other phase within 20 % (one contention entry per share and
    prefill length, fitted over two decode batches)."""
    est = profile.estimator()
    solo = [abs(predict(est, s) / s.seconds - 1) for s in profile.calibration.samples if s.kind in ("prefill", "decode")]
    beside = [abs(predict(est, s) / s.seconds - 1) for s in profile.contention.samples]
    assert len(solo) == 32 and max(solo) < 0.05
    assert len(beside) == 16 and max(beside) < 0.20


def test_the_simulator_runs_the_profiled_device(profile):
    config = SimConfig(policy="bullet", estimator_profile=str(H200_LOG_PROFILE), noise=0.0, max_total_tokens=131072)
    device = device_estimator(config)
    assert device.hardware.name == "NVIDIA H200 (green-ctx)" and device.model.name == profile.model.name
    assert step_overhead(config, device) == 0.0  # the timed steps already hold what ran outside the kernels
    assert measured_contention(device)
    with pytest.raises(ValueError, match="leave --hardware out"):
        device_estimator(SimConfig(estimator_profile=str(H200_LOG_PROFILE), hardware="a100"))
    sim = Simulation(config, [(0.0, 1000, 64)])
    assert sim.allocator.total_pages * sim.allocator.page_size == 131072
    record = sim.run().records[0]
    # one request alone: prefill on every SM, then decode steps on every SM, as the profile predicts them
    assert record.ttft == pytest.approx(device.prefill_time([1000], 132), rel=0.02)
    step = device.decode_time(1, 1001 + 32, 132)
    assert record.tpot == pytest.approx(step, rel=0.05)
