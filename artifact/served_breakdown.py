"""Why a served comparison came out as it did: for each system and rate of a `cpu_comparison` run,
which requests missed (TTFT or TPOT, TTFT misses and mean TTFT by prompt length), and for the
partitioned systems what their decision timelines say about prefill's cores — how much of prefill's
busy time ran on every core, and how much of decode's time held every core while prefill was idle.

    python -m artifact.served_breakdown artifact/results/full/06_cpu_comparison [--out breakdown.md]

Reads what `python -m artifact.cpu_comparison` wrote (results.json, bench-*.jsonl, timeline/); runs
nothing."""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from artifact.bench_client import RequestRecord, read_bench_file
from artifact.miss_breakdown import prompt_bucket
from artifact.server import system_slug
from bullet.loops.timeline import recorded_beside
from bullet.types.slo import SLO


def misses(records: list[RequestRecord], slo: SLO) -> dict:
    """TTFT and TPOT misses (a failed request misses both), TTFT misses and mean TTFT per prompt bucket."""
    ttft_missed = tpot_missed = 0
    count, missed, ttft_sum = collections.Counter(), collections.Counter(), collections.Counter()
    for r in records:
        t_miss = not r.ok or r.ttft > slo.ttft_target(r.input_len)
        ttft_missed += t_miss
        tpot_missed += not r.ok or (r.tpot is not None and r.tpot > slo.tpot)
        b = prompt_bucket(r.input_len)
        count[b] += 1
        missed[b] += t_miss
        ttft_sum[b] += r.ttft if r.ok else 0.0
    by_prompt = {f"{b}-{2 * b - 1}": {"requests": count[b], "ttft_missed": missed[b],
                                      "mean_ttft_s": ttft_sum[b] / count[b]} for b in sorted(count)}
    return {"requests": len(records), "ttft_missed": ttft_missed, "tpot_missed": tpot_missed, "by_prompt": by_prompt}


def _time_by_units(rows: list[dict]) -> tuple[float, dict]:
    """Busy seconds of one worker and the share of them spent on each number of units."""
    by_units = collections.Counter()
    for r in rows:
        if r.get("run"):
            by_units[r["units"]] += (r.get("obs_ms") or 0.0) / 1e3
    busy = sum(by_units.values())
    return busy, {u: by_units[u] / busy for u in sorted(by_units)} if busy else {}


def timeline_shares(timeline_dir: Path) -> dict | None:
    """Each worker's busy time by how many units it ran on, and the share of decode's time with
    prefill idle (a prompt arriving then starts on a unit decode's step may still occupy)."""
    prefill, decode = timeline_dir / "prefill.jsonl", timeline_dir / "decode.jsonl"
    if not (prefill.exists() and decode.exists()):
        return None  # one-process systems (chunked, sglang) have a single worker and no split
    rows = {role: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for role, path in (("prefill", prefill), ("decode", decode))}
    prefill_busy, prefill_units = _time_by_units(rows["prefill"])
    decode_busy, decode_units = _time_by_units(rows["decode"])
    alone = sum((r.get("obs_ms") or 0.0) / 1e3 for r in rows["decode"] if r.get("run") and not recorded_beside(r))
    return {"prefill_busy_s": prefill_busy, "prefill_share_by_units": prefill_units,
            "decode_busy_s": decode_busy, "decode_share_by_units": decode_units,
            "decode_prefill_idle": alone / decode_busy if decode_busy else 0.0}


def breakdown(run_dir: Path) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    slo = SLO(results["slo"]["ttft_s_per_token"], True, results["slo"]["tpot_s"])
    out = {}
    for system, res in results["systems"].items():
        slug = system_slug(system)
        per_rate = {}
        for rate in res["per_rate"]:
            files = sorted(run_dir.glob(f"bench-{slug}-{float(rate)}-*.jsonl"))
            if not files:  # a table of 0/0 rows would read as a run that served nothing
                raise FileNotFoundError(f"{run_dir} has no bench-{slug}-{float(rate)}-*.jsonl for {system} at "
                                        f"{rate} req/s: the per-request records cpu_comparison writes beside "
                                        "results.json are needed (copy them with it)")
            per_rate[rate] = misses([r for f in files for r in read_bench_file(f)[1]], slo)
        out[system] = {"per_rate": per_rate, "timeline": timeline_shares(run_dir / "timeline" / slug)}
    return {"slo": slo.describe(), "systems": out}


def _shares(shares: dict) -> str:
    return " / ".join(f"{u}: {100 * v:.0f} %" for u, v in shares.items())


def markdown(data: dict) -> str:
    lines = [f"SLO: {data['slo']}. TTFT misses / requests by prompt length (tokens), mean TTFT in seconds.", ""]
    buckets = sorted({b for s in data["systems"].values() for r in s["per_rate"].values() for b in r["by_prompt"]},
                     key=lambda b: int(b.split("-")[0]))
    lines += ["| system | rate | TTFT missed | TPOT missed | " + " | ".join(buckets) + " |",
              "|---|---|---|---|" + "---|" * len(buckets)]
    for system, s in data["systems"].items():
        for rate, r in s["per_rate"].items():
            cells = [(lambda c: f"{c['ttft_missed']}/{c['requests']} ({c['mean_ttft_s']:.2f})" if c else "-")(
                r["by_prompt"].get(b)) for b in buckets]
            lines.append(f"| {system} | {float(rate):g} | {r['ttft_missed']}/{r['requests']} | "
                         f"{r['tpot_missed']}/{r['requests']} | " + " | ".join(cells) + " |")
    split = [(system, s["timeline"]) for system, s in data["systems"].items() if s["timeline"]]
    if split:
        lines += ["", "Decision timelines of the two-worker systems (the whole run, every rate): each worker's busy "
                  "time and the share of it on 1, 2, … units.", "",
                  "| system | prefill busy | prefill on units | decode busy | decode on units "
                  "| decode with prefill idle |",
                  "|---|---|---|---|---|---|"]
        for system, t in split:
            lines.append(f"| {system} | {t['prefill_busy_s']:.0f} s | {_shares(t['prefill_share_by_units'])} | "
                         f"{t['decode_busy_s']:.0f} s | {_shares(t['decode_share_by_units'])} | "
                         f"{100 * t['decode_prefill_idle']:.0f} % |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a cpu_comparison --out directory")
    ap.add_argument("--out", type=Path, help="also write the tables here (and the numbers as JSON beside it)")
    args = ap.parse_args(argv)
    if not (args.run_dir / "results.json").exists():
        ap.error(f"{args.run_dir} has no results.json: not a cpu_comparison output directory")
    try:
        data = breakdown(args.run_dir)
    except FileNotFoundError as exc:
        ap.error(str(exc))
    text = markdown(data)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
