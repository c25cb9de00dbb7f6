"""A simulated run as a JSON-able dict and as the lines `bullet simulate` prints. Every result says
it is simulated and carries the assumptions it was made under."""

from __future__ import annotations

from bullet.sim.config import is_calibrated, step_overhead
from bullet.sim.simulator import SimResult, Simulation

SIMULATED_NOTE = ("SIMULATED on virtual time: latencies come from the estimator (device model), not from "
                  "a GPU; contention between the workers is an assumed model unless the profile measured it; "
                  "time outside the kernels is a fixed overhead per step (or, with a measured profile, what "
                  "its timed steps held).")


def result_dict(result: SimResult, sim: Simulation, **workload) -> dict:
    est = sim.device_estimator
    cfg = result.config
    device = result.device
    return {
        "simulated": True,
        "note": SIMULATED_NOTE,
        "config": cfg.as_dict(),
        "workload": workload,
        "device": {"hardware": est.hardware.name, "units": est.hardware.units, "unit": est.hardware.unit_name,
                   "calibrated": is_calibrated(est), "kv_pages": sim.allocator.total_pages,
                   "page_size": sim.allocator.page_size, "model": est.model.name,
                   "step_overhead_s": step_overhead(cfg, est), "tp_size": cfg.tp_size,
                   "shared_units": sim.device.sharing() + _sharing_source(sim),
                   "tp_link": est.tensor_parallel.link.name if est.tensor_parallel is not None else None},
        "slo": {"ttft": cfg.ttft_slo, "tpot": cfg.tpot_slo, "tbt": cfg.tbt_slo},
        "summary": result.summary,
        "run": {"virtual_s": result.end_time, "wall_s": result.wall_s, "events": result.events,
                "stopped_early": result.stopped_early, **result.counters,
                "busy_s": device.busy_s, "corun_s": device.corun_s, "overlap_unit_s": device.overlap_unit_s},
    }


def _sharing_source(sim: Simulation) -> str:
    """Where a by-phase price of shared units came from: the profile, or the config's what-if."""
    if sim.device.overlap_share != "measured":
        return ""
    cfg = sim.config
    if cfg.shared_slowdown:
        named = " and ".join(p for p in ("prefill", "decode") if p in cfg.shared_slowdown)
        rest = ("" if len(cfg.shared_slowdown) == 2 else
                ", the other --oversubscribed-slowdown's" if cfg.oversubscribed_slowdown is not None else
                ", the other measured by the profile")
        return f" (--shared-slowdown for {named}: a what-if{rest})"
    return " (--oversubscribed-slowdown: a what-if)" if cfg.oversubscribed_slowdown is not None else \
        " (measured by the profile)"


def summary_lines(data: dict) -> list[str]:
    s, run, cfg = data["summary"], data["run"], data["config"]
    wl = data["workload"]
    lines = [
        f"=== SIMULATED result (not a measurement) — {cfg['policy']} on {device_label(data['device'])}"
        f"{'' if data['device']['calibrated'] else ' (UNCALIBRATED roofline)'}, {wl.get('workload')} "
        f"at {wl.get('rate')} req/s ===",
        f"SLO {data['slo']['ttft']} TTFT, {data['slo']['tpot']} TPOT"
        + (f", {data['slo']['tbt']} P99 TBT" if data['slo'].get('tbt') else "")
        + f": attainment {s['attainment']:.1%} (TTFT ok {s['ttft_attained']:.1%}, TPOT ok {s['tpot_attained']:.1%}"
        + (f", TBT ok {s['tbt_attained']:.1%}" if data['slo'].get('tbt') else "") + "); "
        f"{s['completed']}/{s['requests']} completed, {s['dropped']} dropped"
        + ("; STOPPED EARLY (attainment out of reach)" if run["stopped_early"] else ""),
        f"TTFT  mean {s['mean_ttft_s']:.3f}s  p50 {s['p50_ttft_s']:.3f}s  p90 {s['p90_ttft_s']:.3f}s  "
        f"p99 {s['p99_ttft_s']:.3f}s",
        f"TPOT  mean {s['mean_tpot_s'] * 1e3:.1f}ms  p50 {s['p50_tpot_s'] * 1e3:.1f}ms  "
        f"p90 {s['p90_tpot_s'] * 1e3:.1f}ms  p99 {s['p99_tpot_s'] * 1e3:.1f}ms",
        f"TBT   p50 {s['p50_tbt_s'] * 1e3:.1f}ms  p99 {s['p99_tbt_s'] * 1e3:.1f}ms (every gap between tokens); "
        f"per request P99: mean {s['mean_request_p99_tbt_s'] * 1e3:.1f}ms  p90 {s['p90_request_p99_tbt_s'] * 1e3:.1f}ms",
        f"throughput {s['output_tok_per_s']:.0f} output tok/s, {s['req_per_s']:.2f} req/s over "
        f"{s['duration_s']:.1f} virtual s; normalized latency {s['mean_norm_latency_s'] * 1e3:.1f} ms/token",
        f"device: busy {', '.join(f'{k} {v:.0f}s' for k, v in run['busy_s'].items())}; co-running "
        f"{run['corun_s']:.0f}s, overlapping units {run['overlap_unit_s'] / max(run['corun_s'], 1e-9):.1f} on average "
        f"while co-running (units both hold: {data['device']['shared_units']}); steps {run['steps']}"
        + (f"; decode pauses {run['decode_pauses']}" if "decode_pauses" in run else "")
        + (f"; preemptions {run['preemptions']}" if "preemptions" in run else "")
        + (f"; attention set-ups {run['attention_setups']} x {cfg['attention_setup_s'] * 1e3:g} ms"
           if "attention_setups" in run else ""),
        f"simulated in {run['wall_s']:.1f}s wall ({run['events']} events). {data['note']}",
    ]
    if "ledger" in run:
        lines[-1:-1] = ledger_lines(run["ledger"])
    return lines


def device_label(device: dict) -> str:
    """The device's name; of a tensor-parallel run, how many and over which link."""
    ranks = device.get("tp_size", 1)
    if ranks > 1:
        return f"{ranks}x {device['hardware']} (tensor-parallel over {device['tp_link']})"
    return device["hardware"]


def ledger_lines(ledger: dict) -> list[str]:
    units = ", ".join(f"{r} {u:.0f}" for r, u in sorted(ledger["mean_corun_units"].items()))
    work = ", ".join(f"{r} {w:.1f}" for r, w in sorted(ledger["work_s"].items()))
    return [f"ledger (whole-device seconds): busy {ledger['busy_s']:.1f}s, work {ledger['work_total_s']:.1f}s ({work}) "
            f"= busy - solo loss {ledger['solo_loss_s']:.1f} + co-run gain {ledger['corun_gain_s']:.1f}",
            f"  co-running {ledger['corun_s']:.1f}s at {ledger['corun_rate'] or 0:.3f} devices (split's worth "
            f"{ledger['split_gain_s']:+.1f}s, contention -{ledger['contention_loss_s']:.1f}s; mean units {units}); "
            f"units idle while busy {ledger['idle_unit_fraction']:.1%}"]
