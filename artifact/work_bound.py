"""How much device work a workload's requests need, and the arrival rates that work allows — the
ceiling any scheduling policy meets on the simulated device (docs/policy.md uses it to say why a
workload's goodput cannot grow past a point).

    python -m artifact.work_bound [--workloads sharegpt arxiv] [--seed 1]

For every request of `--duration` seconds of the workload (its lengths; the rate only sets how many):
* prefill: device-seconds on every unit, prompts packed in arrival order into batches of at most
  `--pack-tokens` tokens (bigger batches amortize the weight reads; no TTFT target is charged);
* decode: its output tokens at the per-token cost of the largest batch whose step still meets the TPOT
  target on every unit and whose KV fits the pool, at the workload's mean context (an optimistic
  decode cost: real batches are as large as the arrivals make them).

Two rates follow. `prefill bound` = 1 / prefill device-seconds per request: no policy can serve more,
since a prompt's prefill on fewer units is never faster per token than on all of them. `serial bound`
= 1 / (prefill + decode): what a system that runs prefill and decode one after the other (chunked
prefill, SGLang's default) reaches at most; a spatial split can pass it only by overlapping the two."""

from __future__ import annotations

import argparse
import json
import statistics

from bullet.commands.simulate import TABLE4_SLOS
from bullet.sim import SimConfig
from bullet.sim.config import device_estimator, kv_pool_pages
from bullet.types.slo import SLO
from bullet.workloads.traces import build_workload

WORKLOADS = ("sharegpt", "sharegpt-uncapped", "azure-code", "arxiv")


def packed_prefill_seconds(est, prompts: list[int], pack_tokens: int) -> float:
    units, total, pack, packed = est.hardware.units, 0.0, [], 0
    for tokens in prompts:
        if pack and packed + tokens > pack_tokens:
            total += est.prefill_time(pack, units)
            pack, packed = [], 0
        pack.append(tokens)
        packed += tokens
    return total + (est.prefill_time(pack, units) if pack else 0.0)


def decode_cost_per_token(est, context: float, tpot: float, max_tokens: int) -> tuple[int, float]:
    """(batch, seconds per token) of the largest batch at `context` tokens each whose step meets `tpot`
    and whose KV (`batch * context`) fits in `max_tokens`."""
    units, best = est.hardware.units, None
    for batch in range(1, int(max_tokens // context) + 1):
        step = est.decode_time(batch, int(batch * context), units)
        if step > tpot:
            break
        best = (batch, step / batch)
    if best is None:
        raise ValueError(f"no decode batch meets a {tpot * 1e3:.0f} ms TPOT at {context:.0f} tokens of context")
    return best


def work_bound(workload: str, seed: int = 1, duration: float = 300.0, pack_tokens: int = 8192,
               rate: float = 10.0) -> dict:
    ttft, tpot = TABLE4_SLOS[workload]
    config = SimConfig(policy="bullet", ttft_slo=ttft, tpot_slo=tpot)
    est = device_estimator(config)
    pool_tokens = kv_pool_pages(config, est.model, est.hardware) * config.page_size
    requests = build_workload(workload, rate, duration, seed)
    prefill = packed_prefill_seconds(est, [r.prompt_tokens for r in requests], pack_tokens) / len(requests)
    context = statistics.mean(r.prompt_tokens + r.output_tokens / 2 for r in requests)
    output = statistics.mean(r.output_tokens for r in requests)
    batch, per_token = decode_cost_per_token(est, context, SLO.parse(ttft, tpot).tpot, pool_tokens)
    decode = output * per_token
    return {"workload": workload, "requests": len(requests),
            "mean prompt": statistics.mean(r.prompt_tokens for r in requests), "mean output": output,
            "prefill ms/req": prefill * 1e3, "decode ms/req": decode * 1e3, "decode batch": batch,
            "prefill bound req/s": 1 / prefill, "serial bound req/s": 1 / (prefill + decode)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=sorted(TABLE4_SLOS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals whose lengths are used")
    ap.add_argument("--pack-tokens", type=int, default=8192, help="largest packed prefill batch")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    rows = [work_bound(w, args.seed, args.duration, args.pack_tokens) for w in args.workloads]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
