"""SM and memory clocks, power and clock-limit ("throttle") reasons, sampled through NVML every
~10 ms while a probe phase runs, summarised per phase — so a rate that fell can be told apart:
fewer SMs (the spin probe) from lower clocks under a power cap (these samples).

NVML comes from `pynvml` (the `nvidia-ml-py` wheel). Without it, or without a driver, every phase
is recorded with `{"missing": why}` and nothing raises: the probe's rates do not depend on it. NVML
opens no CUDA context, so the sampling process stays out of the GPU's way (and out of MPS)."""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager
from typing import Iterator

PERIOD_S = 0.01

# NVML's clock event reason bits (nvml.h, nvmlClocksEventReason*): the names reports use
REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def reason_names(mask: int) -> list[str]:
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise(samples: list[dict]) -> dict:
    """One phase's samples (dicts of sm_mhz, mem_mhz, power_w, reasons) as min/median/max, and the
    share of samples each clock-limit reason was active in."""
    if not samples:
        return {"samples": 0}
    out: dict = {"samples": len(samples)}
    for key in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
        out[key] = _stats([s[key] for s in samples if s.get(key) is not None])
    counts: dict[str, int] = {}
    for s in samples:
        for name in reason_names(s.get("reasons") or 0):
            counts[name] = counts.get(name, 0) + 1
    out["reasons"] = {name: round(n / len(samples), 3) for name, n in sorted(counts.items())}
    return out


class NvmlSampler:
    """`with sampler.phase("spin/alone-A"): ...` samples during the block; `phases` holds the
    summaries. `nvml`: the pynvml module (default: imported here; a stand-in in tests)."""

    def __init__(self, device: int = 0, period_s: float = PERIOD_S, nvml=None):
        self.period_s = period_s
        self.phases: dict[str, dict] = {}  # label -> summary of every sample taken under it so far
        self._raw: dict[str, list[dict]] = {}
        self.missing: str | None = None
        self._nvml = nvml
        self._handle = None
        try:
            if self._nvml is None:
                import pynvml as nvml_module

                self._nvml = nvml_module
            self._nvml.nvmlInit()
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device)
        except Exception as e:  # ImportError, NVMLError (no driver, no device): recorded, never raised
            self.missing = f"NVML unavailable: {type(e).__name__}: {e}"
            self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def sample(self) -> dict:
        n, h = self._nvml, self._handle
        out: dict = {"t": time.monotonic()}
        for key, call in (("sm_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                          ("mem_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
                          ("power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
                          ("temp_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                          ("reasons", self._reasons)):
            try:
                out[key] = call()
            except Exception:  # one unsupported query leaves its field empty
                out[key] = None
        return out

    def _reasons(self) -> int:
        n = self._nvml
        get = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(n, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return int(get(self._handle))

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        if not self.available:
            self.phases[label] = {"missing": self.missing}
            yield
            return
        samples = self._raw.setdefault(label, [])  # a label used again (another round) adds to its samples
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                samples.append(self.sample())
                stop.wait(self.period_s)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.phases[label] = summarise(samples)

    def close(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._handle = None
