"""What one device run does and how long each part may take.

A GPU machine may be held for a short time only (minutes, its start included), so one run fits in
8 minutes (`total_s`), and what the device should be asked does not fit in one run: it is split
into plans, each with >= 60 s to spare on its expected step times (`SPARE_S`, checked by a test):

* `serve` — the served comparison at steady state (`artifact.gpu_check.serve`): every system at the
  same rates around the knee, on the same arrivals; the bullet policy's profile first (unless one
  is given), the simulator's replay of the points after;
* `mechanism` — does the partition hold: libsmctrl built from carried source, `bullet doctor` with
  MPS off and on, the SM-counting isolation probe, the GPU-marked tests;
* `engine` — the engine micro-benchmark, the other models and formats (Qwen3 dense and MoE, FP8:
  `artifact.benchmarks.bench_models_gpu`) and the bullet policy's profile.

`--plan stalest` runs the plan whose last recorded run is oldest (`artifact.gpu_check.record`).
`cpu-smoke` runs every step of every plan that can run on a CPU, on dummy SmolLM2-135M, as one
plan: it proves the orchestration (a CPU has no lease to fit, so one run covers all of it, and a
step shared by plans is proven once), not the GPU.

Every step has a cap (it is stopped there), the time it usually takes (`expect_s`, what the budget
is planned on) and the least it needs (`min_s`): a step starts only when that much is left after
the least every later step needs, so a slow step shortens what follows instead of leaving the last
steps no time at all. The setup steps (env, install, build), which everything after stands on, run
with whatever is left."""

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
    systems: tuple[tuple[str, str], ...]  # (policy, partition backend), in the order they are kept
    rates: tuple[float, ...]              # requests/s around the knee, ascending
    prompt_tokens: tuple[int, int]        # random token-id prompts, uniform in [lo, hi]
    output_tokens: int
    window_s: float                       # arrivals of one point span this
    warmup_s: float                       # the first arrivals of a point: served, left out of its metrics
    drain_s: float                        # planned time after the last arrival until the point ends
    vocab: int
    launch_s: float                       # a server's start, planned (the first measured one replaces it)
    launch_flags: tuple[str, ...]
    ttft_slo: str
    tpot_slo: str
    min_rates: int = 3                    # rates are dropped (highest first) down to this many
    min_systems: int = 2                  # then systems (last first) down to this many
    least_start_s: float = 60.0           # a start may take 3x its plan, and at least this long


@dataclass(frozen=True)
class Plan:
    name: str
    device: str
    model_path: str
    dtype: str
    total_s: float
    steps: tuple[Step, ...]
    serve: ServePlan
    what: str = ""
    skipped: dict[str, str] = field(default_factory=dict)  # step -> why this plan does not run it
    bench_args: tuple[str, ...] = ()
    models_args: tuple[str, ...] = ()  # artifact.benchmarks.bench_models_gpu's
    profile_args: tuple[str, ...] = ()
    report_s: float = 5.0  # kept back for writing the report

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.steps)

    @property
    def expected_s(self) -> float:
        """The plan's steps at their expected times, and the report: what its budget is planned on."""
        return sum(s.expect_s for s in self.steps if s.name not in self.skipped) + self.report_s

    @property
    def model_args(self) -> list[str]:
        return ["--device", self.device, "--load-format", "dummy", "--model-path", self.model_path,
                "--dtype", self.dtype]


SPARE_S = 60.0  # each plan's expected times leave this much of its total: a slow step does not end the run

# every step any plan runs, in the order a plan runs them
STEPS = (
    Step("env", 20, 4, 2, "GPU, driver, CUDA, torch, MPS binaries, git commit", setup=True),
    Step("install", 40, 8, 5, "carried wheels: pip install --no-index --no-deps --target <work>/site", setup=True),
    Step("build", 90, 15, 10, "the C extension: python3 setup.py build_ext --inplace", setup=True),
    Step("libsmctrl", 60, 20, 10, "libsmctrl built from the source carried with the checkout"),
    Step("doctor-nomps", 70, 30, 20, "bullet doctor -v --json, MPS off"),
    Step("sm-probe", 260, 210, 60, "isolation probe counting SMs (spin blocks on %globaltimer) beside FMA, copy "
                                  "and GEMM probes, with clocks and power, per partition configuration"),
    Step("bench", 120, 55, 30, "engine micro-benchmark: copy and GEMM rates, prefill, decode graphs off/on vs floor, "
                                "mixed steps split or not, fused stages or torch lines"),
    Step("models", 180, 90, 45, "other models and formats: FP8 vs bf16 GEMMs at 8B shapes; Qwen3-32B, Qwen3-30B-A3B "
                                "and FP8 Llama-3.1-8B decode (graphs) against their memory floors"),
    Step("mps-start", 15, 2, 2, "nvidia-cuda-mps-control -d", mps=True),
    Step("doctor-mps", 70, 30, 20, "bullet doctor -v --json, MPS on", mps=True),
    Step("gpu-tests", 70, 25, 15, "pytest -m gpu on the GPU-marked test files", mps=True),
    Step("profile", 120, 65, 40, "bullet profile --quick: the bullet policy's profile, measured once", mps=True),
    Step("serve", 420, 305, 110, "served comparison at steady state: every system at the same rates, same arrivals",
         mps=True),
    Step("mps-stop", 15, 1, 0, "echo quit | nvidia-cuda-mps-control", mps=True),
    Step("replay", 45, 12, 5, "the simulator replays the served points on this run's profile and step timelines"),
)
NAMES = tuple(s.name for s in STEPS)


