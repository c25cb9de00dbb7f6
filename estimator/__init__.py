"""Performance estimator (Bullet §3.2): op inventory, hardware specs, SM-scaling roofline with wave
quantization, calibration (Eq. 2) with online refinement, prefill/decode contention, profiles.

    from estimator import Estimator
    est = Estimator.load("profile.json")           # or estimator/data/a100-llama-3-8b.json
    est.prefill_time([1024, 300], units=54, num_layers=4, include_head=False)
    est.decode_time((64, 64 * 2000), units=54, co_prefill_tokens=1324)
    est.observe_decode((64, 64 * 2000), 54, measured_seconds)

Modules: `ops` (kernels of a layer), `tiling` and `waves` (grids, wave quantization, Table 2),
`hardware` (GPU specs, measured CPUs), `srm` (Eq. 1), `calibration` (samples, alpha curves, online
corrections), `contention` (D_{p,sl}), `kernels` + `predictor` (the fast model), `profile` (JSON),
`cpu_probe` (measures the local CPU; imports torch), `reference_profiles` (A100 from public data),
`local_profile` (`bullet profile`: the served model measured on this CPU, solo and co-running, with
`ensure_profile` / `default_profile_path`; the `local_*` modules are its parts).
Importing the package does not import torch."""

from estimator.calibration import Calibration, Sample
from estimator.contention import ContentionModel
from estimator.hardware import HardwareSpec
from estimator.ops import ExecutionState
from estimator.predictor import Estimator, decode_summary
from estimator.profile import EstimatorProfile

__all__ = ["Calibration", "ContentionModel", "Estimator", "EstimatorProfile", "ExecutionState", "HardwareSpec",
           "Sample", "decode_summary"]
