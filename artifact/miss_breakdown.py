"""Which requests miss their SLO in one simulated run, and why: TTFT or TPOT, with TTFT misses
binned by prompt length (the breakdown behind docs/policy.md's ShareGPT analysis).

    python -m artifact.miss_breakdown --workload sharegpt --rate 19 --seed 1 --policies bullet sglang:1024"""

from __future__ import annotations

import argparse
import collections

from bullet.commands.simulate import TABLE4_SLOS
from bullet.sim import SimConfig, Simulation
from bullet.types.slo import SLO
from bullet.workloads.traces import build_workload


def prompt_bucket(input_len: int) -> int:
    """The power of two at or below a prompt's length: the bins of every miss breakdown."""
    return 1 << max(0, input_len.bit_length() - 1)


def breakdown(workload: str, policy: str, rate: float, seed: int, duration: float) -> dict:
    ttft, tpot = TABLE4_SLOS[workload]
    slo = SLO.parse(ttft, tpot)
    result = Simulation(SimConfig(policy=policy, ttft_slo=ttft, tpot_slo=tpot, seed=seed),
                        build_workload(workload, rate, duration, seed)).run()
    kinds, sizes, ttft_missed = collections.Counter(), collections.Counter(), collections.Counter()
    for r in result.records:
        t_ok = r.ok and r.ttft <= slo.ttft_target(r.input_len)
        p_ok = r.ok and (r.tpot is None or r.tpot <= slo.tpot)
        kinds["ttft missed"] += not t_ok
        kinds["tpot missed"] += not p_ok
        size = prompt_bucket(r.input_len)
        sizes[size] += 1
        ttft_missed[size] += not t_ok
    return {"attainment": result.summary["attainment"], **kinds,
            "ttft_missed_by_prompt": {f"{s}-{2 * s - 1}": f"{ttft_missed[s]}/{sizes[s]}" for s in sorted(sizes)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="sharegpt", choices=sorted(TABLE4_SLOS))
    ap.add_argument("--rate", type=float, default=19.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--policies", nargs="+", default=["bullet", "sglang:1024"])
    args = ap.parse_args(argv)
    for policy in args.policies:
        print(policy, breakdown(args.workload, policy, args.rate, args.seed, args.duration))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