def _only(*names: str) -> tuple[Step, ...]:
    unknown = set(names) - set(NAMES)
    assert not unknown, unknown
    return tuple(s for s in STEPS if s.name in names)


def _with(steps: tuple[Step, ...], **budgets: tuple[float, float, float]) -> tuple[Step, ...]:
    """`steps` with other (cap, expect, min) budgets for the named ones (names with '_' for '-')."""
    out = []
    for s in steps:
        cap, expect, least = budgets.get(s.name.replace("-", "_"), (s.cap_s, s.expect_s, s.min_s))
        out.append(replace(s, cap_s=cap, expect_s=expect, min_s=least))
    return tuple(out)


SETUP = ("env", "install", "build")

# Llama-3.1-8B, prompts 128-2048, 128 out on an H200: the 2026-11-26 bursts saturated at 12-13 req/s
# (chunked:1024, sglang:1024), so 6/12/18 spans the knee and 18 is the goal's 1.5x of it; 24 is
# served only when time allows. Systems in the order they are kept: bullet; chunked:1024 and
# sglang:1024, the strongest baselines there; static (8.7 req/s there) goes first.
GPU_SERVE = ServePlan(
    systems=(("bullet", "green-ctx"), ("chunked:1024", "none"), ("sglang:1024", "none"), ("static", "green-ctx")),
    rates=(6.0, 12.0, 18.0, 24.0), prompt_tokens=(128, 2048), output_tokens=128, window_s=20.0, warmup_s=4.0,
    drain_s=5.0, vocab=128000, launch_s=20.0,
    launch_flags=("--max-total-tokens", "262144", "--max-running-requests", "128", "--shutdown-timeout", "3"),
    ttft_slo="3ms/token", tpot_slo="50ms")

_GPU = dict(device="cuda", model_path="llama-3.1-8b", dtype="bfloat16", total_s=480, serve=GPU_SERVE,
            bench_args=("--device", "cuda", "--load-format", "dummy", "--model-path", "llama-3.1-8b",
                        "--dtype", "bfloat16"),
            models_args=("--device", "cuda"),
            profile_args=("--partition-backend", "green-ctx", "--quick", "--no-progress"))

SERVE = Plan(name="serve", steps=_only(*SETUP, "mps-start", "profile", "serve", "mps-stop", "replay"),
             what="the served comparison at steady state (the profile first, unless given; the replay after)", **_GPU)
MECHANISM = Plan(name="mechanism",
                 steps=_only(*SETUP, "libsmctrl", "doctor-nomps", "sm-probe", "mps-start", "doctor-mps", "gpu-tests",
                             "mps-stop"),
                 what="does the partition hold: libsmctrl, the doctor (MPS off, on), the SM probe, the GPU tests",
                 **_GPU)
ENGINE = Plan(name="engine", steps=_only(*SETUP, "bench", "models", "mps-start", "profile", "mps-stop"),
              what="the engine micro-benchmark, the other models and formats, and the bullet policy's profile", **_GPU)
GPU_PLANS = {p.name: p for p in (SERVE, MECHANISM, ENGINE)}

