"""The isolation probe's result as a Markdown section: one row per configuration — the verdict, what
each side kept of its spin rate, the SMs it counted alone against those it was granted, the FMA,
copy and GEMM kept fractions, and the SM clock, power and clock-limit reasons NVML saw while both
ran — then the graph-replay checks. Input: what `sm_probe.run_configs` (or the device run's step)
returned."""

from __future__ import annotations


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _pair(d: dict | None, fmt: str = ".3f") -> str:
    if not d:
        return "-"
    return " / ".join(_f(d.get(n), fmt) for n in ("A", "B"))


def _together_clocks(result: dict, kind: str) -> tuple[str, str, str]:
    phase = (result.get("nvml") or {}).get(f"{kind}/together") or {}
    if "missing" in phase or not phase.get("samples"):
        return "-", "-", phase.get("missing", "not sampled")[:60] if "missing" in phase else "-"
    sm, power = phase.get("sm_mhz") or {}, phase.get("power_w") or {}
    reasons = ", ".join(f"{name} {share:.0%}" for name, share in (phase.get("reasons") or {}).items()) or "none"
    return (f"{_f(sm.get('median'), '.0f')} ({_f(sm.get('min'), '.0f')}-{_f(sm.get('max'), '.0f')})",
            _f(power.get("median"), ".0f"), reasons)


def markdown(report: dict) -> str:
    lines = ["| configuration | verdict | spin kept A / B | units (SMs, cores) counted alone A / B (granted) "
             "| FMA kept | copy kept | GEMM kept | SM MHz together (spin) | W together (spin) "
             "| clock limits (spin together) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    graphs = []
    for c in report.get("configs", []):
        if "skipped" in c:
            lines.append(f"| {c['config']} | skipped: {c['skipped']} |" + " - |" * 8)
            continue
        v, rates = c.get("verdict", {}), c.get("rates", {})
        eff = (rates.get("spin") or {}).get("effective_units") or {}
        counted = f"{_f(eff.get('alone_A'), '.1f')} / {_f(eff.get('alone_B'), '.1f')} ({_pair(c.get('units'), 'd')})"
        kept = [_pair((rates.get(k) or {}).get("kept")) if "error" not in (rates.get(k) or {}) else "error"
                for k in ("fma", "copy", "gemm")]
        sm, watts, reasons = _together_clocks(c, "spin")
        lines.append(f"| {c['config']} | **{v.get('outcome', '?')}** | {_pair(v.get('kept'))} | {counted} | "
                     f"{' | '.join(kept)} | {sm} | {watts} | {reasons} |")
        for side, g in (c.get("graph") or {}).items():
            graphs.append(f"- {c['config']}, side {side}: **{g.get('outcome')}** — {g.get('summary', '')}")
    out = lines
    if graphs:
        out += ["", "Spin launches replayed from a CUDA graph captured on each side's stream:", "", *graphs]
    failed = [f"- {c['config']}: {c['verdict']['summary']}" for c in report.get("configs", [])
              if c.get("verdict", {}).get("outcome") in ("failed", "noisy")]
    if failed:
        out += ["", "Not judged:", "", *failed]
    if report.get("nvml_missing"):
        out += ["", f"NVML: {report['nvml_missing']}"]
    return "\n".join(out) + "\n"
