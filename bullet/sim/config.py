"""What a simulated run is configured with, and how it becomes the real runtime's objects: a
`ServerArgs` for the policy factory, the device's estimator, each policy's own estimator, the KV
pool size, the contention model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from bullet.config import ServerArgs
from bullet.policies.intensity import ridge_token_limit
from bullet.sim.device import CPU_OVERSUBSCRIBED_SLOWDOWN
from bullet.sim.perturbed import PerturbedPredictor
from engines.model_config import ModelConfig
from estimator import Estimator
from estimator.analytic_contention import DEFAULT_FLOOR, DEFAULT_PREFILL_SLOWDOWN, AnalyticContention
from estimator.hardware import DTYPE_BYTES, HardwareSpec
from estimator.interconnect import Interconnect
from estimator.profile import EstimatorProfile
from estimator.reference.profiles import H200_PROFILE, SHIPPED_PROFILE
from estimator.tensor_parallel import TensorParallel, shard_model

# calibrated profiles shipped with the estimator, per built-in hardware name
# the A100 from public kernel measurements; the H200 measured by `bullet profile --device cuda` on a
# GPU (its notes name the run: driver, commit, date) — `--hardware h200` is that device, not its spec sheet
SHIPPED_PROFILES = {"a100": SHIPPED_PROFILE, "h200": H200_PROFILE}
GB = 1e9


@dataclass
class SimConfig:
    policy: str = "bullet"  # bullet | static[:<prefill units>] | naive | chunked:<token budget>
    model: str | None = None  # a built-in model config (engines/configs); default: the profile's, else llama-3.1-8b
    hardware: str | None = None  # a built-in GPU (estimator.hardware.BUILTIN); default: the profile's, else a100
    # the device model: a profile file (`bullet profile`, e.g. a GPU measured with --device cuda); default:
    # the shipped profile of the hardware, else SRM only
    estimator_profile: str | None = None
    ttft_slo: str = "3.0ms/token"
    tpot_slo: str = "150ms"
    tbt_slo: str | None = None  # bound on each request's P99 time between tokens (None: TBT not judged)
    prefill_layers_per_step: int = 4
    max_prefill_tokens: int = 4096
    max_running_requests: int = 1024  # most requests running at once, every policy (--max-running-requests)
    page_size: int = 16
    kv_memory_gb: float | None = None  # default: device memory minus the weights
    # the weights' storage: none (the compute dtype, bf16) | fp8 (the projections a byte each, as an FP8
    # checkpoint stores them; GEMMs still priced at bf16's rate)
    quantization: str = "none"
    max_total_tokens: int | None = None  # the KV pool in tokens (SGLang's --max-total-tokens); beats kv_memory_gb
    # tensor parallelism (SGLang's --tp-size): the model split over this many devices of `hardware`, both
    # workers on every device with the same SM split; the device is priced as one rank (its shard, its
    # weights and KV cache, its collectives over `tp_link`). 1: one device runs the whole model
    tp_size: int = 1
    tp_link: str | None = None  # the devices' link (estimator.interconnect.LINKS); default: the hardware's own
    tp_link_busbw_gbps: float | None = None  # the link's all-reduce bus bandwidth, in place of the link's own
    tp_link_latency_us: float | None = None  # its latency per collective, in place of the link's own
    noise: float = 0.05  # each step's latency x U[1-noise, 1+noise]
    contention_model: bool = True  # charge memory contention between the workers (estimator.analytic_contention)
    contention_floor: float = DEFAULT_FLOOR
    prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN
    # how units both workers hold are divided (bullet.sim.device): demand | even | time-sliced | measured;
    # auto: time-sliced on a device whose units are cores; on a GPU measured where its profile timed both
    # phases on every SM (`contention.shared_units`), else demand
    overlap_share: str = "auto"
    # time-sliced (and measured, for both phases: a what-if): a step of several threads on cores the other
    # worker's threads hold takes this many times its time alone (measured from a served run's timelines,
    # `artifact.served_corun --oversubscribed`); None: the profile's own measurement (`shared_units`), else
    # the value measured served on a 2-core AMD EPYC (bullet.sim.device.CPU_OVERSUBSCRIBED_SLOWDOWN)
    oversubscribed_slowdown: float | None = None
    # measured (a what-if by phase): {"prefill": F, "decode": F} a step on SMs both workers hold takes over
    # its time alone, in place of the profile's measured factor (or `oversubscribed_slowdown`) for each
    # phase named; e.g. a compute-bound prefill barely slowed, a memory-bound decode halved
    shared_slowdown: dict[str, float] = field(default_factory=dict)
    policy_contention: bool = True  # policies' estimators hold the contention table, as a profiled device's would
    policy_error: float = 0.10  # each policy predicts with a copy wrong by this much on average (bullet.sim.perturbed)
    policy_error_learnable: bool = True  # online refinement sees that error (as a real worker's would); False: it cannot
    # per step, every system: launch and scheduling outside the kernels. None: 0 with a profile whose
    # phase samples timed whole steps (their calibration already carries what the steps spent outside
    # the kernels), else 0.5 ms (`step_overhead`)
    step_overhead_s: float | None = None
    # every step's kernels take this many times what the device model says: a served machine that ran
    # slower than its profile (another load on its cores, a host whose speed drifts), measured from the
    # served run's own step log (`artifact.served_steps`). 1.0: the profile as measured
    step_time_scale: float = 1.0
    # a step beside the other worker's takes this many times the device model's co-run price: a what-if
    # for partitions that isolate worse (> 1) or better (< 1) than the profile's co-runs measured
    # (`bullet.sim.device`); 1.0: as profiled. Every system whose workers co-run pays it, none other does
    corun_scale: float = 1.0
    # per worker role (prefill, decode, unified): (scale, overhead s) in place of the two above for that
    # role's steps — two workers whose served steps ran off the profile by different amounts (a served
    # prefill worker paying a per-prompt set-up its decode worker never saw); fitted per role by
    # `artifact.served_steps`. Empty: every role alike
    role_step_times: dict[str, tuple[float, float]] = field(default_factory=dict)
    # seconds a worker spends the first time its prompt attention meets a fresh sequence of a new
    # length (a per-shape kernel plan built on the host: cuDNN's SDPA graph on Hopper); 0: none
    attention_setup_s: float = 0.0
    prefill_preemption: bool = True  # bullet: layer-boundary preemption of the prefill batch in flight
    hand_back: str = "bounded"  # bullet: off | decode-step | bounded
    layer_group: str = "fixed"  # bullet: fixed (prefill_layers_per_step) | adaptive (about one decode step)
    split_rule: str = "spatial"  # bullet: spatial | aggregate (DuetServe: split only when TPOT would break)
    decode_tail_share: bool = True  # bullet: decode takes every unit for a step in which prefill's batch ends
    split_goal: str = "prefill-first"  # bullet, while TPOT has slack: prefill-first | throughput (bullet.config)
    prefill_grow: str = "after-decode-step"  # bullet: after-decode-step | at-once (bullet.config)
    slo_percentile: float = 0.9  # bullet: the percentile of predicted TTFT / TPOT each scheduler keeps in its SLO
    idle_decode_units: str = "all"  # bullet: all | efficient (fewest units within 10 % of all while prefill idles)
    radix_cache: bool = False  # the prefix cache (off by default: the traces share no tokens, see Simulation)
    handoff_delay_s: float = 0.0  # prefill -> decode metadata latency (Bullet Table 5: 0.21 ms mean)
    seed: int = 0
    timeline_dir: str | None = None
    stop_below_attainment: float | None = None  # stop once this attainment is out of reach
    ledger: bool = False  # account what the split gains and costs (bullet.sim.ledger); prices every step on all units too

    def as_dict(self) -> dict:
        return asdict(self)

    def contention(self, estimator: Estimator) -> AnalyticContention | None:
        """The assumed contention model, where the device's profile measured none."""
        if not self.contention_model or measured_contention(estimator):
            return None
        return AnalyticContention(estimator, self.contention_floor, self.prefill_slowdown)

    def batch_token_limit(self, estimator: Estimator):
        """The prefill batching limit the real runtime gives Bullet's policy (arithmetic intensity
        reaching the ridge point on the units it holds)."""
        return ridge_token_limit(estimator.model, estimator.hardware, estimator.dtype, DTYPE_BYTES[estimator.dtype],
                                 weight_bytes=estimator.kernels.weight_bytes)


