"""The runs behind `artifact.prefix_comparison`: the simulated A100 (the same policies and prefix cache
on virtual time) and the served CPU (a real server per system and cache setting, SGLang's own client
for the shared-prefix workload, the multi-turn replay client for conversations)."""

from __future__ import annotations

import os
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from artifact.bench_client import run_bench_serving
from artifact.server import BulletServer
from bullet.sim import SimConfig, Simulation
from bullet.sim.conversations import ConversationSimulation
from bullet.workloads.multiturn import sharegpt_conversations, synthetic_conversations
from bullet.workloads.multiturn_client import replay
from bullet.workloads.shared_prefix import generated_shared_prefix
from engines.tokenizer import gguf_tokenizer_dir
from engines.weights.resolve import default_gguf_path

SIM_SYSTEMS = [("bullet", False), ("bullet", True), ("chunked:256", False), ("chunked:256", True),
               ("chunked:1024", False), ("chunked:1024", True)]
SERVED_SYSTEMS = SIM_SYSTEMS
SIM_SLO = {"ttft_slo": "3ms/token", "tpot_slo": "150ms"}
SIM_THINK_S = 2.0


def percentile(values, q: float) -> float:
    return float(np.percentile(values, 100 * q)) if len(values) else float("nan")


def mean_interval(values, resamples: int = 4000, seed: int = 0) -> dict:
    """Mean with its 95 % percentile-bootstrap interval over the values (requests)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"value": float("nan"), "low": float("nan"), "high": float("nan")}
    reps = np.random.default_rng(seed).choice(v, size=(resamples, v.size)).mean(axis=1)
    return {"value": float(v.mean()), "low": float(np.percentile(reps, 2.5)), "high": float(np.percentile(reps, 97.5))}


# ---------------------------------------------------------------- simulated

def _sim_workloads(cfg: dict, seed: int):
    gsp = generated_shared_prefix(**cfg["gsp"], seed=seed)
    try:
        convs = sharegpt_conversations(**cfg["convs"], seed=seed, min_turns=3, max_turns=8, max_user=1024,
                                       max_answer=512, max_context=8192)
        source = "sharegpt"
    except Exception:  # noqa: BLE001 — the dataset package is optional: fixed-shape conversations instead
        convs, source = synthetic_conversations(**cfg["convs"], turns=5, user_tokens=400, answer_tokens=250,
                                                seed=seed), "synthetic"
    return gsp, convs, source


def _sim_row(policy: str, cache: bool, make, seed: int) -> dict:
    config = SimConfig(policy=policy, radix_cache=cache, seed=seed, **SIM_SLO)
    sim = make(config)
    result = sim.run()
    s, prompt = result.summary, sum(r.input_len for r in result.records)
    row = {"mean TTFT ms": s["mean_ttft_s"] * 1e3, "p90 TTFT ms": s["p90_ttft_s"] * 1e3,
           "mean TPOT ms": s["mean_tpot_s"] * 1e3, "output tok/s": s["output_tok_per_s"],
           "hit %": 100.0 * result.counters.get("cache_hit_tokens", 0) / prompt if prompt else 0.0,
           "attainment": s["attainment"], "requests": len(result.records)}
    if isinstance(sim, ConversationSimulation):  # TTFT of turns 2.. (the ones a cache can serve)
        later = [r.ttft for r in result.records if r.ok and sim._turn[int(r.rid[1:])][1] > 0]
        row["later-turn TTFT ms"] = statistics.fmean(later) * 1e3 if later else float("nan")
    return row


def _combine(rows: list[dict]) -> dict:
    """One row per system over seeds: a single seed as is, several as mean [min, max]."""
    if len(rows) == 1:
        return rows[0]
    out = {}
    for key in rows[0]:
        vals = [r[key] for r in rows]
        out[key] = ({"value": statistics.fmean(vals), "low": min(vals), "high": max(vals)}
                    if isinstance(vals[0], float) else sum(vals))
    return out


def sim_rows(cfg: dict) -> dict:
    out = {"seeds": cfg["seeds"], "sizes": {"gsp": cfg["gsp"], "convs": cfg["convs"]}, "think_s": SIM_THINK_S,
           "slo": f"TTFT {SIM_SLO['ttft_slo']}, TPOT {SIM_SLO['tpot_slo']}", "shared-prefix": [], "multi-turn": []}
    per_seed = {seed: _sim_workloads(cfg, seed) for seed in cfg["seeds"]}
    out["multi-turn source"] = per_seed[cfg["seeds"][0]][2]
    for policy, cache in cfg["systems"]:
        for name in ("shared-prefix", "multi-turn"):
            rows = []
            for seed, (gsp, convs, _) in per_seed.items():
                make = ((lambda c, g=gsp: Simulation(c, g)) if name == "shared-prefix" else
                        (lambda c, v=convs: ConversationSimulation(c, v, think_s=SIM_THINK_S)))
                rows.append(_sim_row(policy, cache, make, seed))
            row = {"system": policy, "cache": "on" if cache else "off", **_combine(rows)}
            out[name].append(row)
            print(f"[prefix] sim {name:>13} {policy:>12} cache {row['cache']:>3}: "
                  f"TTFT {_value(row['mean TTFT ms']):.0f} ms, hit {_value(row['hit %']):.0f} %", flush=True)
    return out


def _value(v) -> float:
    return v["value"] if isinstance(v, dict) else v


# ---------------------------------------------------------------- served

def _counters(url: str) -> dict[str, float]:
    """The server's prompt and cached token counters (Prometheus text from /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("sglang:prompt_tokens", "sglang:cached_tokens"):
            out[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def _served_row(policy: str, cache: bool, ttfts: list[float], tpots: list[float], later: list[float] | None,
                output_tokens: int, wall: float, before: dict, after: dict, requests: int) -> dict:
    prompt = after["sglang:prompt_tokens"] - before["sglang:prompt_tokens"]
    cached = after["sglang:cached_tokens"] - before["sglang:cached_tokens"]
    row = {"system": policy, "cache": "on" if cache else "off", "requests": requests,
           "mean TTFT ms": mean_interval([t * 1e3 for t in ttfts]), "p90 TTFT ms": percentile(ttfts, 0.9) * 1e3}
    if later is not None:
        row["later-turn TTFT ms"] = mean_interval([t * 1e3 for t in later])
    if tpots:
        row["mean TPOT ms"] = statistics.fmean(tpots) * 1e3
    row |= {"output tok/s": output_tokens / wall, "hit %": 100.0 * cached / prompt if prompt else 0.0}
    return row


def _shared_prefix(server: BulletServer, cfg: dict, tokenizer_dir: str, out: Path, name: str, policy: str,
                   cache: bool) -> dict:
    g = cfg["gsp"]
    dataset = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(g["num_groups"]),
               "--gsp-prompts-per-group", str(g["prompts_per_group"]), "--gsp-system-prompt-len",
               str(g["system_prompt_len"]), "--gsp-question-len", str(g["question_len"]),
               "--gsp-output-len", str(g["output_len"]), "--flush-cache"]
    before = _counters(server.url)
    result, recs = run_bench_serving(server.url, tokenizer_dir, None, g["rate"], g["num_groups"] * g["prompts_per_group"],
                                     out / f"bench-gsp-{name}.jsonl", 0, None, dataset_args=dataset, warmup=0)
    after = _counters(server.url)
    ok = [r for r in recs if r.ok]
    return _served_row(policy, cache, [r.ttft for r in ok], [r.tpot for r in ok if r.tpot is not None], None,
                       sum(r.output_len for r in ok), result["duration"], before, after, len(recs))


