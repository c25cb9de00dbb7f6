"""Bullet next to llama.cpp's `llama-server`: the same GGUF, the same cores, the same client.

  python artifact/benchmarks/bench_llamacpp.py [--rates 0.5 1 1.5] [--num-prompts 32] [--cores 0,1]
                                               [--systems llama.cpp chunked:1024 default] [--repeats 1]

A system is `llama.cpp`, or a Bullet policy (`default` = the server's default) with optional launch
flags in the same string: `--systems llama.cpp default "default --tpot-slo 60ms"`.

llama-server is built from the `llama-cpp-python` source release and cached
(`artifact.benchmarks.llamacpp_build`). Each system is started on `--cores` (llama-server under
`taskset` with one thread per core and `--parallel 8` slots; Bullet with `--cores`), then driven by
the same `python -m sglang.bench_serving --backend sglang-oai` command (ShareGPT prompts of at most
`--context-len` minus the output length, `--output-len` tokens each, greedy, ignore_eos) at each
rate and at saturation (all prompts at once, `inf`). Systems run one after another, never at once.

Writes artifact/results/llamacpp.json (every bench_serving summary, CPU flags, the exact commands)
and artifact/results/llamacpp.md (the table, with each system's ratios to llama-server: saturated
throughput and mean TPOT at the same rate — the issue's goal is >= 0.8x and <= 1.25x)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from artifact.bench_client import run_bench_serving
from artifact.benchmarks.common import RESULTS, print_table, write_results
from artifact.benchmarks.llamacpp_build import DEFAULT_VERSION, build
from artifact.server import BulletServer, free_port, system_launch, system_slug
from bullet.workloads.sharegpt import repaired_sharegpt_path
from engines.tokenizer import gguf_tokenizer_dir
from engines.weights.resolve import default_gguf_path

METRICS = ("completed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2e_latency_ms")


def cpu_flags() -> list[str]:
    return sorted(set(re.findall(r"\b(avx[0-9a-z_]*|amx[0-9a-z_]*)\b", Path("/proc/cpuinfo").read_text())))


class LlamaServer:
    """llama-server on `cores` (one thread per core), `parallel` slots of `slot_context` tokens each."""

    def __init__(self, binary: Path, model: Path, cores: list[int], parallel: int, slot_context: int, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        threads = str(len(cores))
        self.cmd = ["taskset", "-c", ",".join(map(str, cores)), str(binary), "-m", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "-t", threads, "-tb", threads,
                    "--parallel", str(parallel), "--ctx-size", str(parallel * slot_context), "--cont-batching"]
        self.log, self.proc = log, None

    def __enter__(self) -> "LlamaServer":
        try:
            return self._start()
        except RuntimeError:
            # llama.cpp 0.3.36's AMX matmul (an "extra" weight layout) segfaults on this Q4_1 model while the
            # server warms up (backtrace: ggml_backend_amx_mul_mat); without weight repacking it runs the
            # ordinary AVX-512/AVX2 kernels. Recorded in the command the results keep.
            amx = any(f.startswith("amx") for f in cpu_flags())
            if self.proc.returncode != -signal.SIGSEGV or not amx or "--no-repack" in self.cmd:
                raise
            print("[llamacpp-bench] llama-server crashed in its AMX kernels: restarting with --no-repack", flush=True)
            self.cmd.append("--no-repack")
            return self._start()

    def _start(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"llama-server not healthy after 300 s; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bullet_server(system: str, args, log: Path) -> BulletServer:
    """`system` is a policy (`default` = the server's default) optionally followed by launch flags,
    e.g. "default --tpot-slo 60ms"."""
    launch = ["--cores", args.cores, "--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning",
              *system_launch(system)]
    return BulletServer(*launch, log_path=str(log))


def run_system(system: str, args, binary: Path | None, tokenizer: str, dataset: Path, out: Path) -> dict:
    cores = [int(c) for c in args.cores.split(",")]
    name = system_slug(system)
    server = (LlamaServer(binary, default_gguf_path(), cores, args.parallel, args.context_len, out / f"server-{name}.log")
              if system == "llama.cpp" else bullet_server(system, args, out / f"server-{name}.log"))
    per_rate = {}
    with server:
        for rate in [*args.rates, float("inf")]:
            runs = []
            for rep in range(args.repeats):
                result, _ = run_bench_serving(server.url, tokenizer, dataset, rate, args.num_prompts,
                                              out / f"bench-{name}-{rate}-{rep}.jsonl", args.context_len,
                                              args.output_len, seed=args.seed + rep, backend="sglang-oai")
                runs.append({k: result.get(k) for k in METRICS})
            summary = {k: statistics.median(r[k] for r in runs) for k in METRICS}
            per_rate[str(rate)] = {**summary, "runs": runs}
            print(f"[llamacpp-bench] {system:>13} @ {rate:>4} req/s: {summary['request_throughput']:.2f} req/s, "
                  f"{summary['output_throughput']:.0f} out tok/s, TTFT {summary['mean_ttft_ms'] / 1e3:.2f} s, "
                  f"TPOT {summary['mean_tpot_ms']:.0f} ms", flush=True)
    return {"command": getattr(server, "cmd", None) or ["bullet", "launch", *server.args], "per_rate": per_rate}


def table(results: dict, reference: str = "llama.cpp") -> list[dict]:
    rows, ref = [], results.get(reference)
    for system, res in results.items():
        for rate, m in res["per_rate"].items():
            row = {"system": system, "rate": rate, "req/s": m["request_throughput"], "out tok/s": m["output_throughput"],
                   "mean TTFT s": m["mean_ttft_ms"] / 1e3, "mean TPOT ms": m["mean_tpot_ms"], "thr / llama": "", "TPOT / llama": ""}
            if ref and system != reference and rate in ref["per_rate"]:
                r = ref["per_rate"][rate]
                row["thr / llama"] = m["request_throughput"] / r["request_throughput"]
                row["TPOT / llama"] = m["mean_tpot_ms"] / r["mean_tpot_ms"]
            rows.append(row)
    return rows


def write_markdown(rows: list[dict], meta: dict, path: Path) -> None:
    cols = list(rows[0])
    lines = [f"# Bullet vs llama-server ({meta['when']})", "",
             f"Same GGUF ({meta['model']}), cores {meta['cores']}, CPU flags: {' '.join(meta['cpu_flags'])}; "
             f"`sglang.bench_serving --backend sglang-oai`, ShareGPT, {meta['num_prompts']} prompts, "
             f"{meta['output_len']} output tokens, context <= {meta['context_len']}; llama.cpp {meta['llamacpp_version']} "
             f"with {meta['parallel']} slots. Ratios are to llama-server at the same rate (`inf` = all prompts at once).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=["llama.cpp", "chunked:1024", "default"])
    ap.add_argument("--rates", nargs="*", type=float, default=[0.5, 1.0, 1.5], help="besides saturation (inf)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--context-len", type=int, default=964, help="prompt + output tokens at most (964: prompts <= 900)")
    ap.add_argument("--cores", default=",".join(map(str, sorted(os.sched_getaffinity(0)))))
    ap.add_argument("--parallel", type=int, default=8, help="llama-server slots")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--llamacpp-version", default=DEFAULT_VERSION)
    args = ap.parse_args()
    out = RESULTS / "llamacpp"
    out.mkdir(parents=True, exist_ok=True)
    binary = build(args.llamacpp_version) if "llama.cpp" in args.systems else None
    tokenizer, dataset = str(gguf_tokenizer_dir(default_gguf_path())), repaired_sharegpt_path()
    results = {s: run_system(s, args, binary, tokenizer, dataset, out) for s in args.systems}
    meta = {"model": default_gguf_path().name, "cores": args.cores, "cpu_flags": cpu_flags(), "num_prompts": args.num_prompts,
            "output_len": args.output_len, "context_len": args.context_len, "parallel": args.parallel,
            "llamacpp_version": args.llamacpp_version, "repeats": args.repeats, "when": time.strftime("%Y-%m-%d %H:%M")}
    rows = table(results)
    path = write_results("llamacpp", {**meta, "results": results})
    write_markdown(rows, meta, RESULTS / "llamacpp.md")
    print_table(rows, list(rows[0]), title=f"Bullet vs llama-server ({path})")


if __name__ == "__main__":
    main()