DEFAULT_MODEL, DEFAULT_HARDWARE = "llama-3.1-8b", "a100"
SPEC_STEP_OVERHEAD_S = 0.5e-3  # assumed per step where no measured step says otherwise


def device_estimator(config: SimConfig) -> Estimator:
    """The estimator the device charges latencies from: a profile's device (its measured rates and
    calibration) when `estimator_profile` is given, else a built-in GPU and its shipped profile.
    A calibration holds whole steps timed on its profile's model, so it describes only models of
    that shape: another --model is refused with a given profile, and gets the roofline alone on a
    built-in device (the shipped A100 profile would otherwise charge Llama-8B's times to any model).
    With `tp_size` > 1 the estimator prices one rank: the model's shard on a built-in device (its
    roofline: no profile measured a shard), plus the collectives over the link."""
    if config.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {config.tp_size}")
    if config.tp_size > 1:
        return rank_estimator(config)
    model = ModelConfig.builtin(config.model) if config.model else None
    if config.quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {config.quantization!r}; choose {', '.join(QUANTIZATIONS)}")
    weights = "fp8" if config.quantization == "fp8" else None
    if config.estimator_profile:
        if weights:
            raise ValueError(f"{config.estimator_profile} measured its model's own weights: --quantization fp8 "
                             "simulates a built-in --hardware only")
        profile = EstimatorProfile.read(config.estimator_profile)
        if model is not None and model.kernel_shape() != profile.model.kernel_shape():
            raise ValueError(f"{config.estimator_profile} was calibrated on {profile.model.name}, whose kernels "
                             f"differ from {model.name}'s: leave --model out, or profile {model.name}")
        est = profile.estimator(model)
        shipped = SHIPPED_PROFILES.get((config.hardware or "").lower())
        if (config.hardware and est.hardware.name != HardwareSpec.builtin(config.hardware).name
                and not (shipped and Path(shipped).resolve() == Path(config.estimator_profile).resolve())):
            raise ValueError(f"{config.estimator_profile} describes {est.hardware.name}, not --hardware "
                             f"{config.hardware}: leave --hardware out to simulate the profile's device")
        return est
    model = model or ModelConfig.builtin(DEFAULT_MODEL)
    name = config.hardware or DEFAULT_HARDWARE
    hardware = HardwareSpec.builtin(name)
    path = SHIPPED_PROFILES.get(name.lower())
    if path is None or weights:
        # SRM only: no calibration exists for this device, or for weights stored in another precision
        return Estimator(model, hardware, weight_dtype=weights)
    profile = EstimatorProfile.read(path)
    if profile.model.kernel_shape() != model.kernel_shape():
        return Estimator(model, hardware)  # SRM only: no calibration exists for this model on this device
    # a measured device is named as its profile says (e.g. "NVIDIA H200 (green-ctx)"): its shipped
    # profile is that device by construction
    return profile.estimator(model)


