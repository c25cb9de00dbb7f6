"""Bullet next to llama.cpp's `llama-server`: the same GGUF, the same cores, the same client.

  python artifact/benchmarks/bench_llamacpp.py [--rates 0.5 1 1.5] [--num-prompts 32] [--cores 0,1]
                                               [--systems llama.cpp chunked:1024 default] [--repeats 1]

A system is `llama.cpp`, or a Bullet policy (`default` = the server's default) with optional launch
flags in the same string, optionally preceded by environment assignments for the server:
`--systems llama.cpp default "default --tpot-slo 60ms" "BULLET_ATTENTION_KERNELS=torch default"`.

`--isa avx2` runs both servers on AVX2 kernels on a CPU that has AVX-512: llama-server built without
AVX-512 (`llamacpp_build --isa avx2`), Bullet with every kernel library torch uses capped at AVX2
(`engines.device.AVX2_ONLY_ENV`). Same silicon, so clocks and memory are this machine's, not an
AVX2 machine's; the results are written as llamacpp-avx2.{json,md}.

llama-server is built from the `llama-cpp-python` source release and cached
(`artifact.benchmarks.llamacpp_build`). Each system is started on `--cores` (llama-server under
`taskset` with one thread per core and `--parallel 8` slots; Bullet with `--cores`), then driven by
the same `python -m sglang.bench_serving --backend sglang-oai` command (ShareGPT prompts of at most
`--context-len` minus the output length, `--output-len` tokens each, greedy, ignore_eos) at each
rate and at saturation (all prompts at once, `inf`). Every point samples other prompts (the same for
every system), so no server's prompt cache answers a later point from an earlier one. Every server is
started first and the systems take turns at each rate and repeat, the first turn rotating (never two at once; measured idle, a
llama-server uses no CPU and a Bullet server ~2 % of one core), so a machine whose speed drifts over
minutes slows them alike; `--sequential` runs one server at a time through every rate instead.

Writes artifact/results/llamacpp.json (every bench_serving summary, CPU flags, the exact commands)
and artifact/results/llamacpp.md (the table, with each system's ratios to llama-server: saturated
throughput and mean TPOT at the same rate — the issue's goal is >= 0.8x and <= 1.25x)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from artifact.bench_client import point_seed, run_bench_serving
from artifact.benchmarks.common import RESULTS, print_table, write_results
from artifact.benchmarks.llamacpp_build import DEFAULT_VERSION, ISAS, build
from artifact.server import BulletServer, all_started, free_port, system_launch, system_slug
from bullet.workloads.sharegpt import repaired_sharegpt_path
from engines.device import AVX2_ONLY_ENV
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
    e.g. "default --tpot-slo 60ms", and optionally preceded by environment assignments for the server,
    as in a shell: "BULLET_ATTENTION_KERNELS=torch BULLET_CACHE_DIR=/tmp/c default"."""
    env, system = split_env(system)
    launch = ["--cores", args.cores, "--max-total-tokens", str(args.max_total_tokens), "--log-level", "warning",
              *system_launch(system)]
    env = {**(AVX2_ONLY_ENV if args.isa == "avx2" else {}), **env}
    server = BulletServer(*launch, log_path=str(log), env=env)
    server.extra_env = env  # recorded with the command
    return server


