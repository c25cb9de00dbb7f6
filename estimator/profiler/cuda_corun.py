"""The other phase running for real beside the one being timed, on a GPU (Bullet §3.2.3).

As in serving, it is another process: a spawned child maps the same weights (CUDA IPC handles,
nothing copied), keeps a KV pool of its own, restricts itself to the complementary share with the
same partition backend (built in the child from a picklable factory) and loops a step until told
to stop. Two processes only run kernels concurrently under MPS; without it they time-slice and the
measured "contention" would be the time-slicing — `bullet profile` checks MPS first.

    with CudaCoRunner(config, state, dtype, kv_tokens, share_factory) as other:
        with other.looping("prefill", 66, PrefillCase((2048,))):
            seconds = timer.step(decode_step)"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp

from engines.model_config import ModelConfig
from estimator.profiler.cuda_shares import ShareFactory
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase

_READY_TIMEOUT_S = 600.0


def _serve(conn, config: ModelConfig, state: dict, dtype: torch.dtype, kv_tokens: int,
           share_factory: ShareFactory) -> None:
    """Child main loop: wait for (role, units, case), loop it on that share until told to stop."""
    shares = share_factory()
    bench = ModelBench(config, state, kv_tokens, dtype, device="cuda")
    conn.send("up")
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            role, units, case = msg
            log = []
            with shares.use(role, units):
                step = bench.step(case)
                step()
                torch.cuda.current_stream().synchronize()  # warmed up before the parent's window opens
                conn.send("running")
                while not conn.poll():
                    start = time.perf_counter()
                    step()
                    torch.cuda.current_stream().synchronize()  # one step in flight, as a worker runs them
                    log.append((start, time.perf_counter()))
            conn.recv()  # the stop request
            conn.send(log)
    finally:
        shares.close()


class CudaCoRunner:
    """One helper process for the whole profile (starting one costs seconds: CUDA context, weights)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, kv_tokens: int,
                 share_factory: ShareFactory):
        ctx = mp.get_context("spawn")  # never fork a process that initialised CUDA
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_conn, config, state, dtype, kv_tokens, share_factory),
                                 daemon=True, name="bullet-profile-cuda-corunner")
        self._proc.start()
        child_conn.close()
        self._expect("up")
        self.last_log: list[tuple[float, float]] = []

    def _expect(self, what: str) -> None:
        if not self._conn.poll(_READY_TIMEOUT_S):
            raise RuntimeError(f"GPU co-runner did not answer {what!r} within {_READY_TIMEOUT_S:.0f}s")
        got = self._conn.recv()
        if got != what:
            raise RuntimeError(f"GPU co-runner said {got!r}, expected {what!r}")

    @contextmanager
    def looping(self, role: str, units: int, case: PrefillCase | DecodeCase):
        self._conn.send((role, units, case))
        self._expect("running")
        try:
            yield self
        finally:
            self._conn.send("stop")
            self.last_log = self._conn.recv()

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()  # our own child, by handle
            self._proc.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> "CudaCoRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
