"""Timing on a shared machine: wall-clock medians of the runs nothing else disturbed.

The development machines have 2 cores and other jobs run beside the profiler. Two things disturb
a run, and both are read from the kernel around every run:

* **our threads waited for a core** (`/proc/self/task/*/schedstat`, run-delay). On one core the
  step is one thread (torch's pool has one thread), so a run that waited d seconds would have taken
  wall - d: such runs are kept, corrected, while the delay is a moderate fraction of the run. On
  several cores the correction does not hold: OpenMP threads meet at a barrier after every kernel,
  so one preempted thread stalls the others and a step can take many times its length (seen here:
  a 120 ms prefill took 13 s while another job held one of the two cores). Only runs that did not
  wait (beyond the few % our own threads cost each other waking up) count.
* **another process ran on the other cores** (`/proc/stat` busy time minus our own processes'):
  the cores share memory bandwidth and caches — and the two vCPUs of a VM may be hyperthreads of
  one physical core — so a decode step measured here ran 1.8x slower, in CPU time, while another
  job ran on the other core. Runs during which others used more than a small share of a core do
  not count: a solo measurement means the rest of the machine idles, a co-running one that only
  our co-runner (`own_pids`) runs beside.

Runs continue until enough usable runs are in or the time budget is spent; the median of the
usable runs is the answer. If none is usable (a machine busy throughout), the least-disturbed half
is used and `usable` is 0, so callers can say so."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

# Run-delay / wall time a run may have and still count: corrected on one core, as-is on several.
SINGLE_CORE_DELAY_LIMIT = 0.5
MULTI_CORE_DELAY_LIMIT = 0.08
# Cores' worth of CPU other processes may use during a run that still counts. /proc/stat counts in
# clock ticks (10 ms): a short run either saw a foreign tick or not, and enough repeats find runs
# that did not.
FOREIGN_LIMIT = 0.15
_BACKOFF_S = 0.05  # pause after a disturbed run: bursts of other jobs are often short
QUIET_WINDOW_S = 0.1  # how long `others_busy` watches the machine to tell whether it is quiet
QUIET_BELOW = 0.15  # cores' worth of CPU other processes may use on a machine that counts as quiet
MIN_TIMED_S = 0.3  # usable run time wanted per measurement, for short steps
MAX_REPEATS = 25


def _thread_delays_ns() -> int:
    """Total run-delay (ns) of every thread of this process so far."""
    total = 0
    base = "/proc/self/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread exited, or schedstat is unavailable: count nothing for it
    return total


@dataclass(frozen=True)
class Run:
    wall: float
    delay: float  # seconds our threads waited for a core
    foreign: float  # cores' worth of CPU other processes used meanwhile
    # our threads waiting for a core is what the run measures (a step on cores our co-runner also
    # holds): only other processes' CPU disturbs it
    waits_expected: bool = False

    def undisturbed(self, single_core: bool) -> float | None:
        """The run's duration without disturbance, or None if it cannot be trusted."""
        if self.foreign > FOREIGN_LIMIT:
            return None
        if self.waits_expected:
            return self.wall
        fraction = self.delay / self.wall if self.wall > 0 else 0.0
        if single_core:
            return self.wall - self.delay if fraction <= SINGLE_CORE_DELAY_LIMIT else None
        return self.wall if fraction <= MULTI_CORE_DELAY_LIMIT else None

    def disturbance(self) -> float:
        return self.foreign + (self.delay / self.wall if self.wall > 0 else 0.0)


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median of the usable runs; `values` what `fn` returned in the runs
    the median was taken over."""

    seconds: float
    runs: tuple[Run, ...]
    usable: int
    values: tuple = ()


def time_calls(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, budget_s: float | None = None,
               max_runs: int | None = None, own_pids: tuple[int, ...] = (), quiet_wait_s: float = 0.0,
               waits_expected: bool = False) -> Timing:
    """Run `fn` `warmup` times untimed, then until `repeats` usable runs are in, `max_runs` runs
    were made (default 4 x repeats) or `budget_s` seconds went by (default: no limit but
    `max_runs`); at least two runs whatever the budget. After a disturbed run, wait up to
    `quiet_wait_s` (within the budget) for other jobs to pause: on a machine busy in bursts, the
    runs then land in the quiet moments. `own_pids`: our other processes (a co-runner), whose CPU
    use is not a disturbance. `waits_expected`: our threads wait for cores the co-runner holds by
    design (`Run.waits_expected`). Call it pinned: whether the correction of a single-core run applies
    is read from the calling thread's affinity."""
    single_core = len(os.sched_getaffinity(0)) == 1
    ticks = os.sysconf("SC_CLK_TCK")
    pids = ("self", *own_pids)
    warm = time.perf_counter()
    for _ in range(warmup):
        fn()
    if warmup:
        # Short steps are cheap to repeat, and a median over more of them holds against disturbances
        # too short for the clock-tick accounting to see: ask for about MIN_TIMED_S of usable runs.
        per_run = (time.perf_counter() - warm) / warmup
        repeats = max(repeats, min(MAX_REPEATS, math.ceil(MIN_TIMED_S / max(per_run, 1e-6))))
    max_runs = max_runs or 4 * repeats
    runs: list[Run] = []
    values: list = []
    usable = 0
    began = time.perf_counter()
    while True:
        delay0 = _thread_delays_ns()
        foreign0 = _machine_busy_jiffies() - sum(_process_jiffies(p) for p in pids)
        start = time.perf_counter()
        value = fn()
        wall = time.perf_counter() - start
        foreign = _machine_busy_jiffies() - sum(_process_jiffies(p) for p in pids) - foreign0
        run = Run(wall, (_thread_delays_ns() - delay0) * 1e-9, max(0.0, foreign / ticks / wall) if wall > 0 else 0.0,
                  waits_expected)
        runs.append(run)
        values.append(value)
        good = run.undisturbed(single_core) is not None
        usable += good
        if usable >= repeats or len(runs) >= max_runs:
            break
        elapsed = time.perf_counter() - began
        if budget_s is not None and elapsed >= budget_s and len(runs) >= 2:
            break
        if not good:
            _after_disturbed_run(wall, budget_s - elapsed if budget_s is not None else quiet_wait_s, quiet_wait_s,
                                 own_pids)
    return summarize(runs, values, single_core)


