"""`--dtype auto` picks by measurement on a CPU, and `auto` quantization yields to an explicit dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from engines import device


def test_auto_dtype_follows_the_measured_bf16_speedup(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: 2.5)
    assert device.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: 0.3)
    assert device.resolve_dtype("auto", cpu) == torch.float32
    assert device.resolve_dtype("bfloat16", cpu) == torch.bfloat16  # an explicit dtype is never second-guessed


def test_bf16_measurement_is_cached_per_cpu_and_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path))
    device.cpu_bf16_speedup.cache_clear()
    calls = []
    monkeypatch.setattr(device, "measure_bf16_speedup", lambda: calls.append(1) or 0.5)
    try:
        assert device.cpu_bf16_speedup() == 0.5
        device.cpu_bf16_speedup.cache_clear()
        assert device.cpu_bf16_speedup() == 0.5 and len(calls) == 1  # the second process reads the file
        (cached,) = (tmp_path / "dtype").glob("*.json")
        assert json.loads(cached.read_text())["torch"] == torch.__version__
    finally:
        device.cpu_bf16_speedup.cache_clear()


def test_real_measurement_returns_a_positive_ratio():
    assert device.measure_bf16_speedup(rounds=1) > 0


def test_auto_quantization_yields_to_an_explicit_dtype():
    assert device.quantization_for("auto", "auto") == "auto"
    assert device.quantization_for(None, None) == "auto"
    assert device.quantization_for("auto", "float32") == "none"
    assert device.quantization_for("w8a8_int8", "float32") == "w8a8_int8"


def test_isa_caps_name_a_different_cpu_so_no_cache_is_shared(tmp_path, monkeypatch):
    from estimator.profiler.cache import default_profile_path

    for key in device.AVX2_ONLY_ENV:
        monkeypatch.delenv(key, raising=False)
    plain, plain_profile = device.cpu_identity(), default_profile_path("m", "fp32", 2)
    for key, value in device.AVX2_ONLY_ENV.items():
        monkeypatch.setenv(key, value)
    device.cpu_has_native_bf16.cache_clear()
    try:
        assert device.cpu_identity().startswith(plain) and "ATEN_CPU_CAPABILITY=avx2" in device.cpu_identity()
        assert default_profile_path("m", "fp32", 2) != plain_profile
        assert not device.cpu_has_native_bf16()  # torch emulates bf16 below AVX-512 whatever the CPU can do
    finally:
        device.cpu_has_native_bf16.cache_clear()


def test_the_avx2_caps_reach_torchs_dispatch():
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **device.AVX2_ONLY_ENV},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out in ("AVX2", "DEFAULT")  # DEFAULT on a CPU without AVX2 at all
