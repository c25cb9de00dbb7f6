"""The estimator profile: one JSON file per (model, device, dtype) holding everything the estimator
knows from measurement — the hardware description, the calibration samples and online corrections,
the contention table. `bullet profile` writes it; workers and the simulator load it.

    {
      "format": "bullet-estimator-profile", "version": 1,
      "model": {ModelConfig fields},
      "dtype": "bf16",
      "hardware": {HardwareSpec fields},
      "calibration": {"samples": [{"kind": "qkv_proj", "units": 108, "seconds": 4.3e-05,
                                   "prefill_lens": [128], ...}, ...],
                      "interpolation": {"attn_decode": "affine"},
                      "online": {"weight": 0.25, "units_buckets": 4, "factors": {"decode/4": 1.02}}},
      "contention": {"decode_bandwidth": [{"units": 54, "prefill_tokens": 2048, "fraction": 0.8}],
                     "prefill_slowdown": [{"decode_batch": 64, "factor": 1.05}],
                     "samples": [co-running steps the tables were fitted to]},
      "notes": ["free text: how and when it was measured"],
      "provenance": {"model": ..., "dtype": ..., "cores": [...], "cpu": ..., ...}  (measured profiles)
    }
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from engines.model_config import ModelConfig
from estimator.calibration import Calibration
from estimator.contention import ContentionModel
from estimator.estimator import Estimator
from estimator.hardware import HardwareSpec

FORMAT = "bullet-estimator-profile"
VERSION = 1


class Provenance(BaseModel):
    """Where a measured profile comes from; `estimator.profiler.cache.ensure_profile` reuses a cached
    profile only if these still describe the model, dtype, cores, CPU and code at hand."""

    model: str  # cache name: the model's name and a digest of its file (estimator.profiler.cache.model_cache_name)
    model_source: str | None = None
    load_format: str = "auto"
    dtype: str
    quantization: str = "none"  # the weights as served: none | w8a8_int8 (the int8 model computes in fp32)
    cores: list[int]
    cpu: str
    bullet_version: str
    torch_version: str
    plan: Literal["quick", "full"]
    measured_at: str
    duration_s: float
    # measurements taken while other processes kept the machine busy (`estimator.profiler.session.CpuTimer`):
    # such a profile is reused only while the machine is still busy (`estimator.profiler.cache.reusable`)
    busy_measurements: int = 0

    @model_serializer(mode="wrap")
    def _without_a_quiet_count(self, handler):
        """A profile measured on a quiet machine is written as before the field existed (the shipped
        profiles stay the same bytes)."""
        data = handler(self)
        if not self.busy_measurements:
            data.pop("busy_measurements", None)
        return data


class EstimatorProfile(BaseModel):
    format: Literal["bullet-estimator-profile"] = FORMAT
    version: int = VERSION
    model: ModelConfig
    dtype: str = "bf16"
    hardware: HardwareSpec
    calibration: Calibration = Field(default_factory=Calibration)
    contention: ContentionModel = Field(default_factory=ContentionModel)
    notes: list[str] = Field(default_factory=list)
    provenance: Provenance | None = None  # measured profiles only

    @classmethod
    def from_estimator(cls, estimator: Estimator, notes: list[str] | None = None,
                       provenance: Provenance | None = None) -> "EstimatorProfile":
        return cls(model=estimator.model, dtype=estimator.dtype, hardware=estimator.hardware,
                   calibration=estimator.calibration, contention=estimator.contention, notes=notes or [],
                   provenance=provenance)

    def estimator(self, model: ModelConfig | None = None) -> Estimator:
        """An estimator for this profile; `model` overrides the stored shape (same-shaped models
        share calibrations, e.g. Llama-3-8B and Llama-3.1-8B)."""
        return Estimator(model or self.model, self.hardware, self.calibration.model_copy(deep=True),
                         self.contention.model_copy(deep=True), self.dtype)

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=1) + "\n")
        tmp.replace(path)  # readers never see a half-written profile

    @classmethod
    def read(cls, path: str | Path) -> "EstimatorProfile":
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not an estimator profile (format={data.get('format')!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: profile version {data.get('version')} unsupported (expected {VERSION})")
        return cls.model_validate(data)


def load_estimator(path: str | Path, model: ModelConfig | None = None) -> Estimator:
    """The estimator a profile file describes (`model` overrides the stored shape)."""
    return EstimatorProfile.read(path).estimator(model)


def save_estimator(estimator: Estimator, path: str | Path, notes: list[str] | None = None,
                   provenance: Provenance | None = None) -> None:
    EstimatorProfile.from_estimator(estimator, notes, provenance).write(path)