def rank_estimator(config: SimConfig) -> Estimator:
    """One of `tp_size` tensor-parallel ranks on a built-in device: its shard's kernels on the
    device's spec-sheet rates, and its collectives over `tp_link` (default the device's own link)."""
    if config.estimator_profile:
        raise ValueError(f"{config.estimator_profile} measured one device running the whole model; --tp-size "
                         f"{config.tp_size} prices one rank's shard on a built-in --hardware: "
                         "leave --estimator-profile out")
    model = ModelConfig.builtin(config.model or DEFAULT_MODEL)
    if config.quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {config.quantization!r}; choose {', '.join(QUANTIZATIONS)}")
    hardware = HardwareSpec.builtin(config.hardware or DEFAULT_HARDWARE)
    if config.tp_link:
        link = Interconnect.builtin(config.tp_link)
    elif hardware.interconnect is not None:
        link = hardware.interconnect
    else:
        raise ValueError(f"{hardware.name} has no link to its peers: give tp_link")
    busbw, latency = config.tp_link_busbw_gbps, config.tp_link_latency_us
    if (busbw is not None and not busbw > 0) or (latency is not None and not latency >= 0):
        raise ValueError(f"the link needs busbw > 0 and latency >= 0, got {busbw} GB/s, {latency} us")
    link = link.with_rates(None if busbw is None else busbw * GB, None if latency is None else latency / 1e6)
    return Estimator(shard_model(model, config.tp_size), hardware,
                     weight_dtype="fp8" if config.quantization == "fp8" else None,
                     tensor_parallel=TensorParallel.of(model, config.tp_size, link))


def measures_steps(estimator: Estimator) -> bool:
    """The calibration holds whole steps timed on the device itself (a `bullet profile` of it: its
    rates are measured too), not only kernels or steps taken from elsewhere."""
    return bool(estimator.hardware.measured_bandwidth) and any(
        s.kind in ("prefill", "decode") and s.include_head and s.num_layers is None
        for s in estimator.calibration.samples)


def step_overhead(config: SimConfig, estimator: Estimator) -> float:
    """Seconds the device charges after each step's kernels (`SimConfig.step_overhead_s`)."""
    if config.step_overhead_s is not None:
        return config.step_overhead_s
    return 0.0 if measures_steps(estimator) else SPEC_STEP_OVERHEAD_S


