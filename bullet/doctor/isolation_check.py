"""The doctor's cross-process isolation check: for every GPU backend that loads, two processes on
complementary halves of the SMs, each looping a GEMM, timed alone and together (`isolation_run`,
judged by `isolation`). The outcome of each is recorded per GPU, driver and MPS state
(`bullet.partition.backend_choice`), which is what `--partition-backend auto` serves with.

Needs no SM ids, so it decides what %smid cannot under MPS (where every pool reports ids 0..N-1).
Each backend costs two process start-ups (at once) and 2 rounds of 3 x PHASE_S seconds: about 10 s."""

from __future__ import annotations

import os

from bullet.doctor.gpu_checks import skip_gpu
from bullet.doctor.isolation_run import Side, measure_isolation
from bullet.doctor.results import CheckResult, failed, passed
from bullet.partition.backend_choice import choose_backend, read_isolation_verdicts, record_isolation_verdict
from bullet.partition.cuda_driver import cuda_driver_version
from bullet.partition.libsmctrl import LIBRARY_ENV
from bullet.partition.mps import THREAD_PERCENTAGE_ENV, detect_mps
from bullet.partition.mps_share import percentage_for

NAME = "cross-process isolation (timing)"
PHASE_S = 0.3  # 30 synchronised bursts of ~10 ms per phase
ALIGN = 8  # both halves a multiple of 8 SMs: whole green-context groups (8 on 9.0+, 2 on 8.x) and TPCs


def isolation_plan(total_sms: int, library: str | None, allow_untested: bool) -> list[tuple[str, Side, Side, list[str]]]:
    """(backend, side A, side B, child flags) for each backend worth timing here. Both sides ask for
    the same multiple of ALIGN SMs from opposite ends, so their shares cannot meet when the backend
    keeps its promise."""
    half = max(ALIGN, total_sms // 2 // ALIGN * ALIGN)
    plan = [("green-ctx", Side("prefill", half), Side("decode", half), [])]
    library = library or os.environ.get(LIBRARY_ENV)
    if library:
        flags = ["--library", library] + (["--allow-untested-driver"] if allow_untested else [])
        plan.append(("libsmctrl", Side("prefill", half), Side("decode", half), flags))
    cap = {THREAD_PERCENTAGE_ENV: str(percentage_for(half, total_sms))}
    # the device's SMs as counted here, uncapped: under its cap a child's torch sees only the capped count
    plan.append(("mps-percentage", Side("prefill", half, cap), Side("decode", half, cap),
                 ["--total-units", str(total_sms)]))
    return plan


def check_cross_process_isolation(no_gpu: str | None, library: str | None = None, allow_untested: bool = False,
                                  phase_s: float = PHASE_S) -> CheckResult:
    if no_gpu:
        return skip_gpu(NAME, no_gpu)
    import torch

    name, driver = torch.cuda.get_device_name(0), cuda_driver_version()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    mps = detect_mps()
    runs = {}
    for backend, a, b, flags in isolation_plan(total, library, allow_untested):
        run = measure_isolation(backend, a, b, "cuda", phase_s, rounds=2, extra=flags)
        runs[backend] = run.as_dict()
        record_isolation_verdict(backend, name, driver, mps.running, run.verdict.outcome, run.verdict.summary,
                                 kept_a=run.verdict.kept_a, kept_b=run.verdict.kept_b, granted=run.granted)
    choice = choose_backend("cuda", read_isolation_verdicts(name, driver, mps.running), mps.running, driver,
                            library or os.environ.get(LIBRARY_ENV), allow_untested)
    details = {"mps": mps.label, "shares": f"{total // 2 // ALIGN * ALIGN} SMs each, from opposite ends of {total}",
               "runs": runs, "auto_backend": choice.backend, "auto_reason": choice.reason}
    summary = "; ".join(f"{b}: {r['outcome']} ({r['summary']})" for b, r in runs.items())
    if choice.proven:
        return passed(NAME, f"MPS {mps.label}: {summary}. `--partition-backend auto` serves with {choice.backend}",
                      **details)
    return failed(NAME, f"MPS {mps.label}: no backend keeps two processes on disjoint SMs: {summary}", **details)
