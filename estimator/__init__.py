"""Performance estimator (Bullet §3.2): op inventory, hardware specs, SM-scaling roofline with wave
quantization, calibration (Eq. 2) with online refinement, prefill/decode contention, profiles.

    from estimator import load_estimator
    est = load_estimator("profile.json")           # or estimator/reference/data/a100-llama-3-8b.json
    est.prefill_time([1024, 300], units=54, num_layers=4, include_head=False)
    est.decode_time(64, 64 * 2000, units=54, co_prefill_tokens=1324)   # (batch, total context)
    est.decode_time_for([2000] * 64, units=54)                           # per-request contexts
    est.observe_decode([2000] * 64, 54, measured_seconds)

Modules: `ops` (kernels of a layer), `tiling` and `waves` (grids, wave quantization, Table 2),
`hardware` (GPU specs, measured CPUs), `srm` (Eq. 1), `calibration` (samples, alpha curves, online
corrections), `contention` (D_{p,sl}) and `analytic_contention` (an assumed co-run model),
`kernel_model` + `estimator` (the fast model, class `Estimator`), `profile` (the JSON file),
`reference/` (A100 from public data), `profiler/` (`bullet profile`: the served model measured on
this CPU, solo and co-running; imports torch). Importing the package does not import torch."""

from estimator.calibration import Calibration, Sample
from estimator.contention import ContentionModel
from estimator.estimator import Estimator
from estimator.hardware import HardwareSpec
from estimator.ops import ExecutionState
from estimator.profile import EstimatorProfile, load_estimator, save_estimator

__all__ = ["Calibration", "ContentionModel", "Estimator", "EstimatorProfile", "ExecutionState", "HardwareSpec",
           "Sample", "load_estimator", "save_estimator"]
