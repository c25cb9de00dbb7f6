"""Runs a GPU `ProfilePlan`: kernel sweeps and end-to-end steps on every profiled SM share, then each
phase beside the other on complementary shares, and each on every SM beside the other on every SM
(`_on_shared_units`). Returns calibration samples in the same form as the CPU profile, so the same
Eq. 2 code (`fit.build_estimator`) calibrates both.

Every measurement goes through the profiler's one measuring core (`session.MeasuringSession`), on
the GPU's backends, all passed in — the share control (the partition backend), the timer (CUDA
events, `cuda_timing.CudaTimer`), the co-runner (a second process looping the other phase,
`corun.CoRunner`) and how a decode step runs (eager, or graph replays where the backend allows
them) — so the plan logic runs under test with fakes.

Unlike the CPU sweep, kernel sweeps are not scaled to the end-to-end step: on a GPU the kernels are
timed without launch gaps, and what a step adds to its kernels (Python, launches) is the per-phase
residual the calibration fits from the end-to-end samples."""

from __future__ import annotations

from typing import Callable, ContextManager, Protocol

from estimator.calibration import Sample
from estimator.profiler.cuda_timing import CudaTimer, GpuTimer
from estimator.profiler.padding import measure_padding
from estimator.profiler.plan import ProfilePlan
from estimator.profiler.session import Beside, MeasuringSession, role_of
from estimator.profiler.shares import ShareControl, corun_splits, profiled_shares
from estimator.profiler.workload import DecodeCase, HybridCase, ModelBench, PrefillCase, uniform_decode

Case = PrefillCase | DecodeCase | HybridCase
StepFactory = Callable[[Case], Callable[[], object]]


class OtherPhase(Protocol):
    """Keeps a step of the other phase running on its share while a block runs (`corun.CoRunner`)."""

    def looping(self, role: str, units: int, case: Case) -> ContextManager: ...


def run_cuda_plan(bench: ModelBench, shares: ShareControl, timer: GpuTimer, plan: ProfilePlan,
                  step_for: StepFactory | None = None, other: OtherPhase | None = None,
                  log: Callable[[str], None] = lambda _: None) -> tuple[list[Sample], list[str], bool | None]:
    """Samples of every measurement of `plan`, notes, and whether decode attention pads to the
    longest context (`padding`, on decode's largest share; None: not measured). `step_for(case)`: the
    callable a worker would run for that step (default: the bench's eager step). Without `other`,
    contention is not measured (the notes say so)."""
    quick = plan.name == "quick"
    units_of = {role: profiled_shares(shares.feasible(role), quick) for role in ("prefill", "decode")}
    session = MeasuringSession(bench, shares, CudaTimer(timer), step_for, log)
    samples: list[Sample] = []
    notes: list[str] = []
    for case in plan.sweeps:
        for units in units_of[role_of(case)]:
            samples += session.sweep(case, units, plan.sweep_repeats).samples
    for case in plan.steps:
        shares_of_case = units_of[role_of(case)]
        if isinstance(case, HybridCase):  # the chunked baselines' step: they run on the whole device
            shares_of_case = shares_of_case[-1:]
        for units in shares_of_case:
            samples += session.step(case, units, plan.repeats).samples
    padded = None
    if plan.padding_batch:
        verdict, uniform = measure_padding(session, units_of["decode"][-1], plan.repeats, plan.padding_batch,
                                           plan.padding_context)
        samples += uniform
        padded = verdict.padded
        log(verdict.note)  # `from_log.padding_in_log` reads it back from a server's log
        notes.append(verdict.note)
    if other is None:
        notes.append("contention not measured (no co-running process): the estimator assumes none")
        return samples, notes, padded
    splits = corun_splits(shares.feasible("prefill"), shares.feasible("decode"))
    if not splits:
        notes.append("contention not measured: no two disjoint shares fit this device")
    # the other phase keeps looping across every case measured beside it (restarting it costs a warm-up step)
    for prefill_units, decode_units in splits:
        for tokens in plan.corun_prefill_lengths:
            prefill = PrefillCase((tokens,))
            with other.looping("prefill", prefill_units, prefill):
                for case in plan.corun_decode_cases:
                    samples += session.step(case, decode_units, plan.repeats, Beside(prefill, prefill_units)).samples
        for batch in plan.corun_decode_batches:
            decode = uniform_decode(batch, plan.corun_decode_context)
            with other.looping("decode", decode_units, decode):
                for case in plan.corun_prefill_cases:
                    samples += session.step(case, prefill_units, plan.repeats, Beside(decode, decode_units)).samples
    samples += _on_shared_units(session, shares, plan, other, notes)
    return samples, notes, padded


def _on_shared_units(session: MeasuringSession, shares: ShareControl, plan: ProfilePlan, other: OtherPhase,
                     notes: list[str]) -> list[Sample]:
    """Each phase on every SM while the other loops on every SM too (`contention.shared_units`): what
    two workers that both hold the whole device cost each other, as `naive` and `scheduler-only`
    serve. Under MPS the block scheduler divides the SMs between the two processes' kernels; without
    it the device time-slices their contexts. The simulator prices such steps by this measurement
    (`overlap_share="measured"`) instead of assuming the SMs go to each step by its demand, for free."""
    total = shares.total_units
    if not (plan.corun_prefill_cases and plan.corun_decode_cases and plan.corun_prefill_lengths
            and plan.corun_decode_batches):
        return []
    if total not in shares.feasible("prefill") or total not in shares.feasible("decode"):
        notes.append(f"shared units not measured: a share of all {total} SMs is not granted to both roles")
        return []
    samples: list[Sample] = []
    decode = uniform_decode(plan.corun_decode_batches[0], plan.corun_decode_context)
    with other.looping("decode", total, decode):
        samples += session.step(plan.corun_prefill_cases[0], total, plan.repeats, Beside(decode, total)).samples
    prefill = PrefillCase((plan.corun_prefill_lengths[0],))
    with other.looping("prefill", total, prefill):
        samples += session.step(plan.corun_decode_cases[0], total, plan.repeats, Beside(prefill, total)).samples
    return samples
