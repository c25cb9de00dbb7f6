"""The CPU probe measures this machine (tiny sizes here: the shape of the result, not its accuracy)."""

from __future__ import annotations

import os

import pytest
import torch

from estimator.estimator import Estimator
from estimator.profiler.cpu_probe import ProbeSizes, allowed_cores, measure_contention, pinned, probe_cpu

TINY = ProbeSizes(gemm_n=128, matrix_mb=8, min_seconds=0.01)


def test_probe_describes_the_allowed_cores(tmp_path):
    cores = allowed_cores()
    spec = probe_cpu(sizes=TINY, progress=False)
    assert spec.kind == "cpu" and spec.units == len(cores) and spec.unit_name == "core"
    assert len(spec.measured_bandwidth) == spec.units and len(spec.measured_flops["fp32"]) == spec.units
    assert all(rate > 1e8 for rate in spec.measured_flops["fp32"] + spec.measured_bandwidth)
    assert 1.0 <= spec.bandwidth_inflection <= spec.units
    assert 0 < spec.kernel_overhead_s < 1e-3 and not spec.wave_quantization
    path = tmp_path / "cpu.json"
    spec.to_json(path)
    assert type(spec).from_json(path) == spec


def test_pinning_is_restored():
    before_cores, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    with pinned(allowed_cores()[:1]):
        assert len(os.sched_getaffinity(0)) == 1 and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before_cores and torch.get_num_threads() == before_threads


def test_an_estimator_runs_on_the_probed_cpu():
    from engines.model_config import ModelConfig

    spec = probe_cpu(sizes=TINY, progress=False)
    est = Estimator(ModelConfig.builtin("smollm2-135m"), spec, dtype="fp32")
    one = est.decode_time_for([300] * 4, 1)
    assert one > 0 and est.prefill_time([200], spec.units) > 0
    est.add_sample("decode", 2 * one, 1, decode_batch=4, decode_context=1200)
    assert est.decode_time_for([300] * 4, 1) == pytest.approx(2 * one)


@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs two cores")
def test_contention_probe_fills_the_table():
    cores = allowed_cores()
    model = measure_contention(cores[:1], cores[1:2], prefill_tokens=(256,), hidden=512, sizes=TINY, progress=False)
    assert len(model.decode_bandwidth) == 1
    point = model.decode_bandwidth[0]
    assert point.units == 1 and point.prefill_tokens == 256 and 0 < point.fraction <= 1
    assert 0 < model.decode_bandwidth_fraction(256, 1) <= 1
