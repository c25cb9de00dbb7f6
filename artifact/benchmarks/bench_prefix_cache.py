"""The prefix cache, on and off, on the two workloads where it matters: SGLang's generated
shared-prefix workload and a multi-turn ShareGPT replay (closed loop, think time) — simulated on the
A100 model (Llama-3.1-8B) and served on this CPU (SmolLM2-135M), Bullet beside chunked:256/1024,
each side by side in one run.

    python -m artifact.benchmarks.bench_prefix_cache --sim            # seconds
    python -m artifact.benchmarks.bench_prefix_cache --served         # minutes (starts a server per system)

Writes results/prefix_cache_{sim,served}.json and prints one table per workload."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from artifact.benchmarks.common import print_table, write_results
from artifact.server import BulletServer
from bullet.sim import SimConfig, Simulation
from bullet.sim.conversations import ConversationSimulation
from bullet.workloads.multiturn import sharegpt_conversations, synthetic_conversations
from bullet.workloads.multiturn_client import replay, stream_generate
from bullet.workloads.shared_prefix import generated_shared_prefix, token_ids

SIM_SYSTEMS = [("bullet", False), ("bullet", True), ("chunked:256", False), ("chunked:256", True),
               ("chunked:1024", False), ("chunked:1024", True)]
SERVED_SYSTEMS = [("bullet", False), ("bullet", True), ("chunked:256", False), ("chunked:256", True)]


def _p(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def sim_rows(seed: int = 0) -> dict:

    gsp = generated_shared_prefix(num_groups=16, prompts_per_group=32, system_prompt_len=2048, question_len=128,
                                  output_len=256, rate=8.0, seed=seed)
    try:
        convs, source = sharegpt_conversations(200, rate=2.0, seed=seed, min_turns=3, max_turns=8,
                                               max_user=1024, max_answer=512, max_context=8192), "sharegpt"
    except Exception:  # the dataset package is optional
        convs, source = synthetic_conversations(200, rate=2.0, turns=5, user_tokens=400, answer_tokens=250,
                                                seed=seed), "synthetic"
    out = {"multi-turn source": source}
    for name, make in (("shared-prefix", lambda cfg: Simulation(cfg, gsp)),
                       ("multi-turn", lambda cfg: ConversationSimulation(cfg, convs, think_s=2.0))):
        rows = []
        for policy, cache in SIM_SYSTEMS:
            cfg = SimConfig(policy=policy, radix_cache=cache, ttft_slo="3ms/token", tpot_slo="150ms", seed=seed)
            result = make(cfg).run()
            s = result.summary
            prompt = sum(r.input_len for r in result.records)
            rows.append({"system": policy, "cache": "on" if cache else "off",
                         "mean TTFT ms": s["mean_ttft_s"] * 1e3, "p90 TTFT ms": s["p90_ttft_s"] * 1e3,
                         "mean TPOT ms": s["mean_tpot_s"] * 1e3, "output tok/s": s["output_tok_per_s"],
                         "attainment": s["attainment"],
                         "hit %": 100.0 * result.counters.get("cache_hit_tokens", 0) / prompt if prompt else 0.0})
        out[name] = rows
    return out


def _served_gsp(url: str, vocab: int, seed: int) -> list[dict]:

    reqs = generated_shared_prefix(num_groups=3, prompts_per_group=4, system_prompt_len=512, question_len=64,
                                   output_len=16, rate=2.0, seed=seed)
    prompts = token_ids(reqs, vocab, seed)
    records, lock, t0 = [], threading.Lock(), time.monotonic()

    def one(r, ids):
        time.sleep(max(0.0, r.arrival - (time.monotonic() - t0)))
        start = time.monotonic()
        ttft, last = stream_generate(url, {"input_ids": ids, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": r.output_tokens, "ignore_eos": True}}, 600)
        with lock:
            records.append({"ttft": ttft, "latency": time.monotonic() - start, "prompt": len(ids),
                            "cached": last["meta_info"]["cached_tokens"], "output": len(last["output_ids"])})

    threads = [threading.Thread(target=one, args=a) for a in zip(reqs, prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def served_rows(seed: int = 0) -> dict:

    convs = synthetic_conversations(3, rate=1.0, turns=3, user_tokens=200, answer_tokens=16, seed=seed)
    out = {"shared-prefix": [], "multi-turn": []}
    for policy, cache in SERVED_SYSTEMS:
        args = ["--policy", policy, "--max-total-tokens", "16384"] + ([] if cache else ["--disable-radix-cache"])
        with BulletServer(*args) as server:
            for name in ("shared-prefix", "multi-turn"):
                server.post("/flush_cache", {})
                t0 = time.monotonic()
                if name == "shared-prefix":
                    recs = _served_gsp(server.url, 49152, seed)  # SmolLM2's vocabulary
                else:
                    recs = [vars(r) | {"prompt": r.prompt_tokens, "cached": r.cached_tokens, "output": r.output_tokens}
                            for r in replay(server.url, convs, lambda text: [], think_s=1.0)]
                wall = time.monotonic() - t0
                ttfts = [r["ttft"] for r in recs]
                out[name].append({"system": policy, "cache": "on" if cache else "off",
                                  "mean TTFT ms": statistics.mean(ttfts) * 1e3, "p90 TTFT ms": _p(ttfts, 0.9) * 1e3,
                                  "output tok/s": sum(r["output"] for r in recs) / wall,
                                  "hit %": 100.0 * sum(r["cached"] for r in recs) / sum(r["prompt"] for r in recs),
                                  "requests": len(recs)})
                print(name, out[name][-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true")
    ap.add_argument("--served", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    columns = ["system", "cache", "mean TTFT ms", "p90 TTFT ms", "mean TPOT ms", "output tok/s", "hit %", "attainment"]
    for flag, name, run in (("sim", "prefix_cache_sim", sim_rows), ("served", "prefix_cache_served", served_rows)):
        if not getattr(args, flag):
            continue
        t0 = time.monotonic()
        result = run(args.seed)
        result["wall_s"] = time.monotonic() - t0
        path = write_results(name, result)
        for workload in ("shared-prefix", "multi-turn"):
            print_table(result[workload], [c for c in columns if c in result[workload][0]], f"{name}: {workload}")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
