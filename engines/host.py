"""The host process's own resources, as the data plane uses them: which cores its threads run on,
how many intra-op threads torch uses, and giving freed heap memory back to the OS.

Pinning touches **every thread of the process**: `sched_setaffinity(0, …)` only moves the calling
thread, and by the time a share is applied torch's OpenMP pool threads already exist. New threads
inherit the affinity of the thread that creates them, so pinning every existing thread also covers
threads created later. The control plane's `cpu` partition backend and the profiler both use this."""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

import torch


def thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def pin_all_threads(cores: set[int]) -> int:
    """Restrict every thread of this process to `cores`; returns how many threads were pinned.

    Re-lists the threads until no new one shows up: a thread not yet pinned may have created another
    (inheriting the old mask) while the first pass ran."""
    pinned: set[int] = set()
    for _ in range(8):
        fresh = thread_ids() - pinned
        if not fresh:
            break
        for tid in fresh:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                pass  # the thread exited between listing and pinning
        pinned |= fresh
    return len(pinned)


def share_of(cores: Sequence[int], units: int, from_high: bool) -> list[int]:
    """`units` of `cores` (sorted): the lowest ones, or the highest with `from_high`."""
    ordered = sorted(cores)
    units = max(0, min(units, len(ordered)))
    return ordered[len(ordered) - units:] if from_high else ordered[:units]


def use_cores(cores: Sequence[int]) -> None:
    """Run this process on exactly `cores`: every thread pinned there, one torch thread per core."""
    pin_all_threads(set(cores))
    if torch.get_num_threads() != len(cores):
        torch.set_num_threads(len(cores))


# How long an OpenMP thread spins at a barrier before it sleeps. Two workers share the cores (by design,
# during a hand-over or a pause that ran out, and always under `naive`), and other programs may run there
# too: a thread that spins without bound burns the timeslice its teammate needs to reach the barrier, and
# every parallel region (dozens per layer) can cost a whole scheduler quantum — measured on 2 cores, decode
# fell from ~5 to ~0.4 steps/s and no request finished under load. Sleeping at once (OMP_WAIT_POLICY=
# PASSIVE) cured that but made every parallel region a futex wake-up: a decode step on 2 cores took
# longer than on 1 (48 vs 30 ms at batch 1, 104 vs 54 ms at batch 5-8, served). A bounded spin — 20,000
# iterations, tens of microseconds, far below a quantum — keeps back-to-back ops of one step on awake
# threads and lets them sleep between steps: served at 1 req/s, bullet's TPOT went from 108 to 45 ms.
# Read by the OpenMP runtime when it starts, so it must be in a process's environment before torch loads.
THREAD_WAIT_ENV = {"GOMP_SPINCOUNT": "20000"}


def bound_thread_spin_waits() -> dict[str, str]:
    """Put THREAD_WAIT_ENV into this process's environment (for the processes it starts next),
    keeping any value the user set (OMP_WAIT_POLICY too: GNU OpenMP's own policy then decides);
    returns what child processes will see."""
    for key, value in THREAD_WAIT_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in THREAD_WAIT_ENV}


def release_free_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise): after loading weights the
    launcher would hold the dequantization buffers, and an idle worker its last step's activations."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


M_MMAP_THRESHOLD = -3  # glibc mallopt parameters (malloc.h)
M_ARENA_MAX = -8


def bound_heap_growth(mmap_threshold: int = 1 << 20, arenas: int = 2) -> bool:
    """Keep a long-running process's heap from holding what it freed. glibc raises its mmap threshold
    after the first large block is freed, so later multi-megabyte buffers (request bodies, token
    lists) come from the heap and stay there; every thread also gets an arena of its own. A fixed
    threshold (which also turns the raising off) and few arenas keep that memory returnable. Found
    by the fuzz driver: the HTTP frontend grew to 4.4 GB of freed-but-kept heap. Returns whether glibc
    took the settings."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False  # not glibc

