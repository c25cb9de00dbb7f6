"""Markdown of the simulated comparison: goodput with its 95 % interval and the verdict against
Bullet per workload, per-rate tables, Bullet against chunked:1024 over the rates both completed, and
the sensitivity table."""

from __future__ import annotations

from artifact.report import attainment_cell, goodput_cell, ms_cell, versus
from bullet.commands.simulate import TABLE4_SLOS

TITLES = {"sharegpt": "ShareGPT", "azure-code": "Azure-Code", "arxiv": "arXiv-Sum"}
PAPER = ("Bullet paper, one A100 (Fig. 15): 1.09x average / up to 1.20x throughput vs SGLang-1024, "
         "13.5x lower TTFT with 0.94x TPOT; chunked systems show seconds of TTFT even at low rates.")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def goodput_table(results: dict, systems: list[str]) -> list[str]:
    lines = ["## Goodput (highest rate with >= 90 % SLO attainment, req/s) [95 % CI], bullet / system, verdict", "",
             "Verdict: \"tie\" where the system's goodput interval overlaps bullet's.", "",
             "| system | " + " | ".join(TITLES[w] for w in results) + " | mean bullet/system |",
             "|---|" + "---|" * (len(results) + 1)]
    for system in systems:
        cells, ratios = [], []
        for by_system in results.values():
            res = by_system[system]
            g = res["goodput"]
            ref = by_system["bullet"]["goodput"] if "bullet" in by_system else None
            if system == "bullet" or ref is None:
                cells.append(goodput_cell(res))
                continue
            cells.append(f"{goodput_cell(res)} ({ratio(ref, g)}, {versus(res, None, 'bullet')})")
            if g:
                ratios.append(ref / g)
        mean = f"{sum(ratios) / len(ratios):.2f}x" if ratios else "-"
        lines.append(f"| {system} | " + " | ".join(cells) + f" | {mean} |")
    return lines


def per_rate_tables(results: dict) -> list[str]:
    lines = []
    for wl, by_system in results.items():
        ttft, tpot = TABLE4_SLOS[wl]
        lines += ["", f"## {TITLES[wl]} (SLO: TTFT {ttft}, TPOT {tpot})", "",
                  "| system | rate | attain [95% CI] | vs bullet | TTFT ok | TPOT ok | TTFT mean s | TTFT p90 s | "
                  "TPOT mean ms | TPOT p90 ms | P99 TBT ms | tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for system, res in by_system.items():
            for rate, s in res["per_rate"].items():
                stop = " (stopped)" if s["run"]["stopped_early"] else ""
                vs = versus(res, rate, "bullet") if system != "bullet" else "-"
                lines.append(f"| {system} | {rate} | {attainment_cell(s)}{stop} | {vs} | {s['ttft_attained']:.1%} | "
                             f"{s['tpot_attained']:.1%} | {s['mean_ttft_s']:.3f} | {s['p90_ttft_s']:.3f} | "
                             f"{s['mean_tpot_s'] * 1e3:.0f} | {s['p90_tpot_s'] * 1e3:.0f} | "
                             f"{ms_cell(s.get('p99_tbt_s'))} | {s['output_tok_per_s']:.0f} |")
    return lines


def against_chunked(results: dict) -> list[str]:
    lines = []
    for wl, by_system in results.items():
        if "bullet" not in by_system or "chunked:1024" not in by_system:
            continue
        b, c = by_system["bullet"]["per_rate"], by_system["chunked:1024"]["per_rate"]
        common = [r for r in b if r in c and not b[r]["run"]["stopped_early"] and not c[r]["run"]["stopped_early"]]
        if common:
            tput = sum(b[r]["output_tok_per_s"] / c[r]["output_tok_per_s"] for r in common) / len(common)
            ttft = sum(c[r]["mean_ttft_s"] / b[r]["mean_ttft_s"] for r in common) / len(common)
            tpot = sum(c[r]["mean_tpot_s"] / b[r]["mean_tpot_s"] for r in common) / len(common)
            lines.append(f"* {TITLES[wl]} (rates {', '.join(common)}): mean over rates of bullet/chunked throughput "
                         f"{tput:.2f}, chunked/bullet mean TTFT {ttft:.2f}, chunked/bullet mean TPOT {tpot:.2f} "
                         "(above 1: Bullet better)")
    return ["", "## Bullet against chunked:1024 over the rates both completed", "", *lines] if lines else []


def markdown(results: dict, args) -> str:
    title = args.title or "Simulated comparison"
    seeds = f", {args.repeats} seeds pooled" if args.repeats > 1 else ""
    paper = "" if args.title else " " + PAPER  # the paper's Fig. 15 numbers belong next to Fig. 15 only
    lines = [f"# {title} (Llama-3.1-8B, virtual A100, {args.duration:g} s of Poisson arrivals per point{seeds})",
             "", "SIMULATED: estimator latencies, assumed contention, no framework overhead." + paper, ""]
    lines += goodput_table(results, args.systems)
    lines += per_rate_tables(results)
    lines += against_chunked(results)
    return "\n".join(lines) + "\n"


def sensitivity_markdown(rows: list[dict]) -> str:
    lines = ["## Sensitivity to the device model's assumptions", "",
             "| workload @ rate | system | variant | attain | TTFT mean s | TPOT mean ms | tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {TITLES[r['workload']]} @ {r['rate']} | {r['system']} | {r['variant']} | {r['attainment']:.1%} | "
                     f"{r['mean_ttft_s']:.3f} | {r['mean_tpot_s'] * 1e3:.0f} | {r['output_tok_per_s']:.0f} |")
    return "\n".join(lines) + "\n"
