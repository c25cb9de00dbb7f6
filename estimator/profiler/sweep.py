"""Runs a `ProfilePlan`: the CPU probe, then at every profiled core count the kernel sweeps and
end-to-end steps, then each phase beside the other. Returns the hardware description and every
sample; `local_fit` turns them into an estimator."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import torch

from engines.model_config import ModelConfig
from estimator.calibration import Sample
from estimator.hardware import HardwareSpec
from estimator.profiler.cache import cpu_model_name
from estimator.profiler.cpu_probe import ProbeSizes, probe_cpu
from estimator.profiler.fit import scale_sweep_to_step
from estimator.profiler.padding import measure_padding
from estimator.profiler.plan import ProfilePlan
from estimator.profiler.session import Measurement, ProfileSession
from estimator.profiler.workload import DecodeCase, HybridCase, PrefillCase, uniform_decode

BUSY_LINE = ("other processes keep this machine busy: measuring without waiting for quiet moments (a less "
             "accurate profile, measured again at a launch on a quiet machine)")
PROBE_SIZES = {"quick": ProbeSizes(gemm_n=512, matrix_mb=128, min_seconds=0.08), "full": ProbeSizes()}


def profiled_unit_counts(total: int) -> list[int]:
    """Every core count on small CPUs; powers of two and the total on bigger ones (alpha is
    blended linearly between profiled counts)."""
    if total <= 4:
        return list(range(1, total + 1))
    counts, k = [], 1
    while k < total:
        counts.append(k)
        k *= 2
    return counts + [total]


def corun_splits(total: int) -> list[int]:
    """Decode core counts at which co-running is measured (prefill gets the rest). On 2 cores the
    only split is 1 + 1, the one the server uses."""
    return sorted({1, total // 2} - {0, total}) if total > 1 else []


def _kind_and_size(case: PrefillCase | DecodeCase | HybridCase) -> tuple[tuple, int]:
    """Steps of one kind (phase, layers run) ordered by how long they take: tokens for a prefill,
    context plus batch for a decode step."""
    if isinstance(case, HybridCase):
        return ("hybrid", None), case.tokens + case.decode.total_context
    if isinstance(case, PrefillCase):
        return ("prefill", case.num_layers), case.tokens
    return ("decode", None), case.total_context + case.batch


@contextmanager
def _progress_bar(enabled: bool, total: int):
    """(advance(description), log(line)) on a rich progress bar, or plain no-ops / prints."""
    if not enabled:
        yield (lambda _desc: None), (lambda _line: None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # Redrawn between measurements only: rich's refresh thread would wake 10 times a second and take
    # the interpreter's lock from the thread being timed (the disturbance the timing rules look for).
    with Progress(TextColumn("[bold]profile"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), transient=False, auto_refresh=False) as bar:
        task = bar.add_task("", total=total)
        yield (lambda desc: bar.update(task, advance=1, description=desc, refresh=True)), bar.console.print


# Runs of a step on cores the co-runner also holds, over the plan's own: how long a step waits for a
# descheduled thread depends on where the OS's time slices fall, so single runs spread 2-3x (two quick
# profiles minutes apart with the plan's 3 runs: a 256-token prefill 2.1x and 5.6x its time alone)
SHARED_REPEATS = 4


def _jobs(session: ProfileSession, plan: ProfilePlan, cores: list[int]):
    """(group, case, units the case runs on, description, measure) of every measurement, in order:
    solo at every profiled core count, then co-running at every split, then each phase on every core
    beside the other on every core too."""
    jobs = []
    for units in profiled_unit_counts(len(cores)):
        # a state's kernel sweep right before its end-to-end step: both then see the machine in the
        # same mood, and the sweep is scaled to the step (`local_fit.scale_sweep_to_step`)
        swept = [c for c in plan.sweeps if c in plan.steps]
        for case in [*swept, *(c for c in plan.sweeps if c not in swept), *(c for c in plan.steps if c not in swept)]:
            if isinstance(case, HybridCase) and units != len(cores):
                # a hybrid step is what the chunked baselines run, always on every core of the server:
                # on fewer it would price nothing (on 2 cores, 9 of a quick profile's ~55 s)
                continue
            if case in plan.sweeps:
                jobs.append((f"sweep {units}", case, units, f"{units} core(s): kernels of {case.label()}",
                             lambda c=case, u=units: session.sweep(c, u, plan.sweep_repeats)))
            if case in plan.steps:
                jobs.append((f"step {units}", case, units, f"{units} core(s): {case.label()}",
                             lambda c=case, u=units: session.step(c, u, plan.repeats)))
    for decode_units in corun_splits(len(cores)):
        prefill_units = len(cores) - decode_units
        for sl in plan.corun_prefill_lengths:
            for case in plan.corun_decode_cases:
                jobs.append(("decode beside prefill", PrefillCase((sl,)), prefill_units,
                             f"{case.label()} beside prefill[{sl}]",
                             lambda c=case, s=sl, u=decode_units: session.beside_prefill(c, u, s, plan.repeats)))
        for batch in plan.corun_decode_batches:
            decode = uniform_decode(batch, plan.corun_decode_context)
            for case in plan.corun_prefill_cases:
                jobs.append(("prefill beside decode", case, prefill_units, f"{case.label()} beside {decode.label()}",
                             lambda c=case, d=decode, u=prefill_units: session.beside_decode(c, u, d, plan.repeats)))
    if len(cores) > 1 and plan.corun_prefill_cases and plan.corun_decode_cases:
        # each phase on every core while the other loops on every core too (contention.shared_units)
        n, prefill = len(cores), plan.corun_prefill_cases[0]
        decode = uniform_decode(plan.corun_decode_batches[0], plan.corun_decode_context)
        jobs.append(("shared prefill", prefill, n, f"{prefill.label()} beside {decode.label()}, both on every core",
                     lambda: session.on_shared_cores(prefill, decode, SHARED_REPEATS * plan.repeats)))
        decode, other = plan.corun_decode_cases[0], PrefillCase((plan.corun_prefill_lengths[0],))
        jobs.append(("shared decode", decode, n, f"{decode.label()} beside {other.label()}, both on every core",
                     lambda: session.on_shared_cores(decode, other, SHARED_REPEATS * plan.repeats)))
    return jobs


def run_plan(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, cores: Sequence[int],
             plan: ProfilePlan, progress: bool = True,
             log: Callable[[str], None] | None = None) -> tuple[HardwareSpec, list[Sample], list[str], int]:
    """The hardware description, every sample, notes on what could not be measured cleanly, and how
    many measurements were taken while the machine was busy (`session.CpuTimer.busy`).

    A measurement whose runs were all disturbed by other jobs is tried again at the end (a busy
    spell may have passed) — unless the machine is still busy then. If it is still disturbed it is
    dropped, unless no measurement of its kind is clean at any core count (`keep_disturbed`)."""
    cores = list(cores)
    too_slow: dict[tuple, int] = {}  # (units, kind) -> size of a step that took too long
    kept: dict[str, list[tuple[object, int, Measurement]]] = {}  # group -> (case, units, measurement)
    disturbed: list[tuple[str, object, int, Callable[[], Measurement], Measurement]] = []

    def skipped(case, units) -> bool:
        kind, size = _kind_and_size(case)
        limit = too_slow.get((units, kind))
        return limit is not None and size >= limit

    with ProfileSession(config, state, dtype, cores, plan.all_cases(), plan.budget_s, plan.quiet_wait_s) as session:
        jobs = _jobs(session, plan, cores)
        with _progress_bar(progress, len(jobs) + 1 + bool(plan.padding_batch)) as (advance, bar_log):
            session.log = say = log or bar_log
            hardware = probe_cpu(cores, PROBE_SIZES[plan.name], progress=False,
                                 name=f"{cpu_model_name()} ({len(cores)} cores)")
            # what the measured engine does: SDPA per sequence of a packed prefill; decode reads each
            # request's own context (the int8 model's paged kernel walks its pages; the float models'
            # gather path pads within groups of similar widths) — until the padding probe below measures it
            hardware = hardware.model_copy(update={"prefill_attention_per_sequence": True,
                                                   "decode_attention_padded": False})
            advance("cpu probe")
            say(" ".join(f"{k + 1} core(s): {hardware.measured_flops[_flops_key(dtype)][k] / 1e9:.0f} GFLOP/s, "
                         f"{hardware.measured_bandwidth[k] / 1e9:.1f} GB/s;" for k in range(hardware.units)))
            timer = session.timer
            was_busy = False
            for group, case, units, description, measure in jobs:
                advance(description)
                if skipped(case, units):
                    say(f"skipped {description}: a smaller step already took over {plan.max_step_seconds:.1f} s")
                    continue
                measured = measure()
                if timer.busy != was_busy:
                    was_busy = timer.busy
                    say(BUSY_LINE if was_busy else "the machine is quiet again: measuring as usual")
                if measured.usable == 0:
                    disturbed.append((group, case, units, measure, measured))
                    continue
                kept.setdefault(group, []).append((case, units, measured))
                if measured.seconds > plan.max_step_seconds and group.startswith("step"):
                    kind, size = _kind_and_size(case)
                    too_slow[(units, kind)] = min(too_slow.get((units, kind), size), size)
            notes, probe_samples = [], []
            if plan.padding_batch:
                advance("decode padding")
                # on one core: what the kernel reads does not depend on the share, and a lone core's
                # times drift least on a shared machine (measured: 2-core medians swung past the longest)
                verdict, probe_samples = measure_padding(session, 1, plan.repeats, plan.padding_batch,
                                                         plan.padding_context)
                notes.append(verdict.note)
                if verdict.padded is not None:
                    hardware = hardware.model_copy(update={"decode_attention_padded": verdict.padded})
            still_disturbed = []
            for group, case, units, measure, first in disturbed:
                if timer.busy:  # still busy: a retry would see the same machine, and take as long again
                    advance("a disturbed measurement, not retried (the machine is busy)")
                    still_disturbed.append((group, case, units, first))
                    continue
                advance("retrying a disturbed measurement")
                measured = measure()
                if measured.usable:
                    kept.setdefault(group, []).append((case, units, measured))
                else:
                    still_disturbed.append((group, case, units, measured))
    notes += keep_disturbed(kept, still_disturbed)
    if timer.busy_measurements:
        notes.append(f"{timer.busy_measurements} measurements were taken while other processes kept the machine "
                     "busy, without waiting for quiet moments: their times include "
                     "the other processes' share of the cores and memory (the online correction adjusts the "
                     "predictions as steps are served); a launch on a quiet machine measures the profile again")
    for units in profiled_unit_counts(len(cores)):
        if not any(group.endswith(f" {units}") and ms for group, ms in kept.items()):
            notes.append(f"no clean measurement on {units} core(s): predictions there borrow the calibration "
                         "of the nearest measured core count")
    for note in notes:
        say(note)
    steps = {(case, units): m.seconds for group, ms in kept.items() if group.startswith("step") for case, units, m in ms}
    samples = list(probe_samples)
    for group, ms in kept.items():
        for case, units, m in ms:
            step = steps.get((case, units)) if group.startswith("sweep") else None
            samples += scale_sweep_to_step(m.samples, step, config.num_hidden_layers) if step else m.samples
    return hardware, samples, notes, timer.busy_measurements


def keep_disturbed(kept: dict[str, list[tuple[object, int, Measurement]]],
                   disturbed: list[tuple[str, object, int, Measurement]]) -> list[str]:
    """Which of the `disturbed` measurements (group, case, units, measurement; every run disturbed)
    join the `kept` ones (group -> [(case, units, measurement)]), and a note on each.

    A disturbed step says more about the other jobs than about this machine: without it the
    calibration interpolates, or borrows the nearest core count's. Only a kind of measurement (a
    sweep, step or co-run of prefill, decode or hybrid steps: what it calibrates) with no clean
    sample at any core count keeps its least-disturbed estimates — every one of them: the first one
    kept is no clean sample (counting it dropped the rest, and a profile measured on a busy machine
    was fitted to one sample of each kind), and a hybrid step is no decode step (its only sample, on
    every core, was dropped beside clean one-core steps while another process held a core)."""
    def family(group: str, case) -> tuple[str, str]:
        return group.split(" ")[0], type(case).__name__

    clean = {family(group, case) for group, ms in kept.items() for case, _, _ in ms}
    notes = []
    for group, case, units, measured in disturbed:
        if family(group, case) in clean:
            notes.append(f"{measured.label}: every run disturbed by other processes; dropped")
        else:
            kept.setdefault(group, []).append((case, units, measured))
            notes.append(f"{measured.label}: every run disturbed by other processes; kept (nothing cleaner)")
    return notes


def _flops_key(dtype: torch.dtype) -> str:
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"