def _multi_turn(server: BulletServer, cfg: dict, tokenizer, convs, policy: str, cache: bool) -> dict:
    server.post("/flush_cache", {})
    before = _counters(server.url)
    t0 = time.monotonic()
    recs = replay(server.url, convs, lambda text: tokenizer.encode(text, add_special_tokens=False),
                  think_s=cfg["convs"]["think_s"])
    wall = time.monotonic() - t0
    after = _counters(server.url)
    ok = [r for r in recs if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return _served_row(policy, cache, [r.ttft for r in ok], tpots, [r.ttft for r in ok if r.turn > 0],
                       sum(r.output_tokens for r in ok), wall, before, after, len(recs))


def served_rows(cfg: dict, out: Path) -> dict:
    from transformers import AutoTokenizer  # deferred: transformers loads for the served part only

    tokenizer_dir = str(gguf_tokenizer_dir(default_gguf_path()))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    c = cfg["convs"]
    convs = sharegpt_conversations(c["num"], rate=c["rate"], seed=0, min_turns=2, max_turns=c["max_turns"],
                                   max_user=c["max_user"], max_answer=c["max_answer"], max_context=2048,
                                   count=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    result = {"sizes": {"gsp": cfg["gsp"], "convs": c}, "shared-prefix": [], "multi-turn": []}
    for policy, cache in cfg["systems"]:
        name = f"{policy.replace(':', '-')}-{'on' if cache else 'off'}"
        args = ["--policy", policy, "--max-total-tokens", "16384", "--log-level", "warning"]
        args += [] if cache else ["--disable-radix-cache"]
        print(f"[prefix] served {policy} cache {'on' if cache else 'off'}: starting the server", flush=True)
        with BulletServer(*args, log_path=str(out / f"server-{name}.log")) as server:
            for workload, run in (("shared-prefix", lambda: _shared_prefix(server, cfg, tokenizer_dir, out, name,
                                                                           policy, cache)),
                                  ("multi-turn", lambda: _multi_turn(server, cfg, tokenizer, convs, policy, cache))):
                row = run()
                result[workload].append(row)
                print(f"[prefix] served {workload:>13} {policy:>12} cache {row['cache']:>3}: "
                      f"TTFT {row['mean TTFT ms']['value']:.0f} ms, hit {row['hit %']:.0f} %, "
                      f"{row['output tok/s']:.1f} tok/s", flush=True)
        os.unlink(out / f"server-{name}.log")  # kept only when a server failed
    return result
