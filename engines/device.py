"""Device and dtype choices.

`auto` picks bf16 on CUDA. On a CPU it measures: a bf16 and an fp32 GEMM of a transformer layer's
shape, back to back, and bf16 wins only when it is clearly faster (>= 1.3x). CPUs that compute
bf16 natively (AVX512-BF16, AMX, Arm BF16) run it ~2-4x faster than fp32; on AVX2 torch emulates
it and it is ~3x *slower* — and a flag in /proc/cpuinfo does not say how a given torch build
dispatches (oneDNN may lack a kernel the CPU could run). The answer is cached per CPU model and
torch version under ~/.cache/bullet, so a server measures once (~0.1 s).

The kernels a process runs can be capped below what the CPU offers with each library's own variable
(`AVX2_ONLY_ENV`: aten, fbgemm, oneDNN, MKL); `cpu_identity` names the CPU with such caps, so a
capped process never reuses a cache measured without them (and the reverse)."""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path

import torch

from engines.cache_root import cache_dir

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
BF16_MIN_SPEEDUP = 1.3
# Every CPU kernel library torch's x86 build dispatches by CPU flags, capped at AVX2 (+FMA): how the
# artifact runs the kernels of an AVX2-only machine on one with AVX-512 (`bench_llamacpp.py --isa avx2`).
AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                 "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


# The implementations of the project's own CPU kernels (csrc/cpu_vec.h: portable C, AVX2, AVX-512)
ISA_GENERIC, ISA_AVX2, ISA_AVX512 = 0, 1, 2


def own_kernel_isa_ceiling() -> int:
    """The widest implementation of the project's CPU kernels this process may run: its kernel cap
    (`ATEN_CPU_CAPABILITY`, as `AVX2_ONLY_ENV` sets it) applies to them as to torch's."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return {"default": ISA_GENERIC, "avx": ISA_GENERIC, "avx2": ISA_AVX2}.get(cap, ISA_AVX512)


def own_kernel_isa(ext) -> int:
    """The widest implementation of one of the project's CPU-kernel extensions (None: not built) that
    this build and this CPU run, under the process's kernel cap."""
    return ISA_GENERIC if ext is None else min(ext.best_isa(), own_kernel_isa_ceiling())


def isa_caps() -> str:
    """The kernel-ISA caps set in this process's environment ("" when none), e.g. "ATEN_CPU_CAPABILITY=avx2"."""
    return ",".join(f"{k}={os.environ[k]}" for k in sorted(AVX2_ONLY_ENV) if os.environ.get(k))


def cpu_identity() -> str:
    """The CPU model as the kernels see it: its name, plus the ISA caps in force."""
    caps = isa_caps()
    return f"{_cpu_model()} [{caps}]" if caps else _cpu_model()


def _isa_capped() -> bool:
    """torch told to stay below AVX-512 (ATEN_CPU_CAPABILITY): bf16 then runs emulated whatever the CPU can do."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "avx", "default")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    return not _isa_capped() and any(flag in _cpuinfo() for flag in ("avx512_bf16", "amx_bf16", " bf16"))


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """Whether oneDNN may run bfloat16 GEMMs on AMX tiles here (the CPU has them, the ISA not capped below
    AVX-512): some bfloat16 forms were measured faster only there."""
    return not _isa_capped() and "amx_bf16" in _cpuinfo()


def resolve_device(name: str | torch.device | None, cuda_devices: int | None = None) -> torch.device:
    """The device to run on, normalised once: `auto` is the first CUDA device if one is visible,
    else the CPU; `cuda` is `cuda:0`. A CUDA device always carries its index, because what a server
    does with it — count its SMs, build a partition on it, key graph records by its name — needs
    one, and `torch.device("cuda").index` is None. `cuda_devices` replaces torch's count of visible
    CUDA devices (tests). Raises ValueError naming `--device` when the device cannot be used."""
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name is None or name == "auto":
        return torch.device("cuda", 0) if cuda_devices else torch.device("cpu")
    try:
        dev = name if isinstance(name, torch.device) else torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"--device {name}: not a device name (cpu, cuda, cuda:<index> or auto)") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"--device {dev}: Bullet serves on cpu or cuda")
    index = 0 if dev.index is None else dev.index
    if not cuda_devices:
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise ValueError(f"--device {dev}: no CUDA device is visible ({build}); run on a machine with an NVIDIA GPU "
                         "and a CUDA build of torch, or pass --device cpu")
    if index >= cuda_devices:
        raise ValueError(f"--device {dev}: only {cuda_devices} CUDA device(s) are visible "
                         f"(indices 0..{cuda_devices - 1})")
    return torch.device("cuda", index)


def require_device(device) -> torch.device:
    """What every consumer of the serving device checks it was handed: a torch.device from
    `resolve_device`, so never a string (whose `.index` is the str method) nor a CUDA device
    without an index."""
    if not isinstance(device, torch.device):
        raise TypeError(f"expected a torch.device from engines.device.resolve_device, got {type(device).__name__} "
                        f"{device!r}")
    if device.type == "cuda" and device.index is None:
        raise TypeError(f"{device!r} has no index: resolve it with engines.device.resolve_device")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        if device.type == "cuda" or cpu_bf16_speedup() >= BF16_MIN_SPEEDUP:
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(sorted(set(DTYPES)))}")
    return DTYPES[name]


def resolve_kv_dtype(name: str | None, compute_dtype: torch.dtype) -> torch.dtype:
    """What the KV pool stores (SGLang's `--kv-cache-dtype`): `auto` = the model's compute dtype, or a
    float dtype by name. Attention reads it in the compute dtype (the int8 model's CPU kernel widens a
    float16 pool in registers: half the bytes a decode step reads)."""
    if name in (None, "auto"):
        return compute_dtype
    if name not in DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose auto, {', '.join(sorted(set(DTYPES)))} "
                         "(fp8 KV caches are not supported)")
    return DTYPES[name]


def quantization_for(quantization: str | None, dtype_name: str | None) -> str:
    """`auto` quantization applies only with `auto` dtype: an explicit `--dtype float32` asks for the
    dequantized weights (the reference path the tests compare with `transformers`)."""
    quantization = quantization or "auto"
    if quantization == "auto" and dtype_name not in (None, "auto"):
        return "none"
    return quantization


@functools.lru_cache(maxsize=1)
def cpu_bf16_speedup() -> float:
    """fp32 time / bf16 time of the same GEMM on this CPU with this torch (cached on disk)."""
    path = _cache_path()
    try:
        return float(json.loads(path.read_text())["bf16_speedup"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    speedup = measure_bf16_speedup()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bf16_speedup": speedup, "cpu": cpu_identity(), "torch": torch.__version__}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return speedup


def measure_bf16_speedup(rounds: int = 3) -> float:
    """Interleaved rounds (a load elsewhere on the machine slows both alike); best of each."""
    a, w = torch.randn(256, 576), torch.randn(1536, 576)
    ab, wb = a.bfloat16(), w.bfloat16()
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    for _ in range(rounds):
        for dtype, (x, y) in ((torch.float32, (a, w)), (torch.bfloat16, (ab, wb))):
            torch.nn.functional.linear(x, y)  # warm-up: first calls pick and cache kernels
            t = time.perf_counter()
            for _ in range(4):
                torch.nn.functional.linear(x, y)
            best[dtype] = min(best[dtype], time.perf_counter() - t)
    return best[torch.float32] / best[torch.bfloat16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path() -> Path:
    key = "".join(c if c.isalnum() else "-" for c in f"{cpu_identity()}-{torch.__version__}")
    return cache_dir() / "dtype" / f"{key}.json"
