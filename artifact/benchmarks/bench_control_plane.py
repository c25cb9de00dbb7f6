"""Control-plane costs, the CPU counterpart of Bullet's Table 5.

  python artifact/benchmarks/bench_control_plane.py [--messages 5000]

* metadata send+recv: a prefill→decode Handoff (rid, 512 prompt ids, page table, sampling params),
  serialized, sent over the runtime's ZMQ IPC socket to another process, received and decoded —
  one-way, timed with CLOCK_MONOTONIC (system-wide on Linux);
* state buffer: publish and read of a worker's state block (seqlock, Python API);
* performance prediction: one estimator call for a realistic decode step and prefill step;
* resource re-configuration: the `cpu` partition backend changing a worker's core set.
Writes artifact/results/control_plane.json and prints the table next to the paper's numbers."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from artifact.benchmarks.common import print_table, write_results
from bullet.partition import make_backend
from bullet.shm.segments import new_instance_id
from bullet.shm.state_buffer import StateBuffer, WorkerState
from bullet.types.messages import Handoff, decode, encode
from engines.model_config import ModelConfig
from engines.sampling_params import SamplingParams
from estimator import Estimator, HardwareSpec

PAPER = {"metadata send+recv (ms)": (0.21, 1.54), "performance predict (us)": (10.2, 25.8),
         "resource re-config (us)": (4.1, 5.9)}


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]
    return {"mean": statistics.fmean(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "n": len(s)}


def _receiver(address: str, n: int, out) -> None:
    import zmq

    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    out.put("ready")
    lat = []
    for _ in range(n):
        data = sock.recv()
        msg = decode(data)
        lat.append((time.monotonic_ns() - int(msg.rid)) / 1e6)
    out.put(lat)
    sock.close()
    ctx.term()


def metadata_latency(n: int) -> dict:
    import zmq

    address = f"ipc://@bullet-bench-{time.time_ns()}"
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(address, n, q))
    proc.start()
    assert q.get(timeout=60) == "ready"
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=256, stop=["\n\n"])
    prompt = list(range(1000, 1512))
    for _ in range(n):
        msg = Handoff(rid=str(time.monotonic_ns()), uid=1, prompt_ids=prompt, output_ids=[42],
                      page_table=list(range(32)), params=params, arrival=0.0, first_token_time=0.0)
        sock.send(encode(msg))
        time.sleep(0.0005)  # a message per step, not a flood: measure latency, not queueing
    lat = q.get(timeout=120)
    proc.join(10)
    sock.close()
    ctx.term()
    return _stats(lat)


def state_buffer_costs(n: int) -> tuple[dict, dict]:
    sb = StateBuffer.create(new_instance_id())
    try:
        ws = WorkerState(pid=1, batch_size=32, queued_requests=4, compute_units=1)
        w, r = [], []
        for _ in range(n):
            t = time.perf_counter_ns()
            sb.publish("decode", ws)
            w.append((time.perf_counter_ns() - t) / 1e3)
            t = time.perf_counter_ns()
            sb.read("decode")
            r.append((time.perf_counter_ns() - t) / 1e3)
        return _stats(w), _stats(r)
    finally:
        sb.close()
        sb.unlink()


def prediction_cost(n: int) -> dict:
    est = Estimator(ModelConfig.builtin("llama-3.1-8b"), HardwareSpec.builtin("a100"))
    samples = []
    for i in range(n):
        units = 20 + (i % 80)
        t = time.perf_counter_ns()
        est.decode_time(48, 48 * 900, units, co_prefill_tokens=2048)
        est.prefill_time([512, 700, 1024], 108 - units, num_layers=4)
        samples.append((time.perf_counter_ns() - t) / 2e3)  # per call
    return _stats(samples)


def reconfig_cost(n: int) -> dict:
    import os

    cores = sorted(os.sched_getaffinity(0))
    backend = make_backend("cpu", "decode", cores=cores)
    if len(cores) < 2:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "n": 0}
    for i in range(n):
        backend.apply(1 if i % 2 else len(cores))
    s = backend.apply_costs()
    backend.apply(len(cores))
    return {"mean": s.mean_us, "p50": s.p50_us, "p90": float("nan"), "p99": s.p99_us, "n": s.count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=5000)
    args = ap.parse_args()
    print("[bench] metadata send+recv …", flush=True)
    meta = metadata_latency(args.messages)
    print("[bench] state buffer, prediction, re-configuration …", flush=True)
    write, read = state_buffer_costs(20000)
    predict = prediction_cost(20000)
    reconfig = reconfig_cost(2000)
    results = {"metadata send+recv (ms)": meta, "state buffer publish (us)": write, "state buffer read (us)": read,
               "performance predict (us)": predict, "resource re-config (us)": reconfig}
    path = write_results("control_plane", {"results": results, "paper_table5": PAPER})
    rows = []
    for name, s in results.items():
        paper = PAPER.get(name, ("", ""))
        rows.append({"what": name, "mean": s["mean"], "p50": s["p50"], "p99": s["p99"],
                     "paper mean": paper[0], "paper p99": paper[1]})
    print_table(rows, ["what", "mean", "p50", "p99", "paper mean", "paper p99"], title=f"control plane ({path})")


if __name__ == "__main__":
    main()