# SmolLM2 on the CPU: tiny sizes, every system on the cpu backend or none, no MPS, no wheels (the
# CPU environment has the packages; the carried wheels are Python 3.12's). Its points are shorter
# than the GPU's (the arithmetic is the same); its total is no lease: every step of every plan.
CPU_SMOKE = Plan(
    name="cpu-smoke", device="cpu", model_path="smollm2-135m", dtype="float32", total_s=660,
    # 2 shared cores: the doctor and the CPU profile take longer than on the GPU machine's 16
    steps=_with(STEPS, env=(30, 8, 2), build=(60, 5, 3), doctor_nomps=(60, 25, 10), bench=(90, 35, 20),
                models=(60, 20, 10), gpu_tests=(60, 20, 10), profile=(150, 90, 40), serve=(360, 260, 60),
                replay=(60, 20, 5),
                sm_probe=(150, 90, 40)),  # the CPU's two configurations only
    serve=ServePlan(
        systems=(("bullet", "cpu"), ("chunked:256", "none"), ("sglang:256", "none"), ("static", "cpu")),
        rates=(1.0, 2.0, 4.0), prompt_tokens=(16, 96), output_tokens=8, window_s=6.0, warmup_s=1.0, drain_s=3.0,
        vocab=49000, launch_s=30.0, least_start_s=180.0,  # a start took 55-70 s on 2 busy cores
        launch_flags=("--max-total-tokens", "8192", "--max-running-requests", "16", "--shutdown-timeout", "3"),
        ttft_slo="20ms/token", tpot_slo="300ms"),
    what="every step of every plan that can run on a CPU (dummy SmolLM2-135M): the orchestration, not the GPU",
    skipped={"install": "cpu smoke: this Python already has the packages (the carried wheels are for 3.12)",
             "mps-start": "cpu smoke: no MPS on a CPU", "doctor-mps": "cpu smoke: no MPS on a CPU",
             "mps-stop": "cpu smoke: no MPS on a CPU"},
    bench_args=("--device", "cpu", "--load-format", "dummy", "--model-path", "smollm2-135m", "--dtype", "float32",
                "--threads", "1", "--repeats", "1"),
    models_args=("--device", "cpu", "--threads", "1", "--repeats", "1"),
    profile_args=("--quick", "--no-progress"),
)
PLANS = {**GPU_PLANS, CPU_SMOKE.name: CPU_SMOKE}


def select(plan: Plan, names: list[str] | None, setup: bool = True) -> list[Step]:
    """The steps to run, in plan order: all, or `names` plus the setup steps (unless `setup` is
    False) and the MPS start/stop around any step that needs MPS."""
    if names is None:
        return list(plan.steps)
    unknown = sorted(set(names) - set(plan.names))
    if unknown:
        elsewhere = [f"{n} is in plan {', '.join(p.name for p in PLANS.values() if n in p.names)}"
                     for n in unknown if n in NAMES]
        raise ValueError(f"unknown step(s) {', '.join(unknown)} for plan {plan.name}; its steps are "
                         f"{', '.join(plan.names)}" + (f" ({'; '.join(elsewhere)})" if elsewhere else ""))
    wanted = set(names)
    if setup:
        wanted |= {s.name for s in plan.steps if s.setup}
    if any(plan.step(n).mps for n in wanted) and "mps-start" in plan.names:
        wanted |= {"mps-start", "mps-stop"}
    return [s for s in plan.steps if s.name in wanted]


def budget_lines(plan: Plan, steps: list[Step]) -> list[str]:
    """The plan as a table: every step, its cap and expected time, and the total against the budget."""
    lines = [f"plan {plan.name}: {plan.what}",
             f"  {plan.model_path} ({plan.dtype}, dummy weights) on {plan.device}, {plan.total_s:.0f} s in all",
             f"  {'step':<13} {'expect':>7} {'cap':>6} {'min':>5}  what"]
    for s in steps:
        note = f"  (skipped: {plan.skipped[s.name]})" if s.name in plan.skipped else ""
        lines.append(f"  {s.name:<13} {s.expect_s:>6.0f}s {s.cap_s:>5.0f}s {s.min_s:>4.0f}s  {s.what}{note}")
    run = [s for s in steps if s.name not in plan.skipped]
    expect = sum(s.expect_s for s in run) + plan.report_s
    lines.append(f"  expected {expect:.0f} s of {plan.total_s:.0f} s (report {plan.report_s:.0f} s; "
                 f"{plan.total_s - expect:.0f} s to spare); a step starts only when the least every later step "
                 "needs is still left")
    if any(s.name == "serve" for s in steps):
        sp = plan.serve
        lines.append(f"  serve: {', '.join(f'{p} ({b})' for p, b in sp.systems)} at "
                     f"{', '.join(f'{r:g}' for r in sp.rates)} req/s, each server launched once for all its rates; "
                     f"prompts {sp.prompt_tokens[0]}-{sp.prompt_tokens[1]} random token ids, {sp.output_tokens} output "
                     f"tokens, ignore_eos; per point {sp.window_s:g} s of Poisson arrivals (the first {sp.warmup_s:g} s "
                     f"a warm-up, not scored), then drained until every request finished, at most until the SLO's "
                     f"bound, sooner when every request left has missed (cut ones count as misses); the same points "
                     f"for every system; when time is short the highest rates go first (down to {sp.min_rates}), "
                     f"then the last systems (down to {sp.min_systems})")
    return lines