def overlap_share(config: SimConfig, estimator: Estimator) -> str:
    """How the device divides units both workers hold (`SimConfig.overlap_share`): `auto` is
    time-sliced where the units are cores (the OS schedules threads; no block scheduler divides a core);
    on a GPU, priced by what its profile measured of both phases on every SM (`measured`, profiles
    since 2026-12-02) or by the config's what-if factors, else demand-shared (the SMs go to each step
    by its demand, for free: assumed)."""
    factors = shared_slowdowns(config, estimator)
    if config.overlap_share != "auto":
        mode = config.overlap_share
        if mode == "measured" and factors is None:
            raise ValueError("overlap_share 'measured' needs a profile that timed each phase on every unit beside "
                             "the other (contention.shared_units for prefill and decode), or "
                             "--oversubscribed-slowdown / --shared-slowdown for both phases; this one has neither")
    elif estimator.hardware.kind == "cpu":
        mode = "time-sliced"
    else:
        mode = "measured" if factors is not None else "demand"
    if config.shared_slowdown and mode != "measured":
        raise ValueError(
            f"shared_slowdown (--shared-slowdown) prices a step on shared units by its phase, which only "
            f"overlap_share 'measured' does, and this run's is {mode!r}"
            + (": both prefill and decode need a factor, the profile's or one named here" if factors is None else
               " (on cores, --oversubscribed-slowdown prices the time slices)" if mode == "time-sliced" else ""))
    return mode


def shared_slowdowns(config: SimConfig, estimator: Estimator) -> dict[str, float] | None:
    """{role: factor} a step on units both workers hold takes over its time alone: the config's
    `oversubscribed_slowdown` for both phases (a what-if), else what the profile measured of each
    phase on every unit beside the other on every unit (`contention.shared_units`); then the config's
    `shared_slowdown` for each phase it names (a what-if by phase). None unless both phases have one."""
    unknown = config.shared_slowdown.keys() - {"prefill", "decode"}
    if unknown:
        raise ValueError(f"shared_slowdown (--shared-slowdown) names the phases prefill and decode, "
                         f"not {sorted(unknown)}")
    low = {k: v for k, v in config.shared_slowdown.items() if not v >= 1.0}
    if low:
        raise ValueError(f"shared_slowdown (--shared-slowdown) factors must be at least 1 (a step on shared "
                         f"units is no faster than alone), got {low}")
    if config.oversubscribed_slowdown is not None:
        factors = {"prefill": config.oversubscribed_slowdown, "decode": config.oversubscribed_slowdown}
    else:
        factors = {p.kind: p.factor for p in estimator.contention.shared_units}
    factors.update(config.shared_slowdown)
    return factors if {"prefill", "decode"} <= factors.keys() else None


def oversubscribed_slowdown(config: SimConfig, estimator: Estimator) -> float:
    """What a step of several threads pays on cores both workers hold (`SimConfig.oversubscribed_slowdown`):
    the config's, else the profile's own measurement (`bullet profile` times each phase on every core
    beside the other on every core, since 2026-12-01), else the one measured served on a 2-core AMD EPYC."""
    if config.oversubscribed_slowdown is not None:
        return config.oversubscribed_slowdown
    return estimator.contention.shared_units_slowdown() or CPU_OVERSUBSCRIBED_SLOWDOWN


def measured_contention(estimator: Estimator) -> bool:
    """The profile measured how the phases slow each other (steps timed beside the other phase):
    the device charges that table instead of the assumed model."""
    return bool(estimator.contention.decode_bandwidth or estimator.contention.prefill_slowdown)


def is_calibrated(estimator: Estimator) -> bool:
    return bool(estimator.calibration.samples)


def policy_estimator(config: SimConfig, device: Estimator, role: str = "policy") -> PerturbedPredictor:
    """A policy's own estimator: the same calibration (a copy it may refine online), plus the
    contention table a profiled device would have when `policy_contention`, wrong by `policy_error`
    (each role draws its own errors, as each worker's profile would be)."""
    contention = config.contention(device)
    table = None
    if config.policy_contention and contention is not None:
        table = contention.contention_table(device.hardware.partition_sizes())
    elif config.policy_contention and config.contention_model and measured_contention(device):
        table = device.contention.model_copy(deep=True)  # the profile's own, as a worker would load it
    est = Estimator(device.model, device.hardware, device.calibration.model_copy(deep=True), table, device.dtype,
                    device.weight_dtype, device.tensor_parallel)
    return PerturbedPredictor(est, config.policy_error, seed=f"{config.seed}|{role}",
                              learnable=config.policy_error_learnable)


