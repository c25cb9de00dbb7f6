"""Tables of a comparison run."""

from __future__ import annotations

from artifact.benchmarks.common import print_table


def _per_rate(results: dict, rates: list[float]):
    """(system, rate, summary) for every rate a system was run at (JSON keys are strings)."""
    for system, res in results.items():
        for rate in rates:
            s = res["per_rate"].get(rate) or res["per_rate"].get(str(rate))
            if s is not None:
                yield system, rate, s


def print_comparison(results: dict, rates: list[float], reference: str = "bullet") -> None:
    rows = []
    for system, rate, s in _per_rate(results, rates):
        rows.append({"system": system, "rate": rate, "attain": f"{s['attainment']:.0%}",
                     "TTFT ok": f"{s['ttft_attained']:.0%}", "TPOT ok": f"{s['tpot_attained']:.0%}",
                     "TTFT mean s": s["mean_ttft_s"], "TTFT p90 s": s["p90_ttft_s"],
                     "TPOT mean ms": s["mean_tpot_s"] * 1e3, "TPOT p90 ms": s["p90_tpot_s"] * 1e3,
                     "tok/s": s["output_tok_per_s"]})
    print_table(rows, ["system", "rate", "attain", "TTFT ok", "TPOT ok", "TTFT mean s", "TTFT p90 s", "TPOT mean ms", "TPOT p90 ms", "tok/s"],
                title="per rate")
    ref = results.get(reference, {}).get("goodput")
    summary = []
    for system, res in results.items():
        sched = res.get("scheduler", {})
        overhead = ", ".join(f"{role} {v['overhead_fraction']:.2%}" for role, v in sched.items()) or "-"
        ratio = f"{ref / res['goodput']:.2f}x" if ref and res["goodput"] else "-"
        summary.append({"system": system, "goodput req/s": res["goodput"], f"{reference} / system": ratio,
                        "scheduler overhead": overhead})
    print_table(summary, ["system", "goodput req/s", f"{reference} / system", "scheduler overhead"],
                title="goodput (highest rate with >= 90% SLO attainment)")


def comparison_markdown(results: dict, rates: list[float], slo_rule: str, reference: str = "bullet") -> str:
    """The same tables as `print_comparison`, as Markdown for results.md."""
    lines = ["# Served comparison on this machine", "", f"SLO rule: {slo_rule}", "",
             "| system | goodput req/s | " + reference + " / system | scheduler overhead (share of step time) |",
             "|---|---|---|---|"]
    ref = results.get(reference, {}).get("goodput")
    for system, res in results.items():
        sched = res.get("scheduler", {})
        overhead = ", ".join(f"{role} {v['overhead_fraction']:.2%} ({v['mean_sched_us']:.0f} us of "
                             f"{v['mean_step_ms']:.1f} ms)" for role, v in sched.items()) or "-"
        ratio = f"{ref / res['goodput']:.2f}x" if ref and res["goodput"] else "-"
        lines.append(f"| {system} | {res['goodput']:g} | {ratio} | {overhead} |")
    lines += ["", "| system | rate | attain | TTFT ok | TPOT ok | TTFT mean s | TTFT p90 s | TPOT mean ms | "
              "TPOT p90 ms | tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for system, rate, s in _per_rate(results, rates):
        lines.append(f"| {system} | {rate:g} | {s['attainment']:.0%} | {s['ttft_attained']:.0%} | "
                     f"{s['tpot_attained']:.0%} | {s['mean_ttft_s']:.2f} | {s['p90_ttft_s']:.2f} | "
                     f"{s['mean_tpot_s'] * 1e3:.0f} | {s['p90_tpot_s'] * 1e3:.0f} | {s['output_tok_per_s']:.0f} |")
    return "\n".join(lines) + "\n"
