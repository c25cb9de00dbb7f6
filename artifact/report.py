"""Tables of a comparison run: goodput and attainment with their 95 % bootstrap intervals, and the
verdict against the reference system ("tie" where the intervals overlap; artifact/stats.py)."""

from __future__ import annotations

from artifact.benchmarks.common import print_table
from artifact.stats import Interval


def _per_rate(results: dict, rates: list[float]):
    """(system, rate, summary) for every rate a system was run at (JSON keys are strings)."""
    for system, res in results.items():
        for rate in rates:
            s = res["per_rate"].get(rate) or res["per_rate"].get(str(rate)) or res["per_rate"].get(f"{rate:g}")
            if s is not None:
                yield system, rate, s


def attainment_cell(s: dict) -> str:
    ci = s.get("attainment_ci")
    return Interval.from_dict(ci).percent() if ci else f"{s['attainment']:.0%}"


def _rates_run(res: dict) -> list[float]:
    return [float(r) for r in res.get("per_rate", {})]  # JSON keys are strings


def goodput_cell(res: dict) -> str:
    """The goodput with its interval, said as a bound where the rates run do not bracket it: "< 5" when
    no rate reached the target (not a goodput of 0), "≥ 6" when the highest rate run still did."""
    ci = res.get("goodput_ci")
    cell = Interval.from_dict(ci).plain() if ci else f"{res['goodput']:g}"
    rates = _rates_run(res)
    if not rates:
        return cell
    if not res["goodput"]:
        return f"< {min(rates):g}"
    if res["goodput"] >= max(rates):
        return f"≥ {cell}"
    return cell


def versus(res: dict, rate: float | None, reference: str) -> str:
    """The verdict against the reference for goodput (rate None) or one rate's attainment."""
    vs = res.get(f"vs_{reference}")
    if not vs:
        return "-"
    if rate is None:
        return vs["goodput"]
    per = vs["attainment"]
    return per.get(rate) or per.get(str(rate)) or per.get(f"{rate:g}") or "-"


def _overhead(res: dict, detail: bool) -> str:
    sched = res.get("scheduler", {})
    if detail:
        return ", ".join(f"{role} {v['overhead_fraction']:.2%} ({v['mean_sched_us']:.0f} us of "
                         f"{v['mean_step_ms']:.1f} ms)" for role, v in sched.items()) or "-"
    return ", ".join(f"{role} {v['overhead_fraction']:.2%}" for role, v in sched.items()) or "-"


def ms_cell(seconds: float | None) -> str:
    """Milliseconds, or "-" where a run did not record it (results from before TBT was kept)."""
    return "-" if seconds is None or seconds != seconds else f"{seconds * 1e3:.0f}"


def _ratio(ref: float | None, res: dict) -> str:
    """The reference's goodput over the system's; a bound where the system reached no rate run."""
    g, rates = res["goodput"], _rates_run(res)
    if ref and g:
        return f"{ref / g:.2f}x"
    if ref and rates:
        return f"> {ref / min(rates):.2f}x"
    return "-"


def print_comparison(results: dict, rates: list[float], reference: str = "bullet") -> None:
    rows = []
    for system, rate, s in _per_rate(results, rates):
        rows.append({"system": system, "rate": rate, "attain [95% CI]": attainment_cell(s),
                     f"vs {reference}": versus(results[system], rate, reference),
                     "TTFT ok": f"{s['ttft_attained']:.0%}", "TPOT ok": f"{s['tpot_attained']:.0%}",
                     "TTFT mean s": s["mean_ttft_s"], "TTFT p90 s": s["p90_ttft_s"],
                     "TPOT mean ms": s["mean_tpot_s"] * 1e3, "TPOT p90 ms": s["p90_tpot_s"] * 1e3,
                     "P99 TBT ms": ms_cell(s.get("p99_tbt_s")), "tok/s": s["output_tok_per_s"]})
    print_table(rows, ["system", "rate", "attain [95% CI]", f"vs {reference}", "TTFT ok", "TPOT ok", "TTFT mean s",
                       "TTFT p90 s", "TPOT mean ms", "TPOT p90 ms", "P99 TBT ms", "tok/s"], title="per rate")
    ref = results.get(reference, {}).get("goodput")
    summary = [{"system": system, "goodput req/s [95% CI]": goodput_cell(res),
                f"{reference} / system": _ratio(ref, res), f"vs {reference}": versus(res, None, reference),
                "scheduler overhead": _overhead(res, detail=False)} for system, res in results.items()]
    print_table(summary, ["system", "goodput req/s [95% CI]", f"{reference} / system", f"vs {reference}",
                          "scheduler overhead"], title="goodput (highest rate with >= 90% SLO attainment)")


