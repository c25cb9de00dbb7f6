"""The measuring core of a profile, one for the CPU and the GPU: a step put on a share of the
device, timed, and turned into calibration samples.

* `step`: an end-to-end step (prefill or decode) on a share -> a phase sample; beside the other
  phase (`Beside`: a co-runner looping a step on the complementary share) -> a phase sample with
  `co_running` set;
* `sweep`: the per-kernel times of a state -> op samples (one per kernel class).
Each returns a `Measurement`: the samples and how many undisturbed runs they rest on.

What differs between the devices comes in as two backends: the `Shares` (`shares.CoreShares`: core
sets; on a GPU the partition backend's SM shares) and the `Timer` (`CpuTimer`: the wall clock, a
lone thread's own clock for one-core kernel sweeps, runs disturbed by other jobs left out;
`cuda_timing.CudaTimer`: CUDA events). Prefill steps run on the prefill role's share (lowest units),
decode steps on the decode role's (highest), as the workers do.

`ProfileSession` is the CPU's session, with its `CpuTimer` (the CPU plan, `sweep.run_plan`, drives
it); the GPU plan (`cuda_sweep.run_cuda_plan`) drives a `MeasuringSession` on the GPU's backends."""

from __future__ import annotations

import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol, Sequence

import torch

from engines.host import pin_all_threads
from engines.model_config import ModelConfig
from estimator.calibration import Sample
from estimator.profiler.corun import CoRunner
from estimator.profiler.kernel_timing import kernel_times, sweep_clock
from estimator.profiler.shares import CoreShares, Shares
from estimator.profiler.timing import Timing, time_calls, wait_until_quiet
from estimator.profiler.workload import DecodeCase, HybridCase, ModelBench, PrefillCase, kv_tokens_needed

TOKEN_CLASSES = ("input_norm", "qkv_proj", "rope", "o_proj", "post_attn_norm", "gate_up_proj", "act", "down_proj",
                 "residual_add")

Case = PrefillCase | DecodeCase | HybridCase


def phase_sample(case: Case, units: int, seconds: float, co_running: int = 0, co_units: int = 0) -> Sample:
    if isinstance(case, HybridCase):
        return Sample(kind="hybrid", units=units, seconds=seconds, prefill_lens=case.chunk_lens,
                      decode_batch=case.decode.batch, decode_context=case.decode.total_context)
    if isinstance(case, PrefillCase):
        return Sample(kind="prefill", units=units, seconds=seconds, prefill_lens=case.seq_lens,
                      num_layers=case.num_layers, include_head=case.num_layers is None, co_running=co_running,
                      co_units=co_units)
    return Sample(kind="decode", units=units, seconds=seconds, decode_batch=case.batch,
                  decode_context=case.total_context, co_running=co_running, co_units=co_units)


def op_samples(case: Case, units: int, times: dict[str, float]) -> list[Sample]:
    """One sample per kernel class from a sweep (`kernel_timing.kernel_times`, `cuda_ops.op_times`)."""
    decode = isinstance(case, DecodeCase)
    rows = case.batch if decode else case.tokens
    outputs = case.batch if decode else len(case.seq_lens)  # rows reaching the LM head
    samples = [Sample(kind=k, units=units, seconds=times[k], prefill_lens=(rows,)) for k in TOKEN_CLASSES]
    # The estimator's final norm covers every row of the step (SGLang's does); this engine's covers
    # only the rows reaching the LM head. Recorded against the step's rows, the sample calibrates
    # what the estimator asks about: the final norm's cost in a step of that many rows.
    samples += [Sample(kind="embedding", units=units, seconds=times["embedding"], prefill_lens=(rows,)),
                Sample(kind="final_norm", units=units, seconds=times["final_norm"], prefill_lens=(rows,)),
                Sample(kind="lm_head", units=units, seconds=times["lm_head"], prefill_lens=(outputs,))]
    if decode:
        samples.append(Sample(kind="attn_decode", units=units, seconds=times["attn_decode"],
                              decode_batch=case.batch, decode_context=case.total_context))
    else:
        samples.append(Sample(kind="attn_prefill", units=units, seconds=times["attn_prefill"],
                              prefill_lens=case.seq_lens))
    return [s for s in samples if s.seconds > 0]


@dataclass(frozen=True)
class Measurement:
    """What one measurement produced; `usable` = 0 means every run was disturbed (busy machine)
    and `seconds` is the least-disturbed estimate, not to be trusted."""

    label: str
    samples: list[Sample]
    seconds: float
    usable: int


def role_of(case: Case) -> str:
    """The role whose shares a case runs on (a hybrid step: a single engine's, on prefill's shares,
    which reach the whole device)."""
    return "decode" if isinstance(case, DecodeCase) else "prefill"


