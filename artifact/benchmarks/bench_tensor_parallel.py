"""What tensor parallelism costs a worker on a CPU: one model step of the embedded model (fp32) run
unsplit in one process, and split over 2 ranks (2 processes, gloo) exactly as a `--tp-size 2` worker
runs it — rank 0's runner sends each call to rank 1 (`engines.tensor_parallel.LeadingRunner`), both
run their half of the heads and MLP, and two all-reduces per layer add their partial sums.

    python -m artifact.benchmarks.bench_tensor_parallel [--repeats 20] [--out docs/tp]

Side by side on the same cores: unsplit on 1 core, unsplit on 2 cores (one process, 2 threads), and
2 ranks of 1 core each. For the ranks it reports the step's time, the time rank 0 spent inside the
all-reduces (waiting for its peer included) and sending the call (the JSON message), per step. The
steps: decode of 1 and of 16 sequences with 256 tokens of context, and a 512-token prefill."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from artifact.benchmarks.bench_llamacpp import cpu_flags
from artifact.benchmarks.common import machine, print_table
from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.runner import ModelRunner, SeqChunk
from engines.tensor_parallel import LeadingRunner, SumAcrossRanks, build_rank_model, follow
from engines.weights import load_weights

SPAWN = mp.get_context("spawn")
PAGE = 16
CONTEXT = 256
CASES = {"decode x1": (1, 1), "decode x16": (16, 1), "prefill 512": (1, 512)}  # (sequences, new tokens each)


def _steps(runner, repeats: int, vocab: int, names=tuple(CASES), before_timed=lambda name: None) -> dict[str, list[float]]:
    """Seconds of each repeat of each case in `names` on `runner` (unsplit, or rank 0's leading runner);
    `before_timed(name)` runs after the case's context and warm-up, before its timed steps (and with
    None after them)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in names:
        seqs, new = CASES[name]
        pages = -(-(CONTEXT + new) // PAGE)
        tables = [list(range(k * pages, (k + 1) * pages)) for k in range(seqs)]
        # the context: a prefill of every sequence (its KV is what the decode steps read)
        if new == 1:
            runner.forward([SeqChunk(torch.randint(1, vocab, (CONTEXT,), generator=g).tolist(), 0, t) for t in tables])
        start = CONTEXT if new == 1 else 0
        chunks = [SeqChunk(torch.randint(1, vocab, (new,), generator=g).tolist(), start, t) for t in tables]
        runner.forward(chunks)  # warm-up
        before_timed(name)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(chunks)
            samples.append(time.perf_counter() - t0)
        before_timed(None)  # the next case's context and warm-up are not this one's
        out[name] = samples
    return out


def _model(threads: int):
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    return load_weights(None, "auto", torch.float32)


def _pool_pages() -> int:
    return max(s for s, _ in CASES.values()) * -(-(CONTEXT + max(n for _, n in CASES.values())) // PAGE)


def unsplit(cores: list[int], repeats: int, conn) -> None:
    os.sched_setaffinity(0, cores)
    weights = _model(len(cores))
    runner = ModelRunner(build_model(weights.config, weights.state), KVPool(weights.config, _pool_pages(), PAGE,
                                                                            torch.float32))
    conn.send(_steps(runner, repeats, weights.config.vocab_size))
    conn.close()


def rank(r: int, core: int, repeats: int, rendezvous: str, conn) -> None:
    os.sched_setaffinity(0, [core])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    weights = _model(1)
    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 2), rank=r, world_size=2)
    config, model = build_rank_model(weights.config, weights.state, 2, r, dist.group.WORLD)
    runner = ModelRunner(model, KVPool(config, _pool_pages(), PAGE, torch.float32))
    if r:
        follow(runner, dist.group.WORLD)
        conn.send(None)
    else:
        spent = {name: {"all_reduce": 0.0, "message": 0.0} for name in CASES}
        now = {"case": None}
        inner = SumAcrossRanks.forward

        def timed_sum(self, x):
            y = self.inner(x)
            t1 = time.perf_counter()
            dist.all_reduce(y, group=self.group)
            if now["case"]:
                spent[now["case"]]["all_reduce"] += time.perf_counter() - t1
            return y

        SumAcrossRanks.forward = timed_sum
        leader = LeadingRunner(runner, dist.group.WORLD)
        send = leader._send

        def timed_send(message):
            t0 = time.perf_counter()
            send(message)
            if now["case"]:
                spent[now["case"]]["message"] += time.perf_counter() - t0

        leader._send = timed_send
        samples = _steps(leader, repeats, weights.config.vocab_size, before_timed=lambda name: now.update(case=name))
        SumAcrossRanks.forward = inner
        leader.stop()
        conn.send({"samples": samples, "spent": spent})
    conn.close()
    dist.destroy_process_group()
    os._exit(0)  # torch may abort tearing down gloo's threads at finalization