QUANTIZATIONS = ("none", "fp8")


def weight_bytes(model: ModelConfig, dtype_bytes: int = 2, quantization: str = "none") -> int:
    """Every parameter in `dtype_bytes`, or with `fp8` the projections' a byte each."""
    total = model.num_parameters()
    if quantization == "fp8":
        projections = model.projection_parameters()
        return projections * DTYPE_BYTES["fp8"] + (total - projections) * dtype_bytes
    return total * dtype_bytes


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2) -> int:
    return 2 * model.num_hidden_layers * model.kv_size * dtype_bytes


def kv_pool_pages(config: SimConfig, model: ModelConfig, hardware: HardwareSpec) -> int:
    """Pages of the KV pool: `max_total_tokens`, else the device's memory minus the weights (or
    `kv_memory_gb`). Under tensor parallelism `model` is one rank's shard: each device holds its
    weights and its KV heads of every token, so the pool's tokens are what one device's memory
    left after the shard holds."""
    if config.max_total_tokens is not None:
        if config.max_total_tokens < config.page_size:
            raise ValueError(f"max_total_tokens {config.max_total_tokens} holds no page of {config.page_size} tokens")
        return config.max_total_tokens // config.page_size
    if config.kv_memory_gb is not None:
        pool = config.kv_memory_gb * GB
    else:
        if hardware.memory_bytes is None:
            raise ValueError(f"{hardware.name} has no memory size: give kv_memory_gb")
        weights = weight_bytes(model, quantization=config.quantization)
        if weights >= hardware.memory_bytes:
            raise ValueError(does_not_fit(model, hardware, config.quantization, config.tp_size))
        pool = hardware.memory_bytes - weights
    pages = int(pool // (kv_bytes_per_token(model) * config.page_size))
    if pages < 1:
        raise ValueError(f"{model.name} does not fit on {hardware.name}: no memory left for the KV cache")
    return pages


def does_not_fit(model: ModelConfig, hardware: HardwareSpec, quantization: str, tp_size: int = 1) -> str:
    """Why the weights alone overflow one device, and what would hold them (`model`: one rank's
    shard when `tp_size` > 1)."""
    memory = hardware.memory_bytes
    sizes = {q: weight_bytes(model, quantization=q) for q in QUANTIZATIONS}
    need = sizes[quantization]
    dtype = 'bf16' if quantization == 'none' else 'FP8 (projections) + bf16'
    if tp_size > 1:
        return (f"{model.name} does not fit: one of {tp_size} tensor-parallel ranks holds "
                f"{model.num_parameters() / 1e9:.1f}B parameters, {need / GB:.0f} GB in {dtype}, more than one "
                f"{hardware.name}'s {memory / GB:.0f} GB; give a larger --tp-size")
    line = (f"{model.name} does not fit on one {hardware.name}: its {model.num_parameters() / 1e9:.1f}B parameters take "
            f"{need / GB:.0f} GB in {dtype}, more than its "
            f"{memory / GB:.0f} GB; the weights alone need {-(-need // memory):.0f} such devices "
            "(--tp-size splits the model over several)")
    if quantization == "none" and sizes["fp8"] < memory:
        line += f" (with --quantization fp8 they take {sizes['fp8'] / GB:.0f} GB)"
    elif quantization == "none":
        line += f"; FP8 weights would take {sizes['fp8'] / GB:.0f} GB, still more than one device"
    return line + " (--kv-memory-gb sizes the KV pool by itself: the run then prices one device as if it held them)"


def server_args(config: SimConfig, pages: int) -> ServerArgs:
    """The runtime's configuration object for the policy factory, as `bullet launch` would build it."""
    return ServerArgs(policy=config.policy, ttft_slo=config.ttft_slo, tpot_slo=config.tpot_slo, tbt_slo=config.tbt_slo,
                      prefill_layers_per_step=config.prefill_layers_per_step,
                      max_prefill_tokens=config.max_prefill_tokens,
                      max_running_requests=config.max_running_requests, page_size=config.page_size,
                      max_total_tokens=pages * config.page_size, timeline_dir=config.timeline_dir,
                      prefill_preemption=config.prefill_preemption, hand_back=config.hand_back,
                      layer_group=config.layer_group, split_rule=config.split_rule, split_goal=config.split_goal, decode_tail_share=config.decode_tail_share,
                      slo_percentile=config.slo_percentile, prefill_grow=config.prefill_grow,
                      idle_decode_units=config.idle_decode_units, disable_radix_cache=not config.radix_cache,
                      partition_backend="none")
