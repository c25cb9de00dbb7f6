"""The `replay` step: the simulator replays the served comparison this run just made (issue 25's
validation, on every GPU report): each system's points — their prompts, output lengths and arrival
times, from the load generator's per-request files — for the same policy on the device model of the
profile measured in the same run, each worker's steps at the speed its own timeline recorded
(`artifact.sim_validation --served-steps-by-system`). CPU only, seconds; after MPS is stopped.

The cell-by-cell table lands in `logs/validation.md` (and `.json`); the report quotes it."""

from __future__ import annotations

import json
from pathlib import Path

from artifact.gpu_check import procs
from artifact.gpu_check.steps import Context, finished, result
from artifact.served_kernels import served_kernels


def replay_command(ctx: Context, out: Path) -> list[str] | str:
    """The sim_validation command for what the run served, or why there is none."""
    # deferred: both import the control plane, on the path only once the install step ran
    from artifact.server import system_slug
    from bullet.types.slo import SLO  # deferred: as above

    sp = ctx.plan.serve
    benches = [(policy, ctx.logs / f"bench-{system_slug(policy)}.jsonl") for policy, _ in sp.systems]
    benches = [(policy, path) for policy, path in benches if path.is_file() and path.stat().st_size]
    if not benches:
        return "no served points to replay (the served comparison wrote no per-request files)"
    if ctx.profile is None or not Path(ctx.profile).is_file():
        return "no profile of this GPU to replay on (the profile step did not write one)"
    flags = dict(zip(sp.launch_flags[::2], sp.launch_flags[1::2]))
    slo = SLO.parse(sp.ttft_slo, sp.tpot_slo)
    # the load generator's attainment rule: per-token TTFT, TTFT floor, TPOT
    rule = (slo.ttft, 0.0) if slo.ttft_per_token else (0.0, slo.ttft)
    cmd = procs.python("-m", "artifact.sim_validation", "--bench-serving",
                       *(f"{path},{policy}" for policy, path in benches),
                       "--profile", str(ctx.profile),
                       "--max-total-tokens", flags.get("--max-total-tokens", "262144"),
                       "--max-running-requests", flags.get("--max-running-requests", "128"),
                       "--ttft-slo", sp.ttft_slo, "--tpot-slo", sp.tpot_slo,
                       "--slo-rule", f"{rule[0]:g},{rule[1]:g},{slo.tpot:g}",
                       "--title", f"Simulator vs this run ({ctx.plan.name} plan)", "--out", str(out))
    timelines = ctx.logs / "timeline"
    if timelines.is_dir():
        cmd += ["--served-steps-by-system", str(timelines)]
    return cmd


def replay_step(ctx: Context, timeout: float) -> dict:
    # what each kind of served step cost, from the timelines alone (`artifact.step_costs`, no device
    # model): reported whether or not the replay itself can run
    from artifact.step_costs import step_costs  # deferred: numpy, on the machine's path but not the CLI's concern

    timelines = ctx.logs / "timeline"
    # and, from the same timelines, each worker's Triton compiles while serving and kernel fallbacks
    costs = {"step_costs": step_costs(timelines), "kernels": served_kernels(timelines)} if timelines.is_dir() else {}
    if timelines.is_dir() and ctx.profile is not None and Path(ctx.profile).is_file():
        costs["corun"] = corun_by_system(Path(ctx.profile), timelines)
    out = ctx.logs / "validation"
    cmd = replay_command(ctx, out)
    if isinstance(cmd, str):
        return result("skipped", cmd, **costs)
    done = procs.run(cmd, ctx.logs / "replay.txt", timeout, ctx.env, cwd=ctx.root)
    table = out.with_suffix(".md")
    if done.returncode != 0 or not table.is_file():
        return finished(done, "", **costs)
    return finished(done, summary(out.with_suffix(".json")), markdown=table.read_text(), **costs)


def corun_by_system(profile: Path, timelines: Path) -> dict:
    """Each two-worker system's co-run scale (`artifact.served_corun`): what its co-running steps cost
    against the profile's co-run table — the `--corun-scale` the partition ledger's verdict depends on."""
    from artifact.served_corun import corun_scale  # deferred: the estimator, on the path once installed
    from estimator.profile import load_estimator

    est = load_estimator(str(profile))
    two_workers = [d for d in sorted(timelines.iterdir()) if (d / "prefill.jsonl").exists() or (d / "prefill.jsonl.gz").exists()]
    return {d.name: corun_scale(est, [d]) for d in two_workers}


def summary(json_path: Path) -> str:
    """'N of M P50/P90 cells within the goal; median |error| P50 x%; median |error| P90 y%', and the
    set-up per new prompt length each system's steps fitted (a per-shape attention plan: what keeping
    prompt attention off cuDNN should remove)."""
    from artifact.sim_validation import median_errors, within_goal  # deferred: imports the simulator

    data = json.loads(json_path.read_text())
    rows = data["runs"]
    within, cells = within_goal(rows)
    medians = median_errors(rows)
    fits = ((data.get("served_steps") or {}).get("by_system") or {}).items()
    # the set-up each system was replayed with, as sim_validation recorded it
    setups = [f"{system} {fit.get('attention_setup_s', 0.0) * 1e3:.0f} ms"
              for system, fit in fits if fit.get("new_lengths")]
    return "; ".join([f"{within} of {cells} P50/P90 cells within the goal" if cells else "no latency cell compared",
                      *(f"median |error| {label} {medians[label]:.0%}" for label in ("P50", "P90")
                        if label in medians and medians[label] == medians[label]),  # NaN: no cell had both
                      *([f"set-up per new prompt length: {', '.join(setups)}"] if setups else [])])

