"""What one device run does and how long each part may take.

A GPU machine may be held for a short time only (minutes, its start included), so the whole run
fits in 8 minutes (`total_s`). Every step has a cap (it is stopped there), the time it usually takes
(`expect_s`, what the budget is planned on) and the least it needs (`min_s`): a step starts only when
that much is left after the least every later step needs, so a slow step shortens what follows
instead of leaving the served comparison no time at all. The setup steps (env, install, build),
which everything after stands on, run with whatever is left. The served comparison takes what is left
and fits its rates and requests to it (`artifact.gpu_check.serve`).

Two plans: `gpu` (the GPU machine: dummy Llama-3.1-8B in bf16 on CUDA) and `cpu-smoke` (every step
that can run on a CPU, on dummy SmolLM2-135M: proves the orchestration here, not the GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Step:
    name: str
    cap_s: float
    expect_s: float
    min_s: float
    what: str
    setup: bool = False  # what the other steps stand on: runs first even when --steps names others
    mps: bool = False    # needs the MPS daemon (mps-start/mps-stop come with it)


@dataclass(frozen=True)
class ServePlan:
    systems: tuple[tuple[str, str], ...]  # (policy, partition backend)
    rates: tuple[float, ...]              # requests/s, light load to saturation
    prompt_tokens: tuple[int, int]        # random token-id prompts, uniform in [lo, hi]
    output_tokens: int
    window_s: float                       # arrivals of one point span this (requests = rate x window)
    drain_s: float                        # after the last arrival, the point ends at most this much later
    min_requests: int
    vocab: int
    launch_s: float                       # a server's start, planned (the first measured one replaces it)
    launch_flags: tuple[str, ...]
    ttft_slo: str
    tpot_slo: str
    min_window_s: float = 3.0


@dataclass(frozen=True)
class Plan:
    name: str
    device: str
    model_path: str
    dtype: str
    total_s: float
    steps: tuple[Step, ...]
    serve: ServePlan
    skipped: dict[str, str] = field(default_factory=dict)  # step -> why this plan does not run it
    bench_args: tuple[str, ...] = ()
    profile_args: tuple[str, ...] = ()
    report_s: float = 5.0  # kept back for writing the report

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)

    @property
    def model_args(self) -> list[str]:
        return ["--device", self.device, "--load-format", "dummy", "--model-path", self.model_path,
                "--dtype", self.dtype]


STEPS = (
    Step("env", 20, 4, 2, "GPU, driver, CUDA, torch, MPS binaries, git commit", setup=True),
    Step("install", 40, 8, 5, "carried wheels: pip install --no-index --no-deps --target <work>/site", setup=True),
    Step("build", 90, 15, 10, "the C extension: python3 setup.py build_ext --inplace", setup=True),
    Step("doctor-nomps", 70, 30, 20, "bullet doctor -v --json, MPS off"),
    Step("bench", 120, 55, 30, "engine micro-benchmark: copy and GEMM rates, prefill, decode graphs off/on vs floor, "
                                "mixed steps split or not, fused stages or torch lines"),
    Step("mps-start", 15, 2, 2, "nvidia-cuda-mps-control -d", mps=True),
    Step("doctor-mps", 70, 30, 20, "bullet doctor -v --json, MPS on", mps=True),
    Step("gpu-tests", 70, 25, 15, "pytest -m gpu on the GPU-marked test files", mps=True),
    Step("profile", 120, 65, 40, "bullet profile --quick: the bullet policy's profile, measured once", mps=True),
    Step("serve", 330, 230, 60, "served comparison: every system at every rate on the same prompts", mps=True),
    Step("mps-stop", 15, 1, 0, "echo quit | nvidia-cuda-mps-control", mps=True),
    Step("replay", 45, 12, 5, "the simulator replays the served points on this run's profile and step timelines"),
)
NAMES = tuple(s.name for s in STEPS)


def _with(steps: tuple[Step, ...], **budgets: tuple[float, float, float]) -> tuple[Step, ...]:
    """`steps` with other (cap, expect, min) budgets for the named ones (names with '_' for '-')."""
    out = []
    for s in steps:
        cap, expect, least = budgets.get(s.name.replace("-", "_"), (s.cap_s, s.expect_s, s.min_s))
        out.append(replace(s, cap_s=cap, expect_s=expect, min_s=least))
    return tuple(out)

GPU = Plan(
    name="gpu", device="cuda", model_path="llama-3.1-8b", dtype="bfloat16", total_s=480, steps=STEPS,
    serve=ServePlan(
        systems=(("bullet", "green-ctx"), ("static", "green-ctx"), ("chunked:1024", "none"), ("sglang:1024", "none")),
        rates=(1.0, 8.0, 24.0), prompt_tokens=(128, 2048), output_tokens=128, window_s=6.0, drain_s=6.0,
        min_requests=8, vocab=128000, launch_s=25.0,
        launch_flags=("--max-total-tokens", "262144", "--max-running-requests", "128", "--shutdown-timeout", "3"),
        ttft_slo="3ms/token", tpot_slo="50ms"),
    bench_args=("--device", "cuda", "--load-format", "dummy", "--model-path", "llama-3.1-8b", "--dtype", "bfloat16"),
    profile_args=("--partition-backend", "green-ctx", "--quick", "--no-progress"),
)

# SmolLM2 on the CPU: tiny sizes, every system on the cpu backend or none, no MPS, no wheels (the
# CPU environment has the packages; the carried wheels are Python 3.12's)
CPU_SMOKE = Plan(
    name="cpu-smoke", device="cpu", model_path="smollm2-135m", dtype="float32", total_s=480,
    # 2 shared cores: the doctor and the CPU profile take longer than on the GPU machine's 16
    steps=_with(STEPS, env=(30, 8, 2), build=(60, 5, 3), doctor_nomps=(60, 25, 10), bench=(90, 35, 20),
                gpu_tests=(60, 20, 10), profile=(150, 90, 40), serve=(300, 200, 60), replay=(60, 20, 5)),
    serve=ServePlan(
        systems=(("bullet", "cpu"), ("static", "cpu"), ("chunked:256", "none"), ("sglang:256", "none")),
        rates=(1.0, 2.0, 4.0), prompt_tokens=(16, 96), output_tokens=8, window_s=2.0, drain_s=10.0,
        min_requests=3, vocab=49000, launch_s=8.0,
        launch_flags=("--max-total-tokens", "8192", "--max-running-requests", "16", "--shutdown-timeout", "3"),
        ttft_slo="20ms/token", tpot_slo="300ms", min_window_s=1.0),
    skipped={"install": "cpu smoke: this Python already has the packages (the carried wheels are for 3.12)",
             "mps-start": "cpu smoke: no MPS on a CPU", "doctor-mps": "cpu smoke: no MPS on a CPU",
             "mps-stop": "cpu smoke: no MPS on a CPU"},
    bench_args=("--device", "cpu", "--load-format", "dummy", "--model-path", "smollm2-135m", "--dtype", "float32",
                "--threads", "1", "--repeats", "1"),
    profile_args=("--quick", "--no-progress"),
)


def select(plan: Plan, names: list[str] | None, setup: bool = True) -> list[Step]:
    """The steps to run, in plan order: all, or `names` plus the setup steps (unless `setup` is
    False) and the MPS start/stop around any step that needs MPS."""
    if names is None:
        return list(plan.steps)
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(NAMES)}")
    wanted = set(names)
    if setup:
        wanted |= {s.name for s in plan.steps if s.setup}
    if any(plan.step(n).mps for n in wanted):
        wanted |= {"mps-start", "mps-stop"}
    return [s for s in plan.steps if s.name in wanted]


def budget_lines(plan: Plan, steps: list[Step]) -> list[str]:
    """The plan as a table: every step, its cap and expected time, and the total against the budget."""
    lines = [f"plan {plan.name}: {plan.model_path} ({plan.dtype}) on {plan.device}, {plan.total_s:.0f} s in all",
             f"  {'step':<13} {'expect':>7} {'cap':>6} {'min':>5}  what"]
    for s in steps:
        note = f"  (skipped: {plan.skipped[s.name]})" if s.name in plan.skipped else ""
        lines.append(f"  {s.name:<13} {s.expect_s:>6.0f}s {s.cap_s:>5.0f}s {s.min_s:>4.0f}s  {s.what}{note}")
    run = [s for s in steps if s.name not in plan.skipped]
    expect = sum(s.expect_s for s in run) + plan.report_s
    lines.append(f"  expected {expect:.0f} s of {plan.total_s:.0f} s (report {plan.report_s:.0f} s); "
                 "a step starts only when the least every later step needs is still left")
    sp = plan.serve
    lines.append(f"  serve: {', '.join(f'{p} ({b})' for p, b in sp.systems)} at {', '.join(f'{r:g}' for r in sp.rates)} req/s; "
                 f"prompts {sp.prompt_tokens[0]}-{sp.prompt_tokens[1]} random token ids, {sp.output_tokens} output tokens, "
                 f"ignore_eos, arrivals over {sp.window_s:g} s per point (+ at most {sp.drain_s:g} s to finish); "
                 f"fewer requests, then fewer rates, then fewer systems when time runs short")
    return lines
