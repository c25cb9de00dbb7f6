"""Runs a GPU `ProfilePlan`: kernel sweeps and end-to-end steps on every profiled SM share, then each
phase beside the other on complementary shares. Returns calibration samples in the same form as the
CPU profile, so the same Eq. 2 code (`fit.build_estimator`) calibrates both.

Everything GPU-specific is passed in — the share control (the partition backend), the timer (CUDA
events), the co-runner (a second process looping the other phase) and how a decode step runs (eager,
or graph replays where the backend allows them) — so the plan logic runs under test with fakes.

Unlike the CPU sweep, kernel sweeps are not scaled to the end-to-end step: on a GPU the kernels are
timed without launch gaps, and what a step adds to its kernels (Python, launches) is the per-phase
residual the calibration fits from the end-to-end samples."""

from __future__ import annotations

from typing import Callable, ContextManager, Protocol

from estimator.calibration import Sample
from estimator.profiler.cuda_ops import op_times
from estimator.profiler.cuda_shares import ShareControl, corun_splits, profiled_shares
from estimator.profiler.cuda_timing import GpuTimer
from estimator.profiler.plan import ProfilePlan
from estimator.profiler.session import op_samples, phase_sample, role_of
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase, uniform_decode

Case = PrefillCase | DecodeCase
StepFactory = Callable[[Case], Callable[[], object]]


class OtherPhase(Protocol):
    """Keeps a step of the other phase running on its share while a block runs (`cuda_corun`)."""

    def looping(self, role: str, units: int, case: Case) -> ContextManager: ...


def run_cuda_plan(bench: ModelBench, shares: ShareControl, timer: GpuTimer, plan: ProfilePlan,
                  step_for: StepFactory | None = None, other: OtherPhase | None = None,
                  log: Callable[[str], None] = lambda _: None) -> tuple[list[Sample], list[str]]:
    """Samples of every measurement of `plan` and notes. `step_for(case)`: the callable a worker
    would run for that step (default: the bench's eager step). Without `other`, contention is not
    measured (the notes say so)."""
    step_for = step_for or bench.step
    quick = plan.name == "quick"
    units_of = {role: profiled_shares(shares.feasible(role), quick) for role in ("prefill", "decode")}
    samples: list[Sample] = []
    notes: list[str] = []
    for case in plan.sweeps:
        role = role_of(case)
        for units in units_of[role]:
            with shares.use(role, units):
                times = op_times(bench, case, timer.kernels)
            samples += op_samples(case, units, times)
            log(f"kernels of {case.label()} on {units} SMs: {sum(times.values()) * 1e3:.2f} ms per layer-set")
    for case in plan.steps:
        role = role_of(case)
        for units in units_of[role]:
            with shares.use(role, units):  # the step's inputs are made on the share's stream too
                seconds = timer.step(step_for(case))
            samples.append(phase_sample(case, units, seconds))
            log(f"{case.label()} on {units} SMs: {seconds * 1e3:.2f} ms")
    if other is None:
        notes.append("contention not measured (no co-running process): the estimator assumes none")
        return samples, notes
    splits = corun_splits(shares.feasible("prefill"), shares.feasible("decode"))
    if not splits:
        notes.append("contention not measured: no two disjoint shares fit this device")
    for prefill_units, decode_units in splits:
        for tokens in plan.corun_prefill_lengths:
            with other.looping("prefill", prefill_units, PrefillCase((tokens,))):
                for case in plan.corun_decode_cases:
                    with shares.use("decode", decode_units):
                        seconds = timer.step(step_for(case))
                    samples.append(phase_sample(case, decode_units, seconds, co_running=tokens))
                    log(f"{case.label()} on {decode_units} SMs beside prefill[{tokens}]: {seconds * 1e3:.2f} ms")
        for batch in plan.corun_decode_batches:
            decode = uniform_decode(batch, plan.corun_decode_context)
            with other.looping("decode", decode_units, decode):
                for case in plan.corun_prefill_cases:
                    with shares.use("prefill", prefill_units):
                        seconds = timer.step(step_for(case))
                    samples.append(phase_sample(case, prefill_units, seconds, co_running=batch))
                    log(f"{case.label()} on {prefill_units} SMs beside {decode.label()}: {seconds * 1e3:.2f} ms")
    return samples, notes
