"""Hybrid steps (a prompt chunk beside decode rows, as the chunked baselines run) as measured phase
samples: the bench runs one through the real runner, a profile's hybrid samples calibrate
`Estimator.hybrid_step_time` for steps of both kinds and leave decode-only and prompt-only steps (and
every other prediction) to their own phases."""

from __future__ import annotations

import pytest
import torch

from engines.weights.dummy import dummy_weights
from estimator.calibration import Sample
from estimator.estimator import Estimator
from estimator.profiler.fit import build_estimator
from estimator.profiler.plan import ProfilePlan, calibration_keys, gpu_plan
from estimator.profiler.prediction_errors import predict
from estimator.profiler.session import phase_sample, role_of
from estimator.profiler.workload import HybridCase, ModelBench, PrefillCase, kv_tokens_needed, uniform_decode
from tests.estimator.test_local_profile import two_core_cpu
from tests.partition.tiny_model import CONFIG

HYBRID = HybridCase((40,), uniform_decode(3, 30))


def test_a_hybrid_step_runs_through_the_runner_and_samples_its_shape():
    bench = ModelBench(CONFIG, dummy_weights(CONFIG, torch.float32), kv_tokens_needed([HYBRID]), torch.float32)
    chunks = bench.chunks(HYBRID)
    assert [len(c.token_ids) for c in chunks] == [40, 1, 1, 1] and [c.start for c in chunks] == [0, 29, 29, 29]
    pages = [p for c in chunks for p in c.page_table]
    assert len(pages) == len(set(pages))  # the prompt and the decode rows own distinct pages
    bench.step(HYBRID)()  # runs (a prompt of 40 and three decode rows in one forward)
    sample = phase_sample(HYBRID, 2, 0.01)
    assert (sample.kind, sample.prefill_lens, sample.decode_batch, sample.decode_context) == ("hybrid", (40,), 3, 90)
    assert role_of(HYBRID) == "prefill" and HYBRID.label() == "hybrid[40 + decode[3x30]]"


def test_every_plan_measures_hybrid_steps():
    for plan in (ProfilePlan.quick(), ProfilePlan.full(), gpu_plan(True), gpu_plan(False)):
        hybrids = [c for c in plan.steps if isinstance(c, HybridCase)]
        assert len(hybrids) >= 2, plan.name
        assert {("hybrid", c.chunk_lens, tuple(sorted(c.decode.context_lens))) for c in hybrids} <= calibration_keys(plan)


def test_a_cpu_profile_times_hybrid_steps_on_every_core_only():
    """The chunked baselines run on every core of the server: a hybrid step on fewer prices nothing."""
    from estimator.profiler.sweep import _jobs

    plan = ProfilePlan.quick()
    jobs = _jobs(None, plan, [0, 1, 2])
    hybrid_units = {units for _, case, units, _, _ in jobs if isinstance(case, HybridCase)}
    prefill_units = {units for group, case, units, _, _ in jobs if group.startswith("step") and isinstance(case, PrefillCase)}
    assert hybrid_units == {3} and prefill_units == {1, 2, 3}
    hybrids = {case for _, case, _, _, _ in jobs if isinstance(case, HybridCase)}
    assert hybrids == {c for c in plan.steps if isinstance(c, HybridCase)}


def _samples(model, hw, hybrid_factor: float) -> list[Sample]:
    """Phase samples of a "true" device: the raw model's steps, hybrid ones `hybrid_factor` slower
    than the decode calibration alone would say (the extra cost of mixing the two in one step)."""
    raw = Estimator(model, hw)
    out = []
    for units in (1, 2):
        for n in (32, 256):
            out.append(Sample(kind="prefill", units=units, seconds=raw.prefill_time([n], units) * 1.3, prefill_lens=(n,)))
        for b, c in ((1, 128), (16, 512)):
            out.append(Sample(kind="decode", units=units, seconds=raw.decode_time(b, b * c, units) * 1.2,
                              decode_batch=b, decode_context=b * c))
        for case in (HybridCase((256,), uniform_decode(8, 512)), HybridCase((512,), uniform_decode(24, 512))):
            kernels = raw.hybrid_step_time([(n, 0) for n in case.chunk_lens], case.decode.batch,
                                           case.decode.total_context, units)
            out.append(phase_sample(case, units, kernels * hybrid_factor))
    return out


def test_hybrid_samples_calibrate_mixed_steps_only():
    from tests.estimator.test_local_profile import TINY_HF_CONFIG
    from engines.model_config import ModelConfig

    model, hw = ModelConfig.from_hf_dict(TINY_HF_CONFIG, name="tiny"), two_core_cpu()
    samples = _samples(model, hw, 1.7)
    with_hybrid = build_estimator(model, hw, "bf16", samples)
    without = build_estimator(model, hw, "bf16", [s for s in samples if s.kind != "hybrid"])
    for s in (s for s in samples if s.kind == "hybrid"):  # the measured mixed steps are predicted as measured
        assert predict(with_hybrid, s) == pytest.approx(s.seconds, rel=0.02)
        assert predict(without, s) < 0.85 * s.seconds  # borrowing decode's calibration misses the mixing cost
    # a mixed step it never measured: the same residual
    chunks, b, ctx = [(128, 0)], 12, 12 * 400
    raw = Estimator(model, hw).hybrid_step_time(chunks, b, ctx, 2)
    assert with_hybrid.hybrid_step_time(chunks, b, ctx, 2) == pytest.approx(raw * 1.7, rel=0.02)
    # decode-only and prompt-only steps, and the two-worker predictions, are untouched by the hybrid samples
    assert with_hybrid.hybrid_step_time([], 16, 16 * 300, 2) == without.hybrid_step_time([], 16, 16 * 300, 2)
    assert with_hybrid.hybrid_step_time([(300, 0)], 0, 0, 1) == without.hybrid_step_time([(300, 0)], 0, 0, 1)
    assert with_hybrid.decode_time(16, 16 * 300, 2) == without.decode_time(16, 16 * 300, 2)
    assert with_hybrid.prefill_time([300], 1) == without.prefill_time([300], 1)