def _collect(procs, pipes) -> list:
    for p in procs:
        p.start()
    for _, writer in pipes:  # the children hold theirs: a child that dies closes the pipe, and recv raises
        writer.close()
    try:
        results = [reader.recv() for reader, _ in pipes]
    except EOFError:
        for p in procs:
            p.kill()
        raise SystemExit("a benchmark process died before it answered (its traceback is above)")
    for p in procs:
        p.join(60)
    return results


def measure(repeats: int, tmp: Path) -> dict:
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    runs = {}
    for label, use in (("unsplit, 1 core", cores[:1]), ("unsplit, 2 cores", cores)):
        pipes = [SPAWN.Pipe(duplex=False)]
        runs[label] = _collect([SPAWN.Process(target=unsplit, args=(use, repeats, pipes[0][1]))], pipes)[0]
        print(f"  {label}: done", flush=True)
    store = tmp / f"tp-bench-{os.getpid()}.store"
    store.unlink(missing_ok=True)
    pipes = [SPAWN.Pipe(duplex=False) for _ in range(2)]
    procs = [SPAWN.Process(target=rank, args=(r, cores[r], repeats, str(store), pipes[r][1])) for r in range(2)]
    lead = _collect(procs, pipes)[0]
    store.unlink(missing_ok=True)
    print("  2 ranks, 1 core each: done", flush=True)
    return {"unsplit": runs, "ranks": lead}


def table(result: dict, repeats: int) -> list[dict]:
    rows = []
    for name in CASES:
        one = statistics.median(result["unsplit"]["unsplit, 1 core"][name]) * 1e3
        two = statistics.median(result["unsplit"]["unsplit, 2 cores"][name]) * 1e3
        tp = statistics.median(result["ranks"]["samples"][name]) * 1e3
        spent = result["ranks"]["spent"][name]
        rows.append({"step": name, "unsplit 1 core ms": one, "unsplit 2 cores ms": two, "2 ranks ms": tp,
                     "2 ranks / unsplit 2 cores": tp / two, "2 ranks / unsplit 1 core": tp / one,
                     "all-reduce ms": spent["all_reduce"] / repeats * 1e3, "message ms": spent["message"] / repeats * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20, help="timed steps of each kind (after one warm-up)")
    ap.add_argument("--out", type=Path, default=Path("artifact/results"), help="directory for the JSON and table")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"timing {len(CASES)} kinds of step, {args.repeats} repeats, unsplit and over 2 ranks ...", flush=True)
    result = measure(args.repeats, args.out)
    rows = table(result, args.repeats)
    report = {"machine": {**machine(), "cpu_flags": cpu_flags()}, "repeats": args.repeats, "context": CONTEXT,
              "rows": rows, "raw": result}
    (args.out / "tensor_parallel.json").write_text(json.dumps(report, indent=2) + "\n")
    columns = ["step", "unsplit 1 core ms", "unsplit 2 cores ms", "2 ranks ms", "2 ranks / unsplit 2 cores",
               "2 ranks / unsplit 1 core", "all-reduce ms", "message ms"]
    print_table(rows, columns, "one step of the embedded model (fp32), unsplit and over 2 ranks")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                       for c in columns) + " |")
    (args.out / "tensor_parallel.md").write_text(
        f"# Tensor parallelism on this CPU: one step, unsplit and over 2 ranks\n\n"
        f"`python -m artifact.benchmarks.bench_tensor_parallel --repeats {args.repeats}` — {report['machine']['when']}, "
        f"{report['machine']['platform']}, torch {report['machine']['torch']}, CPU flags: "
        f"{' '.join(report['machine']['cpu_flags'])}. Medians of {args.repeats} steps; the all-reduce and message "
        f"times are rank 0's, per step, averaged over the timed steps.\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {args.out / 'tensor_parallel.json'} and {args.out / 'tensor_parallel.md'}")


if __name__ == "__main__":
    main()