class Timer(Protocol):
    """How a device times what the session runs on one of its shares."""

    unit_name: str  # how a share is counted in the log: "core(s)", "SMs"

    def settle(self, own_pids: tuple[int, ...]) -> None:
        """Before a measurement: let the machine calm down (other jobs; `own_pids` are ours)."""

    def step(self, run: Callable[[], object], repeats: int, own_pids: tuple[int, ...]) -> Timing:
        """Seconds per call of `run`."""

    def kernels(self, bench: ModelBench, case: Case, units: int, repeats: int) -> tuple[dict[str, float], Timing]:
        """Seconds of one launch of each kernel class of `case`, and the timing of the sweeps."""

    def describe(self, timing: Timing, kernel_times: dict[str, float] | None = None) -> str:
        """A measurement as the log shows it ("12.3 ms (5 usable of 6 runs)")."""


@dataclass(frozen=True)
class Beside:
    """The other phase, looping `case` on `units` of its role's share while a step is timed. With a
    `runner`, the session starts it after the step is ready and stops it after the timed runs;
    without one, the caller keeps it looping across several measurements."""

    case: Case
    units: int
    runner: CoRunner | None = None

    @property
    def co_running(self) -> int:
        """What the calibration records of it: the prefill's tokens, or the decode batch."""
        return self.case.tokens if isinstance(self.case, PrefillCase) else self.case.batch


class MeasuringSession:
    """Measurements on one device: `shares` put each step on its share, `timer` times it."""

    def __init__(self, bench: ModelBench, shares: Shares, timer: Timer,
                 step_for: Callable[[Case], Callable[[], object]] | None = None,
                 log: Callable[[str], None] = lambda _: None):
        """`step_for(case)`: the callable a worker would run for that step (default: the bench's
        eager step; a GPU may time decode steps as CUDA-graph replays)."""
        self.bench, self.shares, self.timer, self.log = bench, shares, timer, log
        self.step_for = step_for or bench.step

    def step(self, case: Case, units: int, repeats: int, beside: Beside | None = None) -> Measurement:
        """`case` on `units` of its role's share, alone or `beside` the other phase."""
        runner = beside.runner if beside is not None else None
        own_pids = (runner.pid,) if runner is not None else ()
        with self.shares.use(role_of(case), units):  # the step's inputs are made on the share too
            run = self.step_for(case)
            self.timer.settle(own_pids)
            with runner.looping(role_of(beside.case), beside.units, beside.case) if runner else nullcontext():
                start = time.perf_counter()
                timing = self.timer.step(run, repeats, own_pids)
                end = time.perf_counter()
        label = f"{case.label()} on {units} {self.timer.unit_name}"
        if beside is None:
            return self._done(label, timing, [phase_sample(case, units, timing.seconds)])
        inside = runner.iterations_within(start, end) if runner is not None else []
        extra = f" ({beside.case.label()} steps: {statistics.median(inside) * 1e3:.0f} ms)" if inside else ""
        return self._done(f"{label} beside {beside.case.label()} on {beside.units} {self.timer.unit_name}", timing,
                          [phase_sample(case, units, timing.seconds, co_running=beside.co_running,
                                        co_units=beside.units)], extra)

    def sweep(self, case: Case, units: int, repeats: int) -> Measurement:
        """Per-kernel times of `case` on `units` of its role's share."""
        with self.shares.use(role_of(case), units):
            self.timer.settle(())
            times, timing = self.timer.kernels(self.bench, case, units, repeats)
        return self._done(f"kernels of {case.label()} on {units} {self.timer.unit_name}", timing,
                          op_samples(case, units, times), kernel_times=times)

    def _done(self, label: str, timing: Timing, samples: list[Sample], extra: str = "",
              kernel_times: dict[str, float] | None = None) -> Measurement:
        self.log(f"{label}: {self.timer.describe(timing, kernel_times)}{extra}")
        return Measurement(label, samples, timing.seconds, timing.usable)


# Measurements in a row with every run disturbed after which the machine counts as busy (another job
# holding a core throughout, not a burst), and what one measurement may then take: waiting for quiet
# moments that do not come made a quick profile take over 4 minutes beside one busy process on 2
# cores (every server of a test suite then timed out starting), where it takes about 50 s on a quiet machine.
BUSY_AFTER = 3
BUSY_BUDGET_S = 0.5


