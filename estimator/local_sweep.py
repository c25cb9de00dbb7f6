"""Runs a `ProfilePlan`: the CPU probe, then at every profiled core count the kernel sweeps and
end-to-end steps, then each phase beside the other. Returns the hardware description and every
sample; `local_fit` turns them into an estimator."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Sequence

import torch

from engines.model_config import ModelConfig
from estimator.calibration import Sample
from estimator.cpu_probe import ProbeSizes, probe_cpu
from estimator.hardware import HardwareSpec
from estimator.local_plan import ProfilePlan
from estimator.local_profile import cpu_model_name
from estimator.local_session import ProfileSession
from estimator.local_workload import DecodeCase, PrefillCase, uniform_decode

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


def _size(case: PrefillCase | DecodeCase) -> int:
    return case.tokens * (case.num_layers or 1) if isinstance(case, PrefillCase) else case.total_context + case.batch


@contextmanager
def _progress_bar(enabled: bool, total: int):
    """(advance(description), log(line)) on a rich progress bar, or plain no-ops / prints."""
    if not enabled:
        yield (lambda _desc: None), (lambda _line: None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]profile"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), transient=False) as bar:
        task = bar.add_task("", total=total)
        yield (lambda desc: bar.update(task, advance=1, description=desc)), bar.console.log


def run_plan(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, cores: Sequence[int],
             plan: ProfilePlan, progress: bool = True,
             log: Callable[[str], None] | None = None) -> tuple[HardwareSpec, list[Sample]]:
    cores = list(cores)
    counts = profiled_unit_counts(len(cores))
    splits = corun_splits(len(cores))
    corun_jobs = len(splits) * (len(plan.corun_prefill_lengths) * len(plan.corun_decode_cases)
                                + len(plan.corun_decode_batches) * len(plan.corun_prefill_cases))
    total = 1 + len(counts) * (len(plan.sweeps) + len(plan.steps)) + corun_jobs
    samples: list[Sample] = []
    too_slow: dict[tuple[int, str], int] = {}  # (units, phase) -> size of a step that took too long

    with _progress_bar(progress, total) as (advance, bar_log):
        say = log or bar_log
        hardware = probe_cpu(cores, PROBE_SIZES[plan.name], progress=False,
                             name=f"{cpu_model_name()} ({len(cores)} cores)")
        advance("cpu probe")
        say(" ".join(f"{k + 1} core(s): {hardware.measured_flops[_flops_key(dtype)][k] / 1e9:.0f} GFLOP/s, "
                     f"{hardware.measured_bandwidth[k] / 1e9:.1f} GB/s;" for k in range(hardware.units)))
        with ProfileSession(config, state, dtype, cores, plan.all_cases(), plan.budget_s, plan.quiet_wait_s,
                            say) as session:

            def skipped(case, units) -> bool:
                limit = too_slow.get((units, type(case).__name__))
                return limit is not None and _size(case) >= limit

            def note_duration(case, units, seconds: float) -> None:
                if seconds > plan.max_step_seconds:
                    key = (units, type(case).__name__)
                    too_slow[key] = min(too_slow.get(key, _size(case)), _size(case))

            for units in counts:
                for case in plan.sweeps:
                    advance(f"{units} core(s): kernels of {case.label()}")
                    if not skipped(case, units):
                        samples += session.sweep(case, units, plan.sweep_repeats)
                for case in plan.steps:
                    advance(f"{units} core(s): {case.label()}")
                    if not skipped(case, units):
                        sample = session.step(case, units, plan.repeats)
                        note_duration(case, units, sample.seconds)
                        samples.append(sample)
            for decode_units in splits:
                prefill_units = len(cores) - decode_units
                for sl in plan.corun_prefill_lengths:
                    for case in plan.corun_decode_cases:
                        advance(f"{case.label()} beside prefill[{sl}]")
                        if not skipped(PrefillCase((sl,)), prefill_units):
                            samples.append(session.beside_prefill(case, decode_units, sl, plan.repeats))
                for batch in plan.corun_decode_batches:
                    decode = uniform_decode(batch, plan.corun_decode_context)
                    for case in plan.corun_prefill_cases:
                        advance(f"{case.label()} beside {decode.label()}")
                        if not skipped(case, prefill_units):
                            samples.append(session.beside_decode(case, prefill_units, decode, plan.repeats))
    return hardware, samples


def _flops_key(dtype: torch.dtype) -> str:
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"
