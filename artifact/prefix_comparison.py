"""The prefix cache on the two workloads where it matters, cache on vs off, Bullet beside chunked
prefill (token budgets 256 and 1024), each part side by side in one run:

* **shared prefix** — SGLang's generated shared-prefix workload: groups of prompts that begin with
  the same system prompt, shuffled, Poisson arrivals. Served, it is driven by SGLang's own client
  (`bench_serving --dataset-name generated-shared-prefix`); simulated, by the same shape
  (`bullet.workloads.shared_prefix`).
* **multi-turn** — ShareGPT conversations replayed closed loop: turn k's prompt is the history so far
  plus the next user message, sent a think time after turn k-1's answer arrived
  (`bullet.workloads.multiturn`; served with the real ShareGPT text through the server's tokenizer).

    python -m artifact.prefix_comparison --mode quick --out artifact/results/prefix   # ~10 minutes
    python -m artifact.prefix_comparison --mode full --out docs/prefix_cache          # ~25 minutes
    python -m artifact.prefix_comparison --mode smoke --out /tmp/prefix --parts sim   # seconds

`--parts sim` runs the simulated A100 (Llama-3.1-8B) only; `--parts served` the CPU servers
(SmolLM2-135M, a server per system and cache setting) only. Writes results.json and results.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from artifact.benchmarks.common import machine
from artifact.evaluation.environment import cpu_info
from artifact.prefix_runs import SERVED_SYSTEMS, SIM_SYSTEMS, served_rows, sim_rows

# sizes per mode; the simulated ones follow SGLang's defaults for the shared-prefix shape, scaled to the rate an
# A100 sustains; the served ones are what two CPU cores serve within minutes
SIM = {
    "smoke": {"gsp": dict(num_groups=4, prompts_per_group=8, system_prompt_len=1024, question_len=64, output_len=32,
                          rate=4.0),
              "convs": dict(num=20, rate=2.0), "seeds": [0], "systems": SIM_SYSTEMS[:4]},
    "quick": {"gsp": dict(num_groups=16, prompts_per_group=32, system_prompt_len=2048, question_len=128,
                          output_len=256, rate=8.0),
              "convs": dict(num=200, rate=2.0), "seeds": [0], "systems": SIM_SYSTEMS},
    "full": {"gsp": dict(num_groups=16, prompts_per_group=32, system_prompt_len=2048, question_len=128,
                         output_len=256, rate=8.0),
             "convs": dict(num=200, rate=2.0), "seeds": [0, 1, 2], "systems": SIM_SYSTEMS},
}
SERVED = {
    "smoke": None,
    "quick": {"gsp": dict(num_groups=3, prompts_per_group=4, system_prompt_len=512, question_len=64, output_len=16,
                          rate=2.0),
              "convs": dict(num=4, rate=1.0, max_turns=3, max_user=200, max_answer=16, think_s=0.5),
              "systems": [s for s in SERVED_SYSTEMS if s[0] != "chunked:1024"]},
    "full": {"gsp": dict(num_groups=4, prompts_per_group=8, system_prompt_len=512, question_len=64, output_len=16,
                         rate=2.0),
             "convs": dict(num=8, rate=0.5, max_turns=4, max_user=256, max_answer=24, think_s=1.0),
             "systems": SERVED_SYSTEMS},
}
COLUMNS = ["system", "cache", "requests", "mean TTFT ms", "p90 TTFT ms", "later-turn TTFT ms", "mean TPOT ms",
           "output tok/s", "hit %", "attainment"]


def _fmt(v) -> str:
    if isinstance(v, dict) and "value" in v:  # an interval
        return f"{_fmt(v['value'])} [{_fmt(v['low'])}, {_fmt(v['high'])}]"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


def table(rows: list[dict]) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def ratios(rows: list[dict], metric: str = "mean TTFT ms") -> list[str]:
    """Per system: cache off ÷ cache on of `metric` (how many times the cache cut it)."""
    out = []
    by = {(r["system"], r["cache"]): r for r in rows}
    for (system, cache), on in by.items():
        off = by.get((system, "off"))
        if cache == "on" and off:
            a, b = off[metric], on[metric]
            a, b = (a["value"], b["value"]) if isinstance(a, dict) else (a, b)
            out.append(f"{system}: {a / b:.1f}×" if b else f"{system}: -")
    return out


def _sizes(d: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d.items())


def _machine(m: dict) -> str:
    return (f"{m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores, flags {' '.join(m.get('cpu_flags', [])) or '-'}, "
            f"torch {m.get('torch', '?')}, {m.get('when', '')}")


def markdown(result: dict) -> str:
    parts = [f"# Prefix cache: shared-prefix and multi-turn ({result['mode']} mode)", "",
             f"Command: `{result['command']}` ({result['wall_s'] / 60:.1f} min). Machine: {_machine(result['machine'])}.", ""]
    sim = result.get("sim")
    if sim:
        parts += ["## Simulated: Llama-3.1-8B on the A100 device model", "",
                  f"Seeds {sim['seeds']} (a cell with several seeds is the mean [min, max] over them). "
                  f"Shared prefix: {_sizes(sim['sizes']['gsp'])}. Multi-turn: {_sizes(sim['sizes']['convs'])} "
                  f"({sim['multi-turn source']} conversations), think time {sim['think_s']} s. "
                  f"SLO {sim['slo']}.", ""]
        for workload in ("shared-prefix", "multi-turn"):
            parts += [f"### {workload}", "", table(sim[workload]), "",
                      "Mean TTFT, cache off ÷ on: " + ", ".join(ratios(sim[workload])), ""]
    served = result.get("served")
    if served:
        parts += ["## Served: SmolLM2-135M on this CPU", "",
                  f"Shared prefix: `sglang.bench_serving --dataset-name generated-shared-prefix` "
                  f"({_sizes(served['sizes']['gsp'])}); multi-turn: {_sizes(served['sizes']['convs'])}, ShareGPT conversations "
                  "(real text through the server's tokenizer, greedy, answers of fixed length). TTFT cells are "
                  "the mean with its 95 % bootstrap interval over requests; hit % from the server's "
                  "`sglang:cached_tokens` over `sglang:prompt_tokens`.", ""]
        for workload in ("shared-prefix", "multi-turn"):
            parts += [f"### {workload}", "", table(served[workload]), "",
                      "Mean TTFT, cache off ÷ on: " + ", ".join(ratios(served[workload])), ""]
    elif result.get("served_skipped"):
        parts += ["## Served", "", f"Skipped: {result['served_skipped']}.", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=list(SIM), default="quick")
    ap.add_argument("--out", type=Path, required=True, help="directory for results.json and results.md")
    ap.add_argument("--parts", nargs="+", choices=["sim", "served"], default=["sim", "served"])
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cpu = cpu_info()
    result = {"mode": args.mode, "machine": {**machine(), "cpu": cpu["model"], "cpu_flags": cpu["notable_flags"]}, "command": " ".join(["python -m artifact.prefix_comparison",
                                                                          *(argv if argv is not None else sys.argv[1:])])}
    if "sim" in args.parts:
        cfg = SIM[args.mode]
        print(f"[prefix] simulated: {len(cfg['systems'])} systems x 2 workloads x {len(cfg['seeds'])} seed(s)",
              flush=True)
        result["sim"] = sim_rows(cfg)
    if "served" in args.parts:
        cfg = SERVED[args.mode]
        if cfg is None:
            result["served_skipped"] = "smoke mode serves nothing (a server per system takes minutes)"
        else:
            result["served"] = served_rows(cfg, args.out)
    result["wall_s"] = time.monotonic() - t0
    (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "results.md").write_text(markdown(result))
    print(markdown(result))
    print(f"[prefix] wrote {args.out / 'results.md'} in {result['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
