"""What the estimator needs to know about a device: how many compute units it has, how fast they
compute and move memory, and how many units it takes to saturate memory bandwidth (Bullet §3.2.2).

GPUs are described from public spec sheets (see `BUILTIN`), each with the link an 8-GPU server of
its kind has (`estimator.interconnect`: the SXM boards' NVLink through NVSwitch); the local CPU is described by
measurement (`estimator.profiler.cpu_probe`), with units = cores. Either can be written to and read from
JSON, and is embedded in an estimator profile."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from estimator.interconnect import Interconnect

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


class HardwareSpec(BaseModel):
    """One device, as the SM-scaling roofline sees it. Rates are for the whole device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: Literal["gpu", "cpu"]
    units: int = Field(gt=0, description="compute units: SMs on a GPU, cores on a CPU")
    unit_name: str = "SM"
    peak_flops: dict[str, float] = Field(description="dtype -> FLOP/s with all units")
    peak_bandwidth: float = Field(gt=0, description="bytes/s of main memory with all units")
    bandwidth_inflection: float = Field(gt=0, description="N_d: units needed to saturate bandwidth")
    partition_step: int = Field(1, gt=0, description="units come in groups of this size (TPC = 2 SMs)")
    min_partition: int = Field(1, gt=0, description="smallest share a worker can be given")
    blocks_per_unit: int = Field(1, gt=0, description="b of §2.2.1: resident thread blocks per unit")
    wave_quantization: bool = Field(True, description="False when kernels split work evenly over units (CPU)")
    kernel_overhead_s: float = Field(0.0, ge=0, description="fixed cost of one kernel launch/dispatch")
    # How the engine measured on this device runs attention (set by `bullet profile`, which measures
    # Bullet's own torch engine; the GPU descriptions model FlashInfer-style kernels):
    prefill_attention_per_sequence: bool = Field(
        False, description="a packed prefill's attention is one kernel per sequence, not one varlen kernel")
    decode_attention_padded: bool = Field(
        False, description="decode attention reads every request's KV up to the batch's longest context")
    memory_bytes: float | None = None
    # Measured rates with 1..units units (CPU probe). When present they replace the linear /
    # saturating SRM curves: a CPU's cores share caches and clocks, so scaling is measured, not assumed.
    measured_flops: dict[str, list[float]] = Field(default_factory=dict)
    measured_bandwidth: list[float] = Field(default_factory=list)
    source: str = ""
    assumptions: tuple[str, ...] = ()
    # the link between this GPU and its peers in a multi-GPU server (tensor parallelism's collectives);
    # None: a device used alone (a CPU, or a profile written before links were described)
    interconnect: Interconnect | None = None

    @model_serializer(mode="wrap")
    def _without_absent_link(self, handler):
        # a device without a link dumps exactly as before links existed: profiles written and shipped
        # earlier stay byte-for-byte what a rewrite gives
        data = handler(self)
        if data.get("interconnect", 0) is None:
            del data["interconnect"]
        return data

    def model_post_init(self, _context) -> None:
        for name, table in [("measured_bandwidth", self.measured_bandwidth), *self.measured_flops.items()]:
            if table and len(table) != self.units:
                raise ValueError(f"{self.name}: {name} has {len(table)} entries for {self.units} units")

    @staticmethod
    def _dtype_keys(dtype: str) -> tuple[str, ...]:
        # half types fall back on each other, then on fp32
        return (dtype, "bf16" if dtype == "fp16" else "fp16", "fp32")

    def flops(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s for `dtype` with all units."""
        for key in self._dtype_keys(dtype):
            if key in self.peak_flops:
                return self.peak_flops[key]
        raise KeyError(f"{self.name}: no peak FLOP/s for {dtype!r} (have {sorted(self.peak_flops)})")

    def compute_rate(self, units: float, dtype: str = "bf16") -> float:
        """C_p = C_peak * N_p / N: compute scales linearly with the units given (or as measured)."""
        for key in self._dtype_keys(dtype):
            if key in self.measured_flops and float(units).is_integer() and 1 <= units <= self.units:
                return self.measured_flops[key][int(units) - 1]
        return self.flops(dtype) * units / self.units

    def bandwidth(self, units: float) -> float:
        """D_p = D_peak * min(1, N_p / N_d): bandwidth saturates at the inflection N_d (or as measured)."""
        if self.measured_bandwidth and float(units).is_integer() and 1 <= units <= self.units:
            return self.measured_bandwidth[int(units) - 1]
        return self.peak_bandwidth * min(1.0, units / self.bandwidth_inflection)

    def partition_sizes(self, role: str | None = None) -> list[int]:
        """Unit counts a partition backend can actually hand to one worker. Where the units do not
        divide into groups (an H200's 132 SMs in green-context groups of 8: 16 groups and 4 left), the
        remainder joins prefill's shares: prefill's sizes are the remainder plus whole groups, decode's
        whole groups, so a prefill share and the decode share beside it add up to the device instead of
        leaving the remainder idle (role None: whole groups, as one pool for both)."""
        start = max(self.min_partition, self.partition_step)
        start = math.ceil(start / self.partition_step) * self.partition_step
        sizes = list(range(start, self.units + 1, self.partition_step))
        remainder = self.units % self.partition_step
        if role == "prefill" and remainder:
            sizes = [s + remainder for s in sizes if s + remainder <= self.units]
        if not sizes or sizes[-1] != self.units:
            sizes.append(self.units)
        return sizes

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "HardwareSpec":
        return cls.model_validate(json.loads(Path(path).read_text()))

    @classmethod
    def builtin(cls, name: str) -> "HardwareSpec":
        key = name.lower()
        if key not in BUILTIN:
            raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(BUILTIN))}")
        return BUILTIN[key]


# Bandwidth per SM needed to saturate HBM. A100: 2.039 TB/s / 30 SMs (Bullet Fig. 8b) ~ 68 GB/s.
# Hopper: DuetServe measures ~60 % of H100 peak with ~20 % of SMs (26 of 132), i.e. ~77 GB/s per SM;
# we assume the same per-SM traffic on H200 and H20 (same SM design), which puts N_d at
# bandwidth / 77 GB/s. These three inflections are assumptions until measured on the devices.
_HOPPER_BYTES_PER_SM = 0.60 * 3.35e12 / (0.20 * 132)
_GPU_LAUNCH_S = 2e-6  # assumption: CUDA-graph replayed kernels cost ~2 us each beyond their work
_SPEC_SOURCE = "public spec sheets (dense, no sparsity); shared/reference/numbers.md"


def _gpu(name: str, sms: int, bf16_tflops: float, fp32_tflops: float, tb_s: float, mem_gb: float,
         n_d: float, assumptions: tuple[str, ...], link: str) -> HardwareSpec:
    return HardwareSpec(
        name=name, kind="gpu", units=sms, unit_name="SM",
        peak_flops={"bf16": bf16_tflops * 1e12, "fp16": bf16_tflops * 1e12, "fp32": fp32_tflops * 1e12},
        peak_bandwidth=round(tb_s * 1e12), bandwidth_inflection=n_d,
        partition_step=2, min_partition=2,  # masks act on TPCs of 2 SMs
        blocks_per_unit=1, wave_quantization=True, kernel_overhead_s=_GPU_LAUNCH_S,
        memory_bytes=mem_gb * 1e9, source=_SPEC_SOURCE, interconnect=Interconnect.builtin(link),
        assumptions=assumptions + (f"kernel overhead {_GPU_LAUNCH_S * 1e6:.0f} us per launch (not measured)",),
    )


def _hopper_inflection(tb_s: float, sms: int) -> float:
    return round(min(sms, tb_s * 1e12 / _HOPPER_BYTES_PER_SM), 1)


BUILTIN: dict[str, HardwareSpec] = {
    "a100": _gpu("A100-SXM4-80GB", 108, 312, 19.5, 2.039, 80, 30.0,
                 ("N_d = 30 SMs read off Bullet Fig. 8b",), "nvlink3"),
    "h100": _gpu("H100-SXM5-80GB", 132, 989, 67, 3.35, 80, _hopper_inflection(3.35, 132),
                 ("N_d assumed from DuetServe's ~60 % of peak bandwidth at ~20 % of SMs",), "nvlink4"),
    "h200": _gpu("H200-SXM-141GB", 132, 989, 67, 4.8, 141, _hopper_inflection(4.8, 132),
                 ("N_d assumed: H100's bandwidth per SM, scaled to 4.8 TB/s",), "nvlink4"),
    "h20": _gpu("H20", 78, 148, 44, 4.0, 96, _hopper_inflection(4.0, 78),
                ("N_d assumed: H100's bandwidth per SM, scaled to 4.0 TB/s",), "nvlink4"),
}
