"""What the artifact evaluation runs, step by step, in each mode.

* full  — the reference configuration (about 1.75 hours on 2 cores: the served comparison, 150 prompts a
          point over two seeds, the five systems taking turns at 2 to 6 req/s — on fresh prompts 2 cores
          serve 3 to 6, by the machine — ~60 minutes; the simulations, 150 s of arrivals a run, two seeds for Fig. 15 and
          one for Figs. 22-23, ~30 minutes; the rest ~20 minutes);
* quick — every step on a reduced workload, at most 20 minutes on 2 cores;
* smoke — every step that finishes in seconds on a minimal workload, the others skipped with the
          reason (what the test suite runs).

A step is one or more commands run from the repository root with the artifact's Python; each writes
into its own directory, which is also where the report looks for its tables (`*.md`, or the tables
the command printed) and figures (`*.png`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from artifact.evaluation.hooks import ABLATION_POLICIES, PREFIX_DRIVER, ablation_unavailable, prefix_unavailable
from engines.device import cpu_has_native_bf16

MODES = ("smoke", "quick", "full")
PY = sys.executable
NEEDS_SERVER = "serves the model for real (minutes); run --quick or the full evaluation"


@dataclass
class Plan:
    commands: list[list[str]] = field(default_factory=list)
    skip: str | None = None  # why this mode does not run the step
    unavailable: str | None = None  # why the step cannot run yet in any mode
    env: dict[str, str] = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)  # Markdown files (relative to the step dir) to inline
    log_tables: bool = False  # inline the tables the commands printed (benchmarks without a .md)
    expect: list[str] = field(default_factory=list)  # files whose absence fails the step
    timeout_s: float | None = None


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    paper: str  # what of the paper it corresponds to
    plan: Callable[[str, Path], Plan]
    notes: str = ""


def _pick(mode: str, smoke, quick, full):
    return {"smoke": smoke, "quick": quick, "full": full}[mode]


def environment(mode: str, out: Path) -> Plan:
    return Plan([[PY, "-m", "artifact.evaluation.environment", "--out", str(out)]], tables=["environment.md"],
                expect=["environment.json"])


def engine(mode: str, out: Path) -> Plan:
    if mode == "smoke":
        return Plan(skip="loads the model in two engines and times them (minutes)")
    # quick: the int8 model `--dtype auto` serves a quantized GGUF as, once; full: the float modes too (bf16 only
    # where the CPU has native bf16 — emulated it is slow and nobody serves it). Both say where the time goes.
    modes = ["int8"] if mode == "quick" else ["int8", "fp32"] + (["bf16"] if cpu_has_native_bf16() else [])
    args = ["--modes", *modes, "--where"] + (["--rounds", "1"] if mode == "quick" else [])
    return Plan([[PY, "artifact/benchmarks/bench_engine.py", *args]], env={"BULLET_RESULTS_DIR": str(out)},
                log_tables=True, expect=["engine.json"])


def estimator(mode: str, out: Path) -> Plan:
    args = _pick(mode, ["--calls", "2000", "--skip-cpu-probe"], ["--calls", "20000", "--skip-cpu-probe"], [])
    return Plan([[PY, "artifact/benchmarks/bench_estimator.py", *args]], env={"BULLET_RESULTS_DIR": str(out)},
                log_tables=True, expect=["estimator.json"], timeout_s=_pick(mode, 120, None, None))


def control_plane(mode: str, out: Path) -> Plan:
    messages = _pick(mode, "100", "2000", "5000")
    state = _pick(mode, ["--iterations", "1000", "--contended-seconds", "0.1"],
                  ["--iterations", "20000", "--contended-seconds", "0.5"], [])
    return Plan([[PY, "artifact/benchmarks/bench_control_plane.py", "--messages", messages],
                 [PY, "artifact/benchmarks/bench_state_buffer.py", *state, "--out", str(out / "state_buffer.json")]],
                env={"BULLET_RESULTS_DIR": str(out)}, log_tables=True,
                expect=["control_plane.json", "state_buffer.json"], timeout_s=_pick(mode, 120, None, None))


def estimator_cpu(mode: str, out: Path) -> Plan:
    if mode == "smoke":
        return Plan(skip="profiles this CPU and times 51 held-out configurations (minutes)")
    # quick: one round, and a short wait for a quiet machine per configuration (a shared machine never is)
    args = (["--rounds", "1", "--repeats", "3", "--budget", "6", "--quiet-wait", "1"] if mode == "quick"
            else ["--full-profile"])
    return Plan([[PY, "artifact/benchmarks/bench_estimator_cpu.py", *args]], env={"BULLET_RESULTS_DIR": str(out)},
                log_tables=True, expect=["estimator_cpu.json"])


def cpu_comparison(mode: str, out: Path) -> Plan:
    if mode == "smoke":
        return Plan(skip=NEEDS_SERVER)
    # rates up to 6-7 req/s: where the 2-core machines measured so far saturate differs (~3 req/s on an Intel
    # Xeon VM, ~6 on an AMD EPYC VM, docs/results.md), and below every system's knee they all tie
    args = (["--systems", "bullet", "sglang:1024", "static", "--rates", "3", "5", "7", "--num-prompts", "60", "--interleave"]
            if mode == "quick" else ["--rates", "2", "3", "4", "5", "6", "--repeats", "2", "--interleave"])
    # then which requests missed and what the decision timelines say about the cores (reads, runs nothing)
    return Plan([[PY, "-m", "artifact.cpu_comparison", *args, "--out", str(out)],
                 [PY, "-m", "artifact.served_breakdown", str(out), "--out", str(out / "breakdown.md")]],
                tables=["results.md", "breakdown.md"], expect=["results.json", "results.md", "breakdown.md"])


SIM_SMOKE = ["--workloads", "azure-code", "--duration", "10", "--jobs", "1"]
SIM_QUICK = ["--duration", "60", "--jobs", "2"]
SIM_FULL = ["--duration", "150", "--jobs", "2"]  # 150 s of arrivals a run, as docs/policy.md's crossings


def sim_comparison(mode: str, out: Path) -> Plan:
    args = _pick(mode, [*SIM_SMOKE, "--systems", "bullet", "chunked:1024", "--rates", "azure-code:2"],
                 [*SIM_QUICK, "--systems", "bullet", "chunked:1024", "static:84", "naive",
                  "--rates", "sharegpt:5,10,15,20", "azure-code:1,2,3,4,5", "arxiv:1,2,3,4"],
                 [*SIM_FULL, "--repeats", "2"])
    parts = ["comparison"] if mode != "full" else ["comparison", "sensitivity"]
    return Plan([[PY, "-m", "artifact.sim_comparison", *args, "--parts", *parts, "--out", str(out)]],
                tables=["results.md"], expect=["results.json", "results.md", "comparison.png"])


def timeline(mode: str, out: Path) -> Plan:
    seconds = _pick(mode, "10", "60", "120")
    return Plan([[PY, "-m", "artifact.sim_comparison", "--parts", "timeline", "--timeline-duration", seconds,
                  "--out", str(out)]], expect=["timeline_bullet.png", "timeline_chunked.png"])


STATIC_SPLITS = ["static:36", "static:54", "static:72", "static:84", "static:96"]


def static_splits(mode: str, out: Path) -> Plan:
    args = _pick(mode, [*SIM_SMOKE, "--systems", "bullet", "static:54", "naive", "--rates", "azure-code:2"],
                 [*SIM_QUICK, "--workloads", "azure-code", "--systems", "bullet", *STATIC_SPLITS, "naive",
                  "--rates", "azure-code:1,3,5"],
                 [*SIM_FULL, "--systems", "bullet", *STATIC_SPLITS, "naive"])
    return Plan([[PY, "-m", "artifact.sim_comparison", *args, "--parts", "comparison", "--title",
                  "Fig. 22: static prefill splits", "--out", str(out)]],
                tables=["results.md"], expect=["results.md", "comparison.png"])


def ablation(mode: str, out: Path) -> Plan:
    reason = ablation_unavailable()
    if reason:
        return Plan(unavailable=reason)
    policies = list(ABLATION_POLICIES.values())
    args = _pick(mode, [*SIM_SMOKE, "--rates", "azure-code:2"],
                 [*SIM_QUICK, "--workloads", "azure-code", "sharegpt", "--rates", "azure-code:1,3,5", "sharegpt:5,10,15"],
                 SIM_FULL)
    return Plan([[PY, "-m", "artifact.sim_comparison", *args, "--systems", "naive", *policies, "bullet",
                  "--parts", "comparison", "--title", "Fig. 23: ablation", "--out", str(out)]],
                tables=["results.md"], expect=["results.md", "comparison.png"])


def fig17(mode: str, out: Path) -> Plan:
    args = _pick(mode, ["--workloads", "sharegpt", "--systems", "bullet", "sglang:2048", "--duration", "10",
                        "--seeds", "1", "--no-sweep", "--jobs", "1"],
                 ["--duration", "60", "--seeds", "1", "--no-sweep", "--jobs", "2"], ["--jobs", "2"])
    return Plan([[PY, "-m", "artifact.fig17", *args, "--out", str(out)]], tables=["results.md"],
                expect=["results.json", "results.md", "fig17.png"])


def prefix(mode: str, out: Path) -> Plan:
    reason = prefix_unavailable()
    if reason:
        return Plan(unavailable=reason)
    return Plan([[PY, "-m", PREFIX_DRIVER, "--mode", mode, "--out", str(out)]], tables=["results.md"],
                expect=["results.md"])


STEPS = [
    Step("environment", "Environment record", "-", environment,
         "CPU model and flags, usable cores, memory, load, torch and package versions, commit."),
    Step("engine", "Engine: prefill/decode tokens/s against transformers", "-", engine,
         "The served model (SmolLM2-135M-Instruct) in our engine and in transformers, same threads, interleaved."),
    Step("estimator", "Estimator: Table 2, calibration on A100 reference data, prediction cost",
         "Table 2; §3.2 (Eq. 1-2); Table 5 (prediction)", estimator,
         "Calibration needs the Vidur A100 profiles (../shared/data/gpu-profiles); without them that table is absent."),
    Step("control_plane", "Control plane: Table 5 on this machine, state buffer and allocator", "Table 5",
         control_plane),
    Step("estimator_cpu", "Estimator accuracy on this CPU (held-out configurations)", "§3.2 on this machine",
         estimator_cpu, "Uses the cached estimator profile of this machine, measured first if absent."),
    Step("cpu_comparison", "Served comparison on this CPU (Fig. 15-like, with 95 % intervals)", "Fig. 15 (served)",
         cpu_comparison, "Real servers (`bullet launch --policy <system>`) driven by `sglang.bench_serving` on "
         "ShareGPT; SLOs scaled from Table 4 by this CPU's solo latencies (artifact/slo_rule.py)."),
    Step("sim_comparison", "SIMULATED GPU comparison: ShareGPT, Azure-Code, arXiv-Sum (Fig. 15)", "Fig. 15",
         sim_comparison, "Simulated, not measured: the real policies on virtual time on an A100 device model."),
    Step("timeline", "SIMULATED timeline: Bullet's shares and batches against chunked prefill (Fig. 20)",
         "Fig. 20", timeline, "Azure-Code at 5 req/s; the served CPU timeline is in the cpu_comparison step."),
    Step("static_splits", "SIMULATED static prefill splits (Fig. 22)", "Fig. 22 (§4.4)", static_splits,
         "The paper fixes prefill's SMs and lets decode use all 108; `--policy static:<n>` gives decode the "
         "other 108-n instead, so only SM-108 (= naive: both on every SM) is the paper's set-up exactly."),
    Step("ablation", "SIMULATED ablation: naive, w/ Partition, w/ Scheduler, Bullet (Fig. 23)", "Fig. 23 (§4.5)",
         ablation),
    Step("prefix", "Shared-prefix and multi-turn workloads (prefix cache)", "MuxWise/DRIFT multi-turn", prefix),
    Step("fig17", "SIMULATED Llama-3.1-70B on 8xA100, tensor-parallel: normalized latency (Fig. 17)",
         "Fig. 17 (§4.2.2)", fig17, "Simulated, not measured: each A100 priced as one of 8 tensor-parallel ranks "
         "(roofline, two all-reduces per layer over the paper's stated 20 GB/s link); compared with the "
         "numbers §4.2.2 quotes."),
]