class CpuTimer:
    """The CPU's `Timer`: steps and kernel sweeps timed by `timing.time_calls` (the wall clock; a
    lone thread's own clock for the kernels of a one-core sweep: `kernel_timing.sweep_clock`), within
    `budget_s` per measurement, waiting up to `quiet_wait_s` for other jobs to pause.

    Once BUSY_AFTER measurements in a row had no undisturbed run, the machine is `busy`: measurements
    stop waiting for quiet moments and take BUSY_BUDGET_S of runs (at least two), whose least-disturbed
    half is the answer (`timing.summarize`), until a measurement has an undisturbed run again."""

    unit_name = "core(s)"

    def __init__(self, budget_s: float, quiet_wait_s: float):
        self.budget_s, self.quiet_wait_s = budget_s, quiet_wait_s
        self.last_undisturbed = False  # whether every run of the last measurement was undisturbed
        self.shared_cores = False  # the step runs on cores the co-runner holds too: waiting for them is measured
        self.disturbed_in_a_row = 0  # measurements just before this one with no undisturbed run
        self.busy_measurements = 0  # measurements taken while the machine was busy

    @property
    def busy(self) -> bool:
        return self.disturbed_in_a_row >= BUSY_AFTER

    def _limits(self) -> dict:
        if self.busy:
            self.busy_measurements += 1
            return {"budget_s": min(self.budget_s, BUSY_BUDGET_S), "quiet_wait_s": 0.0}
        return {"budget_s": self.budget_s, "quiet_wait_s": self.quiet_wait_s}

    def settle(self, own_pids: tuple[int, ...]) -> None:
        """Wait for a quiet moment before a measurement — unless the last one just ran undisturbed
        throughout: the machine was quiet a moment ago, and one look costs `timing.QUIET_WINDOW_S` (~4 s over
        a quick profile's ~45 measurements), or the machine is busy. A burst that starts anyway is caught
        run by run."""
        if not self.last_undisturbed and not self.busy:
            wait_until_quiet(self.quiet_wait_s, own_pids=own_pids)

    def _seen(self, timing: Timing) -> Timing:
        self.last_undisturbed = timing.usable == len(timing.runs)
        self.disturbed_in_a_row = 0 if timing.usable else self.disturbed_in_a_row + 1
        return timing

    def step(self, run: Callable[[], object], repeats: int, own_pids: tuple[int, ...]) -> Timing:
        return self._seen(time_calls(run, repeats=repeats, own_pids=own_pids, waits_expected=self.shared_cores,
                                     **self._limits()))

    def kernels(self, bench: ModelBench, case: Case, units: int, repeats: int) -> tuple[dict[str, float], Timing]:
        """Per-kernel medians over the usable sweeps (a sweep = one forward, timed kernel by kernel)."""
        clock = sweep_clock(units)
        timing = self._seen(time_calls(lambda: kernel_times(bench, case, clock)[0], repeats=repeats,
                                       **self._limits()))
        sweeps = timing.values
        return {k: statistics.median(s[k] for s in sweeps) for k in sweeps[0]}, timing

    def describe(self, timing: Timing, kernel_times: dict[str, float] | None = None) -> str:
        return f"{timing.seconds * 1e3:.1f} ms ({timing.usable} usable of {len(timing.runs)} runs)"


class ProfileSession(MeasuringSession):
    """The CPU's session: the model loaded once, shares are core sets of `cores`, runs timed with
    `CpuTimer`, and the other phase in a spawned `CoRunner` on the complementary cores. Before each
    measurement it waits briefly for the machine to be quiet (other jobs may share it)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, cores: Sequence[int],
                 cases: Sequence[Case], budget_s: float = 10.0, quiet_wait_s: float = 2.0,
                 log: Callable[[str], None] = lambda _: None):
        self.config, self.state, self.dtype, self.cores = config, state, dtype, list(cores)
        self.kv_tokens = kv_tokens_needed(cases)
        super().__init__(ModelBench(config, state, self.kv_tokens, dtype), CoreShares(self.cores),
                         CpuTimer(budget_s, quiet_wait_s), log=log)
        self._corunner: CoRunner | None = None
        # measuring re-pins every thread of this process; put them back on close, or every process
        # started from here afterwards (a test suite's next server) would inherit a one-core share
        self._original_cores, self._original_threads = os.sched_getaffinity(0), torch.get_num_threads()

    def corunner(self) -> CoRunner:
        if self._corunner is None:
            self._corunner = CoRunner(self.config, self.state, self.dtype, self.kv_tokens,
                                      partial(CoreShares, self.cores))
        return self._corunner

    def beside_prefill(self, case: DecodeCase, units: int, prefill_tokens: int, repeats: int) -> Measurement:
        """A decode step on `units` cores while a prefill of `prefill_tokens` loops on the rest."""
        other = Beside(PrefillCase((prefill_tokens,)), len(self.cores) - units, self.corunner())
        return self.step(case, units, repeats, other)

    def beside_decode(self, case: PrefillCase, units: int, decode: DecodeCase, repeats: int) -> Measurement:
        """A prefill step on `units` cores while `decode` steps loop on the rest."""
        return self.step(case, units, repeats, Beside(decode, len(self.cores) - units, self.corunner()))

    def on_shared_cores(self, case: Case, other: Case, repeats: int) -> Measurement:
        """`case` on every core while `other` loops on every core too: what a core that both workers'
        threads hold costs (the OS time-slices them; a step of several threads waits at each barrier for
        the one descheduled), as `naive` serves, or Bullet's hand-over for a moment."""
        self.timer.shared_cores = True  # its threads wait for the co-runner's: that is the measurement
        try:
            return self.step(case, len(self.cores), repeats, Beside(other, len(self.cores), self.corunner()))
        finally:
            self.timer.shared_cores = False

    def close(self) -> None:
        if self._corunner is not None:
            self._corunner.close()
            self._corunner = None
        pin_all_threads(set(self._original_cores))
        torch.set_num_threads(self._original_threads)

    def __enter__(self) -> "ProfileSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
