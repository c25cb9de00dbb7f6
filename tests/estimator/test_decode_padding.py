"""The profiler's decode-padding probe: its three steps, its verdict, and the verdict reaching the GPU
profile (against a synthetic GPU that pads and one that does not) and a profile rebuilt from a log."""

from __future__ import annotations

from dataclasses import replace

import pytest

from estimator.profiler.cuda_sweep import run_cuda_plan
from estimator.profiler.from_log import padding_in_log
from estimator.profiler.padding import decide_padding, padding_cases
from estimator.profiler.plan import ProfilePlan, gpu_plan
from estimator.profiler.workload import DecodeCase, PrefillCase, uniform_decode
from tests.estimator.test_gpu_profiler import H100_GREEN, FakeOther, FakeShares, TrueGpuTimer, bench, tagged_steps  # noqa: F401


def test_the_three_steps_share_a_batch_and_the_ragged_one_spans_a_quarter_to_all():
    ragged, mean, longest = padding_cases(16, 512)
    assert ragged.batch == mean.batch == longest.batch == 16
    assert min(ragged.context_lens) == 128 and max(ragged.context_lens) == 512
    assert list(ragged.context_lens) == sorted(ragged.context_lens)
    assert abs(mean.total_context - ragged.total_context) <= 16  # the same KV read, up to rounding
    assert longest == uniform_decode(16, 512)
    with pytest.raises(ValueError, match="at least 2 requests"):
        padding_cases(1, 512)


@pytest.mark.parametrize("ragged_ms, padded, words", [
    (10.2, False, "own context"),  # ragged costs what the mean does
    (14.5, True, "padded to the longest"),  # ragged costs what the longest does
    (11.9, False, "own context"),  # less than halfway
    (12.1, True, "padded to the longest"),  # more than halfway
])
def test_the_verdict_is_the_nearer_of_mean_and_longest(ragged_ms, padded, words):
    verdict = decide_padding(ragged_ms / 1e3, 10e-3, 14e-3, "decode[16x128..512] on 132 SMs")
    assert verdict.padded is padded and words in verdict.note
    assert "ragged" in verdict.note and "decode[16x128..512]" in verdict.note
    assert padding_in_log(["x", verdict.note]) is padded  # what from_log reads back


def test_a_step_that_context_hardly_changes_is_priced_by_summed_context():
    verdict = decide_padding(10.4e-3, 10e-3, 10.3e-3)
    assert not verdict.padded and "hardly" in verdict.note
    assert padding_in_log(["24 SMs: 166 TFLOP/s, 1771 GB/s;"]) is None  # a log from before the probe


class PaddingGpuTimer(TrueGpuTimer):
    """The synthetic GPU, with a decode kernel that reads every row up to the batch's longest context."""

    def step(self, run) -> float:
        case = run.case
        if isinstance(case, DecodeCase):
            run = tagged_steps(uniform_decode(case.batch, max(case.context_lens)))
        return super().step(run)


def _small_plan() -> ProfilePlan:
    decode = uniform_decode(8, 256)
    return replace(gpu_plan(quick=True), sweeps=(PrefillCase((512,)),), steps=(PrefillCase((512,)), decode),
                   corun_prefill_lengths=(), corun_decode_batches=())


@pytest.mark.parametrize("timer_class, padded", [(TrueGpuTimer, False), (PaddingGpuTimer, True)])
def test_the_gpu_profile_measures_padding_on_decodes_largest_share(bench, timer_class, padded):  # noqa: F811
    shares = FakeShares(H100_GREEN)
    lines: list[str] = []
    samples, notes, measured = run_cuda_plan(bench, shares, timer_class(shares, FakeOther()), _small_plan(),
                                             step_for=tagged_steps, log=lines.append)
    assert measured is padded
    assert padding_in_log(lines) is padded  # the verdict is in the log a server prints
    probe = [u for role, u in shares.entered if role == "decode"][-3:]
    assert probe == [132, 132, 132]  # decode's largest share
    # the two uniform steps are calibration samples like any other; the ragged one is not
    decodes = {(s.decode_batch, s.decode_context) for s in samples if s.kind == "decode" and s.units == 132}
    ragged, mean, longest = padding_cases(32, 2048)
    assert decodes == {(8, 8 * 256), (32, mean.total_context), (32, longest.total_context)}


def test_a_plan_without_the_probe_measures_no_padding(bench):  # noqa: F811
    shares = FakeShares([132])
    _, notes, measured = run_cuda_plan(bench, shares, TrueGpuTimer(shares, FakeOther()),
                                       replace(_small_plan(), padding_batch=0), step_for=tagged_steps)
    assert measured is None and not any("decode attention" in n for n in notes)
