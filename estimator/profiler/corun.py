"""The other phase, running for real beside the one being timed (Bullet §3.2.3), on a CPU or a GPU.

As in serving, it is another process: a spawned child maps the same weights (shared memory on the
CPU, CUDA IPC handles on a GPU: nothing copied), keeps a KV pool of its own, restricts itself to the
complementary share with the same `Shares` as the parent (built in the child from a picklable
factory: `CoreShares` on the CPU, the partition backend on a GPU) and loops a step — a prefill of sl
tokens, or a decode batch — for as long as the parent times its own step. It logs every iteration
on the system-wide monotonic clock, so the parent also learns how much the co-runner slowed down
meanwhile. On a GPU two processes only run kernels concurrently under MPS; without it they
time-slice and the measured "contention" would be the time-slicing — `bullet profile` checks MPS
first.

    with CoRunner(config, state, dtype, kv_tokens, partial(CoreShares, cores)) as other:
        with other.looping("prefill", 1, PrefillCase((512,))):
            timing = time_calls(decode_step)
        other.last_log  # [(start, end), ...] of the co-runner's iterations"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Literal

import torch
import torch.multiprocessing as mp

from engines.model_config import ModelConfig
from estimator.profiler.shares import Shares
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase

Device = Literal["cpu", "cuda"]

_READY_TIMEOUT_S = 600.0  # spawning + importing torch (+ a CUDA context) + one warm-up step of a long prefill
_JOIN_TIMEOUT_S = {"cpu": 30.0, "cuda": 60.0}  # a CUDA context takes longer to tear down


def _one_in_flight(step: Callable[[], object], device: Device) -> Callable[[], object]:
    """On a GPU a step returns once its kernels are done: one step in flight, as a worker runs them."""
    if device != "cuda":
        return step

    def synchronized() -> None:
        step()
        torch.cuda.current_stream().synchronize()

    return synchronized


def _serve(conn, config: ModelConfig, state: dict, dtype: torch.dtype, kv_tokens: int,
           share_factory: Callable[[], Shares], device: Device) -> None:
    """Child main loop: wait for a (role, units, case), loop it on that share until told to stop, report."""
    shares = share_factory()
    bench = ModelBench(config, state, kv_tokens, dtype, device=device)
    conn.send("up")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            role, units, case = msg
            log = []
            with shares.use(role, units):
                step = _one_in_flight(bench.step(case), device)
                step()  # warmed up before the parent's window opens
                conn.send("running")
                while not conn.poll():
                    start = time.perf_counter()
                    step()
                    log.append((start, time.perf_counter()))
            conn.recv()  # the stop request
            conn.send(log)
    except EOFError:  # the profiler is gone (a stopped server start kills it): nobody to report to, no traceback
        return
    finally:
        shares.close()


class CoRunner:
    """One helper process for a whole profiling session (starting one costs seconds: torch, the
    weights, on a GPU a CUDA context)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, kv_tokens: int,
                 share_factory: Callable[[], Shares], device: Device = "cpu"):
        for tensor in state.values():
            if not tensor.is_cuda:  # CUDA tensors cross by IPC handle as they are
                tensor.share_memory_()  # no-op for tensors already in shared memory
        self._device = device
        self._what = "GPU co-runner" if device == "cuda" else "co-runner"
        ctx = mp.get_context("spawn")  # never fork a process that initialised CUDA
        self._conn, child_conn = ctx.Pipe()
        name = "bullet-profile-cuda-corunner" if device == "cuda" else "bullet-profile-corunner"
        self._proc = ctx.Process(target=_serve, args=(child_conn, config, state, dtype, kv_tokens, share_factory,
                                                      device), daemon=True, name=name)
        self._proc.start()
        child_conn.close()
        self._expect("up")
        self.last_log: list[tuple[float, float]] = []

    def _expect(self, what: str) -> None:
        if not self._conn.poll(_READY_TIMEOUT_S):
            raise RuntimeError(f"{self._what} did not answer {what!r} within {_READY_TIMEOUT_S:.0f}s")
        got = self._conn.recv()
        if got != what:
            raise RuntimeError(f"{self._what} said {got!r}, expected {what!r}")

    @contextmanager
    def looping(self, role: str, units: int, case: PrefillCase | DecodeCase):
        """Keep `case` running on `role`'s share of `units` for the duration of the block."""
        self._conn.send((role, units, case))
        self._expect("running")
        try:
            yield self
        finally:
            self._conn.send("stop")
            self.last_log = self._conn.recv()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def iterations_within(self, start: float, end: float) -> list[float]:
        """Durations of the co-runner's iterations that ran entirely inside [start, end]."""
        return [b - a for a, b in self.last_log if a >= start and b <= end]

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=_JOIN_TIMEOUT_S[self._device])
        if self._proc.is_alive():
            self._proc.kill()  # our own child, by handle
            self._proc.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> "CoRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
