"""Measure what `apply` costs: the "resource re-configuration" row of Bullet Table 5.

    python -m bullet.partition.bench --backend cpu --role decode --iters 2000

Alternates the share between two sizes (a real change every call, as when the policy moves units
between the workers) in a process whose torch thread pool is already running, like a worker's, and
prints mean / P50 / P99 / max of `apply` in microseconds."""

from __future__ import annotations

import argparse
import json
import sys

from bullet.partition import make_backend


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--role", default="decode", choices=("prefill", "decode"))
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--shares", default=None,
                        help="comma-separated shares to cycle through (default: smallest and largest)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    a = torch.randn(256, 256)
    (a @ a).sum()  # start the intra-op pool: its threads are what apply has to move
    backend = make_backend(args.backend, args.role)
    feasible = backend.feasible_units()
    shares = [int(s) for s in args.shares.split(",")] if args.shares else [feasible[0], feasible[-1]]
    for i in range(args.iters):
        backend.apply(shares[i % len(shares)])
    summary = backend.apply_costs().as_dict()
    summary.update(backend=args.backend, role=args.role, shares=shares)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.backend} apply over {summary['count']} calls cycling {shares}: mean {summary['mean_us']:.1f} µs,"
              f" P50 {summary['p50_us']:.1f} µs, P99 {summary['p99_us']:.1f} µs, max {summary['max_us']:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
