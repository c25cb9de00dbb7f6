"""Scale-out on one host: one Bullet replica on two cores vs two replicas on one core each behind
SGLang's router (`sglang-router`), under the same `sglang.bench_serving` load (ShareGPT prompts,
fixed output length, Poisson arrivals). Both setups run one after the other in one invocation, so
their numbers compare; results go to artifact/results/bench_router.json and a table.

    python artifact/benchmarks/bench_router.py [--num-prompts 32] [--request-rate 2] [--output-len 32]

Both setups are driven through /v1/completions (see `bench`). The router uses round-robin here: the prompts share no prefix, and at this load the cache-aware
policy (which balances only past 64 requests of imbalance) may send them all to one replica."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from artifact.benchmarks.common import print_table, write_results
from artifact.router import SGLangRouter
from artifact.server import BulletServer
from bullet.workloads.sharegpt import repaired_sharegpt_path

METRICS = ["completed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "p99_tpot_ms", "mean_e2e_latency_ms"]


def bench(url: str, tokenizer: str, model: str, args, out: Path) -> dict:
    # the OpenAI-completions client ("vllm" in bench_serving's list): with an "sglang*" backend,
    # bench_serving 0.5.2 reads /get_server_info's internal_states at the end, which the router
    # (0.3.2) answers with its own info instead, and the run fails
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "vllm", "--base-url", url,
           "--model", model,  # the router's /v1/models says "unknown", which Bullet would answer 404
           "--tokenizer", tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(repaired_sharegpt_path()),
           "--num-prompts", str(args.num_prompts), "--sharegpt-output-len", str(args.output_len),
           "--sharegpt-context-len", str(args.context_len), "--request-rate", str(args.request_rate),
           "--seed", "1", "--warmup-requests", "1", "--output-file", str(out), "--disable-tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_serving failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads([ln for ln in out.read_text().splitlines() if ln.strip()][-1])


def cpu_flags() -> list[str]:
    import re

    flags = set(re.findall(r"\b(avx[0-9a-z_]*|amx[a-z_]*)\b", Path("/proc/cpuinfo").read_text()))
    return sorted(flags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--policy", default="static", help="Bullet's policy in every replica")
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        sys.exit("needs two cores")
    common = ("--max-total-tokens", "8192", "--policy", args.policy)
    rows, tmp = [], Path(tempfile.mkdtemp(prefix="bench-router-"))
    with BulletServer(*common, "--cores", f"{cores[0]},{cores[1]}") as one:
        info = one.get("/model_info")[1]
        tokenizer, model = info["tokenizer_path"], info["served_model_name"]
        rows.append({"setup": "1 replica x 2 cores", **bench(one.url, tokenizer, model, args, tmp / "one.jsonl")})
    with ExitStack() as stack:
        replicas = [stack.enter_context(BulletServer(*common, "--cores", str(c))) for c in cores]
        router = stack.enter_context(SGLangRouter([r.url for r in replicas], "round_robin"))
        rows.append({"setup": "2 replicas x 1 core + router", **bench(router.url, tokenizer, model, args,
                                                                        tmp / "two.jsonl")})
    table = [{"setup": r["setup"], **{k: r[k] for k in METRICS}} for r in rows]
    ratio = {k: table[1][k] / table[0][k] for k in METRICS[1:] if table[0][k]}
    path = write_results("bench_router", {"args": vars(args), "cpu_flags": cpu_flags(), "rows": table,
                                          "two_over_one": ratio})
    print_table(table, ["setup", *METRICS], title="1 replica on 2 cores vs 2 replicas on 1 core each")
    print("2 replicas / 1 replica:", {k: round(v, 2) for k, v in ratio.items()})
    print(f"cpu flags: {' '.join(cpu_flags())}; results: {path}")


if __name__ == "__main__":
    main()
