"""Cost of the shared-memory control plane: state-buffer reads and writes (Python API, the raw C call,
and the bare C loop), the seqlock against a POSIX-semaphore-protected copy, both idle and with a
writer process running, the shared page allocator, and how often an unsynchronized copy tears.

    python artifact/benchmarks/bench_state_buffer.py [--iterations 50000] [--out artifact/results/state_buffer.json]

Per-call times include one perf_counter_ns() pair (its cost is reported as `timer_overhead`)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import posix_ipc
from bullet._shmatomic import SharedRegion

from bullet.shm import segments as shm
from bullet.shm.shared_page_allocator import SharedPageAllocator
from bullet.shm.state_buffer import PAYLOAD_SIZE, StateBuffer, WorkerState

ROOT = Path(__file__).resolve().parents[2]
SPAWN = mp.get_context("spawn")
TEAR_WORDS = 128  # 1 KiB payload for the tearing comparison


def summarize(samples_ns: list[int]) -> dict:
    s = sorted(samples_ns)
    return {"mean_us": statistics.fmean(s) / 1e3, "p50_us": s[len(s) // 2] / 1e3,
            "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3, "max_us": s[-1] / 1e3, "n": len(s)}


def time_calls(fn, iterations: int) -> dict:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(min(1000, iterations)):  # warm-up
        fn()
    for _ in range(iterations):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return summarize(samples)


# ---- writer processes for the contended measurements ----------------------------------------

def _seqlock_publisher(instance_id: str, stop) -> None:
    sb = StateBuffer.attach(instance_id)
    state, i = WorkerState(), 0
    while not stop.is_set():
        for _ in range(1000):
            i += 1
            state.step = i
            sb.publish("decode", state)
    sb.close()


def _semaphore_writer(instance_id: str, offset: int, size: int, stop) -> None:
    seg = shm.attach_segment(instance_id, "state")
    sem = posix_ipc.Semaphore(shm.segment_name(instance_id, "bench_sem"))
    payload, i = bytearray(size), 0
    while not stop.is_set():
        for _ in range(1000):
            i += 1
            payload[:8] = i.to_bytes(8, "little")
            sem.acquire()
            seg.mm[offset:offset + size] = payload
            sem.release()
    sem.close()
    seg.close()


def _unsynchronized_writer(instance_id: str, offset: int, stop) -> None:
    seg = shm.attach_segment(instance_id, "tear")
    i = 0
    while not stop.is_set():
        for _ in range(1000):
            i += 1
            seg.mm[offset:offset + 8 * TEAR_WORDS] = i.to_bytes(8, "little") * TEAR_WORDS
    seg.close()


def _seqlock_raw_writer(instance_id: str, offset: int, stop) -> None:
    seg = shm.attach_segment(instance_id, "tear")
    region, i = SharedRegion(seg.mm), 0
    while not stop.is_set():
        for _ in range(1000):
            i += 1
            region.seqlock_write(offset, i.to_bytes(8, "little") * TEAR_WORDS)
    region.release()
    seg.close()


class Background:
    """Runs a writer in a spawn child for the duration of a `with` block."""

    def __init__(self, target, *args):
        self.stop = SPAWN.Event()
        self.proc = SPAWN.Process(target=target, args=(*args, self.stop))

    def __enter__(self):
        self.proc.start()
        time.sleep(0.5)  # let the child import and reach its loop
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def count_tears(read, seconds: float) -> dict:
    reads = torn = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(1000):
            data = read()
            reads += 1
            torn += data != data[:8] * TEAR_WORDS
    return {"reads": reads, "torn": torn}


# ---- the measurements ------------------------------------------------------------------------

def run(iterations: int, contended_seconds: float) -> dict:
    iid = shm.new_instance_id()
    sb = StateBuffer.create(iid)
    results: dict = {}
    try:
        state = WorkerState(pid=os.getpid(), batch_size=32, queued_requests=4, queued_tokens=8000,
                            tpot_pred_p90_ms=41.0, ttft_pred_p90_ms=900.0)
        sb.publish("decode", state)
        region, off = sb.region, StateBuffer.block_offset("decode")
        size = PAYLOAD_SIZE
        payload = region.seqlock_read(off, size)
        clock = time.perf_counter_ns
        results["timer_overhead"] = time_calls(lambda: None, iterations)
        results["timer_overhead"]["note"] = "an empty call, timed the same way as every entry below"
        results["payload_bytes"] = size

        results["python_publish"] = time_calls(lambda: sb.publish("prefill", state), iterations)
        results["python_read"] = time_calls(lambda: sb.read("decode"), iterations)
        results["c_call_seqlock_write"] = time_calls(lambda: region.seqlock_write(off, payload), iterations)
        results["c_call_seqlock_read"] = time_calls(lambda: region.seqlock_read(off, size), iterations)
        w_ns, r_ns, retries = region.seqlock_bench(off, size, 1_000_000)
        results["c_loop_seqlock"] = {"write_ns": w_ns, "read_ns": r_ns, "read_retries": retries,
                                     "note": "1M operations timed inside C (no interpreter)"}

        sem_name = shm.segment_name(iid, "bench_sem")
        sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, initial_value=1)
        shm.register_semaphore(sem_name)
        mm, lo, hi = sb._segment.mm, off + 8, off + 8 + size

        def sem_write():
            sem.acquire()
            mm[lo:hi] = payload
            sem.release()

        def sem_read():
            sem.acquire()
            data = mm[lo:hi]
            sem.release()
            return data

        results["semaphore_write"] = time_calls(sem_write, iterations)
        results["semaphore_read"] = time_calls(sem_read, iterations)

        with Background(_seqlock_publisher, iid):
            results["python_read_with_writer_running"] = time_calls(lambda: sb.read("decode"), iterations)
            results["c_call_seqlock_read_with_writer_running"] = time_calls(
                lambda: region.seqlock_read(off, size), iterations)
        with Background(_semaphore_writer, iid, lo, size):
            results["semaphore_read_with_writer_running"] = time_calls(sem_read, iterations)
        sem.close()

        tear = shm.create_segment(iid, "tear", 4096)
        tear_region = SharedRegion(tear.mm)
        with Background(_unsynchronized_writer, iid, 8):
            results["tearing_unsynchronized_1KiB"] = count_tears(lambda: tear.mm[8:8 + 8 * TEAR_WORDS],
                                                                 contended_seconds)
        with Background(_seqlock_raw_writer, iid, 0):
            results["tearing_seqlock_1KiB"] = count_tears(lambda: tear_region.seqlock_read(0, 8 * TEAR_WORDS),
                                                          contended_seconds)
        tear_region.release()
        tear.close()

        alloc = SharedPageAllocator.create(iid, 4096, 16)
        results["alloc1_free"] = time_calls(lambda: alloc.free(alloc.alloc(1, 7), 7), iterations)
        results["alloc4_free"] = time_calls(lambda: alloc.free(alloc.alloc(4, 7), 7), iterations)
        results["num_free"] = time_calls(alloc.num_free, iterations)
        samples = []
        for _ in range(50):
            for _ in range(64):
                alloc.alloc(4, 9)
            t0 = clock()
            alloc.free_owner(9)
            samples.append(clock() - t0)
        results["free_owner_256_of_4096_pages"] = summarize(samples)
        alloc.close()
    finally:
        sb.close()
        shm.cleanup_instance(iid)
    return results


def print_table(results: dict) -> None:
    print(f"{'operation':<44}{'mean µs':>9}{'p50 µs':>9}{'p99 µs':>9}{'max µs':>9}")
    for name, r in results.items():
        if isinstance(r, dict) and "mean_us" in r:
            print(f"{name:<44}{r['mean_us']:9.3f}{r['p50_us']:9.3f}{r['p99_us']:9.3f}{r['max_us']:9.1f}")
    c = results["c_loop_seqlock"]
    print(f"{'c_loop_seqlock (inside C, no interpreter)':<44} write {c['write_ns']:.1f} ns, read {c['read_ns']:.1f} ns")
    for name in ("tearing_unsynchronized_1KiB", "tearing_seqlock_1KiB"):
        print(f"{name:<44} {results[name]['torn']} torn of {results[name]['reads']} reads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=50_000)
    ap.add_argument("--contended-seconds", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=ROOT / "artifact/results/state_buffer.json")
    args = ap.parse_args()
    results = run(args.iterations, args.contended_seconds)
    report = {"machine": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "iterations": args.iterations, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