def comparison_markdown(results: dict, rates: list[float], slo_rule: str, reference: str = "bullet") -> str:
    """The same tables as `print_comparison`, as Markdown for results.md."""
    lines = ["# Served comparison on this machine", "", f"SLO rule: {slo_rule}", "",
             "Attainment and goodput with 95 % bootstrap intervals (over requests, and over runs when "
             f"repeated); \"tie\": the intervals of the system and {reference} overlap. Goodput \"< r\": no rate "
             "run reached the target, the lowest being r; \"≥ r\": the highest rate run still did.", "",
             f"| system | goodput req/s [95% CI] | {reference} / system | vs {reference} | "
             "scheduler overhead (share of step time) |", "|---|---|---|---|---|"]
    ref = results.get(reference, {}).get("goodput")
    for system, res in results.items():
        lines.append(f"| {system} | {goodput_cell(res)} | {_ratio(ref, res)} | "
                     f"{versus(res, None, reference)} | {_overhead(res, detail=True)} |")
    lines += ["", f"| system | rate | attain [95% CI] | vs {reference} | TTFT ok | TPOT ok | TTFT mean s | "
              "TTFT p90 s | TPOT mean ms | TPOT p90 ms | P99 TBT ms | tok/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, rate, s in _per_rate(results, rates):
        lines.append(f"| {system} | {rate:g} | {attainment_cell(s)} | {versus(results[system], rate, reference)} | "
                     f"{s['ttft_attained']:.0%} | {s['tpot_attained']:.0%} | {s['mean_ttft_s']:.2f} | "
                     f"{s['p90_ttft_s']:.2f} | {s['mean_tpot_s'] * 1e3:.0f} | {s['p90_tpot_s'] * 1e3:.0f} | "
                     f"{ms_cell(s.get('p99_tbt_s'))} | {s['output_tok_per_s']:.0f} |")
    return "\n".join(lines + speed_drift_lines(results)) + "\n"


DRIFT_WARNING = 1.15


def speed_drift_lines(results: dict) -> list[str]:
    """The machine's speed before and after each system (a fixed GEMM's seconds), and a warning when it
    drifted more than DRIFT_WARNING x between probes: the systems ran one after another."""
    probes = {system: res["cpu_probe_s"] for system, res in results.items() if res.get("cpu_probe_s")}
    if not probes:
        return []
    values = [v for p in probes.values() for v in (p["before"], p["after"])]
    spread = max(values) / min(values)
    if len({(p["before"], p["after"]) for p in probes.values()}) == 1:  # --interleave: one probe for the run
        p = next(iter(probes.values()))
        return ["", f"Machine speed (a fixed GEMM + memory-copy workload before / after the run; the systems took "
                    f"turns at each rate, so a drift slows them alike): {p['before'] * 1e3:.0f} / "
                    f"{p['after'] * 1e3:.0f} ms, {spread:.2f}x."]
    cells = ", ".join(f"{system} {p['before'] * 1e3:.0f} / {p['after'] * 1e3:.0f} ms" for system, p in probes.items())
    lines = ["", "Machine speed (a fixed GEMM + memory-copy workload before / after each system; lower is "
             f"faster): {cells}; slowest / fastest = {spread:.2f}x."]
    if spread > DRIFT_WARNING:
        lines.append(f"**Warning: the machine's speed changed by {spread:.2f}x during this run; systems measured "
                     "in a slow spell are handicapped. Compare them only with care, or run again.**")
    return lines
