"""The installed CUDA driver's version, read straight from `libcuda.so.1` with ctypes.

`cuDriverGetVersion` needs no `cuInit` and no device, so this is safe to call anywhere: on a
machine without the driver it returns None instead of raising."""

from __future__ import annotations

import ctypes

LIBCUDA = "libcuda.so.1"


def cuda_driver_version() -> int | None:
    """Driver API version as CUDA encodes it (1000 * major + 10 * minor, e.g. 12080), or None."""
    try:
        lib = ctypes.CDLL(LIBCUDA)
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def format_cuda_version(version: int | None) -> str:
    if version is None:
        return "no CUDA driver"
    return f"{version // 1000}.{(version % 1000) // 10}"