def _after_disturbed_run(wall: float, left_s: float, quiet_wait_s: float, own_pids: tuple[int, ...]) -> None:
    """Pause before the next run once a run was disturbed. A run at least as long as one look at the
    machine (`QUIET_WINDOW_S`) waits for a quiet moment, then backs off briefly if none came. A
    shorter run is cheaper to repeat than to wait for: it backs off for its own length only — a
    tiny model's millisecond steps, often flagged by one foreign clock tick, spent 80 % of a profile
    in these waits. `max_runs` and the budget still bound the retries."""
    if wall >= QUIET_WINDOW_S:
        if wait_until_quiet(min(quiet_wait_s, max(0.0, left_s)), own_pids=own_pids) == 0.0:
            time.sleep(_BACKOFF_S)
    else:
        time.sleep(min(_BACKOFF_S, wall))


def _machine_busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


def _process_jiffies(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        return int(after_name[11]) + int(after_name[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def others_busy(window_s: float = 0.25, own_pids: tuple[int, ...] = ()) -> float:
    """Cores' worth of CPU that processes other than this one (and `own_pids`) used during a
    `window_s` pause: how busy the machine is with other people's work right now."""
    pids = ("self", *own_pids)
    busy0, own0 = _machine_busy_jiffies(), sum(_process_jiffies(p) for p in pids)
    time.sleep(window_s)
    busy1, own1 = _machine_busy_jiffies(), sum(_process_jiffies(p) for p in pids)
    ticks = os.sysconf("SC_CLK_TCK")
    return max(0.0, ((busy1 - busy0) - (own1 - own0)) / ticks / window_s)


def wait_until_quiet(max_wait_s: float, threshold: float = QUIET_BELOW, own_pids: tuple[int, ...] = ()) -> float:
    """Pause (at most `max_wait_s`) until other processes use less than `threshold` of a core;
    returns the seconds waited. Starting a measurement in a quiet moment makes clean runs likely."""
    waited = 0.0
    while waited < max_wait_s:
        if others_busy(QUIET_WINDOW_S, own_pids) < threshold:
            break
        waited += QUIET_WINDOW_S
    return waited


def summarize(runs: list[Run], values: list, single_core: bool) -> Timing:
    kept = [(i, r.undisturbed(single_core)) for i, r in enumerate(runs)]
    kept = [(i, t) for i, t in kept if t is not None]
    if kept:
        return Timing(statistics.median(t for _, t in kept), tuple(runs), len(kept), tuple(values[i] for i, _ in kept))
    order = sorted(range(len(runs)), key=lambda i: runs[i].disturbance())[: max(1, (len(runs) + 1) // 2)]
    # a correction can exceed the run itself (the delay counts every thread of ours, and on a busy
    # machine helper threads wait too): it never takes a run below the share a usable run keeps
    corrected = [max(runs[i].wall - (runs[i].delay if single_core else 0.0), runs[i].wall * (1 - SINGLE_CORE_DELAY_LIMIT))
                 for i in order]
    return Timing(statistics.median(corrected), tuple(runs), 0, tuple(values[i] for i in order))
