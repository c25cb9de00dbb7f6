"""The other phase, running for real beside the one being timed (Bullet §3.2.3 on the CPU).

A spawned process maps the same weights (shared memory, nothing copied), keeps a KV pool of its
own, pins itself to the complementary share with the workers' partition backend and loops a step
— a prefill of sl tokens, or a decode batch — for as long as the parent times its own step. It
logs every iteration on the system-wide monotonic clock, so the parent also learns how much the
co-runner slowed down meanwhile.

    with CoRunner(config, state, dtype, kv_tokens, cores) as other:
        with other.looping("prefill", 1, PrefillCase((512,))):
            timing = time_calls(decode_step)
        other.last_log  # [(start, end), ...] of the co-runner's iterations"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Sequence

import torch
import torch.multiprocessing as mp

from engines.model_config import ModelConfig
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase, apply_share

_READY_TIMEOUT_S = 600.0  # spawning + importing torch + one warm-up step of a long prefill


def _serve(conn, config: ModelConfig, state: dict, dtype: torch.dtype, kv_tokens: int, cores: list[int]) -> None:
    """Child main loop: wait for a (role, units, case), loop it until told to stop, report."""
    bench = ModelBench(config, state, kv_tokens, dtype)
    conn.send("up")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        role, units, case = msg
        apply_share(role, units, cores)
        step = bench.step(case)
        step()  # warm-up outside the parent's window
        conn.send("running")
        log = []
        while not conn.poll():
            start = time.perf_counter()
            step()
            log.append((start, time.perf_counter()))
        conn.recv()  # the stop request
        conn.send(log)


class CoRunner:
    """One helper process for a whole profiling session (spawning costs seconds)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, kv_tokens: int,
                 cores: Sequence[int]):
        for tensor in state.values():
            tensor.share_memory_()  # no-op for tensors already in shared memory
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_conn, config, state, dtype, kv_tokens, list(cores)),
                                 daemon=True, name="bullet-profile-corunner")
        self._proc.start()
        child_conn.close()
        self._expect("up")
        self.last_log: list[tuple[float, float]] = []

    def _expect(self, what: str) -> None:
        if not self._conn.poll(_READY_TIMEOUT_S):
            raise RuntimeError(f"co-runner did not answer {what!r} within {_READY_TIMEOUT_S:.0f}s")
        got = self._conn.recv()
        if got != what:
            raise RuntimeError(f"co-runner said {got!r}, expected {what!r}")

    @contextmanager
    def looping(self, role: str, units: int, case: PrefillCase | DecodeCase):
        """Keep `case` running on `role`'s share of `units` cores for the duration of the block."""
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
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()  # our own child, by handle
            self._proc.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> "CoRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
