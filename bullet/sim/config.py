"""What a simulated run is configured with, and how it becomes the real runtime's objects: a
`ServerArgs` for the policy factory, the device's estimator, each policy's own estimator, the KV
pool size, the contention model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from bullet.config import ServerArgs
from bullet.schedulers.intensity import ridge_token_limit
from bullet.sim.perturbed import PerturbedPredictor
from engines.model_config import ModelConfig
from estimator import Estimator
from estimator.analytic_contention import DEFAULT_FLOOR, DEFAULT_PREFILL_SLOWDOWN, AnalyticContention
from estimator.hardware import DTYPE_BYTES, HardwareSpec
from estimator.profile import load_estimator
from estimator.reference.profiles import SHIPPED_PROFILE

# calibrated profiles shipped with the estimator, per built-in hardware name
SHIPPED_PROFILES = {"a100": SHIPPED_PROFILE}
GB = 1e9


@dataclass
class SimConfig:
    policy: str = "bullet"  # bullet | static[:<prefill units>] | naive | chunked:<token budget>
    model: str = "llama-3.1-8b"  # a built-in model config (engines/configs)
    hardware: str = "a100"  # a built-in GPU (estimator.hardware.BUILTIN)
    estimator_profile: str | None = None  # default: the shipped profile of the hardware, else SRM only
    ttft_slo: str = "3.0ms/token"
    tpot_slo: str = "150ms"
    prefill_layers_per_step: int = 4
    max_prefill_tokens: int = 4096
    max_running_requests: int = 1024  # most requests running at once, every policy (--max-running-requests)
    page_size: int = 16
    kv_memory_gb: float | None = None  # default: device memory minus the weights
    noise: float = 0.05  # each step's latency x U[1-noise, 1+noise]
    contention_model: bool = True  # charge memory contention between the workers (estimator.analytic_contention)
    contention_floor: float = DEFAULT_FLOOR
    prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN
    overlap_share: str = "demand"  # how units both workers hold are divided: demand | even
    policy_contention: bool = True  # policies' estimators hold the contention table, as a profiled device's would
    policy_error: float = 0.10  # each policy predicts with a copy wrong by this much on average (bullet.sim.perturbed)
    policy_error_learnable: bool = True  # online refinement sees that error (as a real worker's would); False: it cannot
    step_overhead_s: float = 0.5e-3  # per step, every system: launch and scheduling outside the kernels
    prefill_preemption: bool = True  # bullet: layer-boundary preemption of the prefill batch in flight
    hand_back: str = "bounded"  # bullet: off | decode-step | bounded
    layer_group: str = "fixed"  # bullet: fixed (prefill_layers_per_step) | adaptive (about one decode step)
    split_rule: str = "spatial"  # bullet: spatial | aggregate (DuetServe: split only when TPOT would break)
    idle_decode_units: str = "all"  # bullet: all | efficient (fewest units within 10 % of all while prefill idles)
    radix_cache: bool = False  # the prefix cache (off by default: the traces share no tokens, see Simulation)
    handoff_delay_s: float = 0.0  # prefill -> decode metadata latency (Bullet Table 5: 0.21 ms mean)
    seed: int = 0
    timeline_dir: str | None = None
    stop_below_attainment: float | None = None  # stop once this attainment is out of reach

    def as_dict(self) -> dict:
        return asdict(self)

    def contention(self, estimator: Estimator) -> AnalyticContention | None:
        if not self.contention_model:
            return None
        return AnalyticContention(estimator, self.contention_floor, self.prefill_slowdown)

    def batch_token_limit(self, estimator: Estimator):
        """The prefill batching limit the real runtime gives Bullet's policy (arithmetic intensity
        reaching the ridge point on the units it holds)."""
        return ridge_token_limit(estimator.model, estimator.hardware, estimator.dtype, DTYPE_BYTES[estimator.dtype])


def device_estimator(config: SimConfig) -> Estimator:
    """The estimator the device charges latencies from."""
    model = ModelConfig.builtin(config.model)
    hardware = HardwareSpec.builtin(config.hardware)
    path = config.estimator_profile or SHIPPED_PROFILES.get(config.hardware.lower())
    if path is None:
        return Estimator(model, hardware)  # SRM only: no calibration exists for this device
    est = load_estimator(path, model=model)
    if est.hardware.name != hardware.name:
        raise ValueError(f"{path} describes {est.hardware.name}, not {hardware.name} (--hardware {config.hardware})")
    return est


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
    est = Estimator(device.model, device.hardware, device.calibration.model_copy(deep=True), table, device.dtype)
    return PerturbedPredictor(est, config.policy_error, seed=f"{config.seed}|{role}",
                              learnable=config.policy_error_learnable)


def weight_bytes(model: ModelConfig, dtype_bytes: int = 2) -> int:
    h, i, L, V = model.hidden_size, model.intermediate_size, model.num_hidden_layers, model.vocab_size
    per_layer = h * (model.q_size + 2 * model.kv_size) + model.q_size * h + 3 * h * i + 2 * h
    heads = V * h * (1 if model.tie_word_embeddings else 2) + h
    return (L * per_layer + heads) * dtype_bytes


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2) -> int:
    return 2 * model.num_hidden_layers * model.kv_size * dtype_bytes


def kv_pool_pages(config: SimConfig, model: ModelConfig, hardware: HardwareSpec) -> int:
    """Pages of the KV pool: the device's memory minus the weights (or `kv_memory_gb`)."""
    if config.kv_memory_gb is not None:
        pool = config.kv_memory_gb * GB
    else:
        if hardware.memory_bytes is None:
            raise ValueError(f"{hardware.name} has no memory size: give kv_memory_gb")
        pool = hardware.memory_bytes - weight_bytes(model)
    pages = int(pool // (kv_bytes_per_token(model) * config.page_size))
    if pages < 1:
        raise ValueError(f"{model.name} does not fit on {hardware.name}: no memory left for the KV cache")
    return pages


def server_args(config: SimConfig, pages: int) -> ServerArgs:
    """The runtime's configuration object for the policy factory, as `bullet launch` would build it."""
    return ServerArgs(policy=config.policy, ttft_slo=config.ttft_slo, tpot_slo=config.tpot_slo,
                      prefill_layers_per_step=config.prefill_layers_per_step,
                      max_prefill_tokens=config.max_prefill_tokens,
                      max_running_requests=config.max_running_requests, page_size=config.page_size,
                      max_total_tokens=pages * config.page_size, timeline_dir=config.timeline_dir,
                      prefill_preemption=config.prefill_preemption, hand_back=config.hand_back,
                      layer_group=config.layer_group, split_rule=config.split_rule,
                      idle_decode_units=config.idle_decode_units, disable_radix_cache=not config.radix_cache,
                      partition_backend="none")