def split_env(system: str) -> tuple[dict[str, str], str]:
    """Leading NAME=value words of a system string -> (environment, the rest)."""
    words, env = shlex.split(system), {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, shlex.join(words)


def make_server(system: str, args, binary: Path | None, out: Path):
    cores = [int(c) for c in args.cores.split(",")]
    log = out / f"server-{system_slug(system)}.log"
    if system == "llama.cpp":
        return LlamaServer(binary, default_gguf_path(), cores, args.parallel, args.context_len, log)
    return bullet_server(system, args, log)


def run_point(system: str, server, rate: float, rep: int, args, tokenizer: str, dataset: Path, out: Path) -> dict:
    seed = point_seed(args.seed, [*args.rates, float("inf")].index(rate), rep)
    result, _ = run_bench_serving(server.url, tokenizer, dataset, rate, args.num_prompts,
                                  out / f"bench-{system_slug(system)}-{rate}-{rep}.jsonl", args.context_len,
                                  args.output_len, seed=seed, backend="sglang-oai")
    return {k: result.get(k) for k in METRICS}


def summarize(system: str, rate: float, runs: list[dict]) -> dict:
    summary = {k: statistics.median(r[k] for r in runs) for k in METRICS}
    print(f"[llamacpp-bench] {system:>13} @ {rate:>4} req/s: {summary['request_throughput']:.2f} req/s, "
          f"{summary['output_throughput']:.0f} out tok/s, TTFT {summary['mean_ttft_ms'] / 1e3:.2f} s, "
          f"TPOT {summary['mean_tpot_ms']:.0f} ms", flush=True)
    return {**summary, "runs": runs}


def command_of(server) -> list[str]:
    env = [f"{k}={v}" for k, v in getattr(server, "extra_env", {}).items()]
    return getattr(server, "cmd", None) or [*env, "bullet", "launch", *server.args]


def run_sequential(args, binary, tokenizer: str, dataset: Path, out: Path) -> dict:
    """One system after another, each through every rate (one server up at a time)."""
    results = {}
    for system in args.systems:
        with make_server(system, args, binary, out) as server:
            per_rate = {str(rate): summarize(system, rate, [run_point(system, server, rate, rep, args, tokenizer,
                                                                      dataset, out) for rep in range(args.repeats)])
                        for rate in [*args.rates, float("inf")]}
            results[system] = {"command": command_of(server), "per_rate": per_rate}
    return results


def run_interleaved(args, binary, tokenizer: str, dataset: Path, out: Path) -> dict:
    """Every server up at once (the idle ones sleep), and at each rate and repeat the systems take turns:
    a machine whose speed drifts over minutes then slows every system alike."""
    rates = [*args.rates, float("inf")]
    runs = {s: {rate: [] for rate in rates} for s in args.systems}
    with all_started({s: make_server(s, args, binary, out) for s in args.systems}) as servers:
        for rate in rates:
            for rep in range(args.repeats):
                # turns rotated: each system goes first once every len(systems) repeats
                turn = rep % len(servers)
                order = [*list(servers.items())[turn:], *list(servers.items())[:turn]]
                for system, server in order:
                    runs[system][rate].append(run_point(system, server, rate, rep, args, tokenizer, dataset, out))
        commands = {s: command_of(server) for s, server in servers.items()}
    return {s: {"command": commands[s],
                "per_rate": {str(rate): summarize(s, rate, runs[s][rate]) for rate in rates}} for s in args.systems}


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
    capped = ""
    if meta.get("isa") == "avx2":
        caps = " ".join(f"{k}={v}" for k, v in meta["bullet_env"].items())
        capped = f"; both servers on AVX2 kernels (Bullet: {caps}; llama-server built without AVX-512)"
    lines = [f"# Bullet vs llama-server ({meta['when']})", "",
             f"Same GGUF ({meta['model']}), cores {meta['cores']}, CPU flags: {' '.join(meta['cpu_flags'])}{capped}; "
             f"`sglang.bench_serving --backend sglang-oai`, ShareGPT, {meta['num_prompts']} prompts, "
             f"{meta['output_len']} output tokens, context <= {meta['context_len']}; llama.cpp {meta['llamacpp_version']} "
             f"with {meta['parallel']} slots; systems {meta.get('order', 'sequential')}, other prompts at every point. "
             "Ratios are to llama-server at the same rate (`inf` = all prompts at once).", "",
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
    ap.add_argument("--sequential", action="store_true",
                    help="one server at a time, each through every rate (default: all up, taking turns per point)")
    ap.add_argument("--isa", choices=ISAS, default="native",
                    help="native: this CPU's kernels; avx2: both servers capped at AVX2 kernels (no AVX-512)")
    args = ap.parse_args()
    name = "llamacpp" if args.isa == "native" else f"llamacpp-{args.isa}"
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    binary = build(args.llamacpp_version, isa=args.isa) if "llama.cpp" in args.systems else None
    tokenizer, dataset = str(gguf_tokenizer_dir(default_gguf_path())), repaired_sharegpt_path()
    run = run_sequential if args.sequential else run_interleaved
    results = run(args, binary, tokenizer, dataset, out)
    meta = {"model": default_gguf_path().name, "cores": args.cores, "cpu_flags": cpu_flags(), "num_prompts": args.num_prompts,
            "output_len": args.output_len, "context_len": args.context_len, "parallel": args.parallel,
            "llamacpp_version": args.llamacpp_version, "repeats": args.repeats, "isa": args.isa,
            "order": "sequential" if args.sequential else "interleaved",
            "bullet_env": AVX2_ONLY_ENV if args.isa == "avx2" else {}, "when": time.strftime("%Y-%m-%d %H:%M")}
    rows = table(results)
    path = write_results(name, {**meta, "results": results})
    write_markdown(rows, meta, RESULTS / f"{name}.md")
    print_table(rows, list(rows[0]), title=f"Bullet vs llama-server ({path})")


if __name__ == "__main__":
    main()
