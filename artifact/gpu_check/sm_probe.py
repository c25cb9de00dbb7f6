"""The isolation probe: do two shares of a device really hold disjoint SMs? Counted with SMs, not FLOPs.

Two sides (`sm_probe_run` runs one configuration) — A (prefill's share, from the low end) and B (decode's, from the high end: the rest of the
device, so the two shares add up to every unit) — each run a probe workload alone, then both at
once; each side's rate together over its rate alone says what it kept. The spin probe
(`sm_probe_loops.SpinLoop`: blocks that hold one SM each for a fixed wall time) decides the verdict
(`sm_probe_verdict.judge_spin`: disjoint when both keep >= 0.97); the FMA loop (SM clock), the
streaming copy (HBM) and the doctor's GEMM are measured beside it, and NVML samples clocks, power
and clock-limit reasons during every phase (`nvml_sampler`).

Configurations (`GPU_CONFIGS`), each skipped with its reason where it cannot run:
* `green-ctx-1proc`: two green contexts in ONE process — the reference for true disjointness;
* `green-ctx-2proc`, `green-ctx-2proc-mps`: a green-context share in each of two processes, MPS off
  (the device time-slices two processes' contexts) and on;
* `mps-percentage`: two processes under MPS, each capped at half the SMs (caps do not reserve);
* `libsmctrl-mps`: two processes under MPS, each masking its own stream with libsmctrl (needs a
  built library: `artifact.gpu_check.libsmctrl`), with the driver opt-in past CUDA 12.8;
* `none-1proc`: no partition at all, both sides on every SM — the control: the probe must call it
  shared (each side keeps about half), or it cannot tell anything.
Configurations marked `graph` also replay the spin probe from a CUDA graph captured on each side's
stream and count its SMs (`judge_graph`): does the restriction hold for graph replays?

On a CPU the same orchestration runs with cores as units (`CPU_CONFIGS`; spin threads pinned to
the share's cores), which is how the tests check it.

    python -m artifact.gpu_check.sm_probe --device cpu
    python -m artifact.gpu_check.sm_probe --device cuda --manage-mps --libsmctrl /path/to/libsmctrl.so \\
        --output sm-probe.json"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from artifact.gpu_check import machine, procs
from artifact.gpu_check.nvml_sampler import NvmlSampler
from artifact.gpu_check.sm_probe_report import markdown
from artifact.gpu_check.sm_probe_run import KINDS, PHASE_S, ROUNDS, Config, measure
from bullet.partition.libsmctrl import ALLOW_UNTESTED_ENV, LIBRARY_ENV

CPU_KINDS = ("spin", "copy")
__all__ = ["CPU_CONFIGS", "Config", "GPU_CONFIGS", "KINDS", "expected_seconds", "measure", "probe_step",
           "run_configs"]

GPU_CONFIGS = (
    Config("green-ctx-1proc", "green-ctx", one_process=True, mps=False, graph=True,
           about="two green contexts in one process: the reference for disjoint SMs"),
    Config("green-ctx-2proc", "green-ctx", mps=False, graph=True,
           about="a green context in each of two processes, MPS off"),
    Config("green-ctx-2proc-mps", "green-ctx", mps=True, about="a green context in each of two processes, MPS on"),
    Config("mps-percentage", "mps-percentage", mps=True, about="two MPS clients capped at half the SMs each"),
    Config("libsmctrl-mps", "libsmctrl", mps=True, graph=True,
           about="two MPS clients, each masking its own stream with libsmctrl"),
    Config("none-1proc", "none", one_process=True, mps=False,
           about="no partition: both sides on every SM, the probe's control (must come out shared)"),
)
CPU_CONFIGS = (
    Config("cpu-2proc", "cpu", about="a core share in each of two processes"),
    Config("cpu-1proc", "cpu", one_process=True, about="two core shares in one process"),
)


def estimate_s(config: Config, kinds: tuple[str, ...], phase_s: float, rounds: int,
               start_s: float = 15.0) -> float:
    """What a configuration takes: process start-up, 3 phases a round a kind, the graph replays."""
    per_phase = phase_s + 0.3
    return start_s + len(kinds) * rounds * 3 * per_phase + (2 * (per_phase + 1.0) if config.graph else 0.0)


def expected_seconds(configs: tuple[Config, ...] = GPU_CONFIGS, kinds: tuple[str, ...] = KINDS,
                     phase_s: float = PHASE_S, rounds: int = ROUNDS, mps_switch_s: float = 3.0) -> float:
    """What `probe_step` expects to take with every configuration (for a plan's budget): each
    configuration's estimate and two MPS switches (off -> on, and back)."""
    return sum(estimate_s(c, kinds, phase_s, rounds) for c in configs) + 2 * mps_switch_s



def skip_reason(config: Config, library: str | None, mps_available: bool, mps_running: bool,
                manage_mps: bool) -> str | None:
    """Why `config` cannot run here (None: it can)."""
    if config.backend == "libsmctrl" and not library:
        return f"no libsmctrl library (build it: python -m artifact.gpu_check.libsmctrl, or set {LIBRARY_ENV})"
    if config.backend == "libsmctrl" and not os.path.isfile(library):
        return f"libsmctrl library {library} does not exist"
    if config.mps is True and not mps_available:
        return f"needs MPS, and {machine.MPS_CONTROL} is not installed"
    if config.mps is not None and config.mps != mps_running and not manage_mps:
        return f"needs MPS {'on' if config.mps else 'off'}, and it is {'on' if mps_running else 'off'} " \
               "(--manage-mps starts and stops it)"
    return None


def _set_mps(want: bool) -> tuple[bool, str]:
    ok, how = machine.mps_start() if want else machine.mps_stop()
    return ok and machine.mps_running() == want, how


def run_configs(configs: tuple[Config, ...], device: str, total: int, *, kinds: tuple[str, ...], phase_s: float,
                rounds: int, library: str | None = None, manage_mps: bool = False, deadline: float | None = None,
                env: dict | None = None, sampler: NvmlSampler | None = None, log=print) -> dict:
    """Every configuration that can run (MPS-off ones first, then MPS-on ones), the rest skipped with
    their reason; MPS is left as it was found."""
    mps_before = machine.mps_running() if device == "cuda" else False
    mps_available = device == "cuda" and shutil.which(machine.MPS_CONTROL) is not None
    extra = ["--library", library, "--allow-untested-driver"] if library else []
    results = []
    try:
        for config in sorted(configs, key=lambda c: bool(c.mps)):
            mps_now = machine.mps_running() if device == "cuda" else False
            why = skip_reason(config, library, mps_available, mps_now, manage_mps)
            need = estimate_s(config, kinds, phase_s, rounds)
            if why is None and deadline is not None and time.monotonic() + need > deadline:
                why = f"no time left (needs ~{need:.0f} s)"
            if why is None and config.mps is not None and config.mps != mps_now:
                ok, how = _set_mps(config.mps)
                if not ok:
                    why = f"could not turn MPS {'on' if config.mps else 'off'}: {how}"
            if why is not None:
                results.append({"config": config.name, "about": config.about, "skipped": why})
                log(f"sm probe: {config.name}: skipped ({why})")
                continue
            log(f"sm probe: {config.name} ...")
            res = measure(config, device, total, kinds, phase_s, rounds, sampler,
                          extra if config.backend == "libsmctrl" else [], env)
            results.append(res)
            log(f"sm probe: {config.name}: {res['verdict']['summary']}")
    finally:
        if device == "cuda" and machine.mps_running() != mps_before:
            _set_mps(mps_before)
    return {"device": device, "total_units": total, "kinds": list(kinds), "phase_s": phase_s, "rounds": rounds,
            "nvml_missing": sampler.missing if sampler is not None else "not sampled", "configs": results}


def summary_line(report: dict) -> str:
    parts = []
    for c in report["configs"]:
        if "skipped" in c:
            parts.append(f"{c['config']}: skipped")
            continue
        v = c["verdict"]
        kept = v.get("kept") or {}
        parts.append(f"{c['config']}: {v['outcome']}" + (f" ({'/'.join(f'{x:.3f}' for x in kept.values())})"
                                                         if kept else ""))
    return "; ".join(parts)


def device_sms(env: dict | None = None) -> int | None:
    """The device's SM count, asked in a child (this process never initialises CUDA: a context made
    here before MPS starts would sit outside it)."""
    code = "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        return int(done.stdout.strip()) if done.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def probe_step(ctx, timeout: float) -> dict:
    """The device run's step (`ctx`: a `steps.Context`): every GPU configuration within `timeout`,
    written to logs/sm-probe.json."""
    # deferred: steps imports the plan, and a plan that names this step imports this module
    from artifact.gpu_check import steps

    deadline = time.monotonic() + timeout - 10.0
    total = (ctx.info.get("torch") or {}).get("sms") or device_sms(ctx.env)
    if not total:
        return steps.result("error", "no CUDA device's SM count (torch sees no GPU)")
    library = ctx.env.get(LIBRARY_ENV)
    sampler = NvmlSampler()
    try:
        report = run_configs(GPU_CONFIGS, "cuda", int(total), kinds=KINDS, phase_s=PHASE_S, rounds=ROUNDS,
                             library=library,
                             manage_mps=True, deadline=deadline, env=ctx.env, sampler=sampler,
                             log=procs.progress)
    finally:
        sampler.close()
    ctx.mps_on = machine.mps_running()
    path = ctx.logs / "sm-probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    (ctx.logs / "sm-probe.md").write_text(markdown(report))
    report["libsmctrl_opt_in"] = _opt_in_libsmctrl(report, ctx.env)
    measured = [c for c in report["configs"] if "verdict" in c]
    status = "pass" if measured and any(c["verdict"]["outcome"] != "failed" for c in measured) else "error"
    return steps.result(status, summary_line(report)[:600], log=path.name, markdown=markdown(report), **report)


def _opt_in_libsmctrl(report: dict, env: dict) -> str:
    """libsmctrl on a driver past its known range is opted into (`ALLOW_UNTESTED_ENV` in the
    environment of the steps after this one: the doctor's mask checks, the served runs) only where
    this probe found its masks disjoint across two processes on this machine."""
    result = next((c for c in report["configs"] if c["config"] == "libsmctrl-mps"), None)
    if result is None or "verdict" not in result:
        return "not set: libsmctrl-mps did not run" + (f" ({result['skipped']})" if result else "")
    outcome = result["verdict"]["outcome"]
    if outcome != "disjoint":
        return f"not set: libsmctrl-mps came out {outcome}"
    env[ALLOW_UNTESTED_ENV] = "1"
    return f"set ({ALLOW_UNTESTED_ENV}=1): libsmctrl-mps came out disjoint on this machine"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--configs", help="comma-separated configuration names (default: all of the device's)")
    parser.add_argument("--kinds", help=f"probe kinds (default: {','.join(KINDS)} on a GPU, "
                                        f"{','.join(CPU_KINDS)} on a CPU)")
    parser.add_argument("--phase-s", type=float, default=PHASE_S, help="seconds of one timed phase")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="rounds of (A alone, B alone, both) per probe kind")
    parser.add_argument("--units", type=int, default=0, help="units to divide (default: the device's SMs, or "
                                                             "the cores this process may use)")
    parser.add_argument("--libsmctrl", default=os.environ.get(LIBRARY_ENV),
                        help=f"libsmctrl.so (default: ${LIBRARY_ENV})")
    parser.add_argument("--manage-mps", action="store_true", help="start/stop the MPS daemon as configurations need")
    parser.add_argument("--output", type=Path, help="write the result as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the result as a Markdown table here")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    available = GPU_CONFIGS if gpu else CPU_CONFIGS
    wanted = args.configs.split(",") if args.configs else [c.name for c in available]
    unknown = set(wanted) - {c.name for c in available}
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {[c.name for c in available]}")
    total = args.units or (device_sms() if gpu else len(os.sched_getaffinity(0)))
    if not total or total < 2:
        parser.error(f"need at least 2 units to divide, have {total}")
    kinds = tuple(args.kinds.split(",")) if args.kinds else (KINDS if gpu else CPU_KINDS)
    sampler = NvmlSampler() if gpu else None
    report = run_configs(tuple(c for c in available if c.name in wanted), args.device, total, kinds=kinds,
                         phase_s=args.phase_s, rounds=args.rounds, library=args.libsmctrl,
                         manage_mps=args.manage_mps, sampler=sampler, log=lambda m: print(m, file=sys.stderr))
    if sampler is not None:
        sampler.close()
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text)
    if args.markdown:
        args.markdown.write_text(markdown(report))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
