"""Build and bind `csrc/sm_probe.cu`, the isolation probe's kernels (spin, FMA, copy, graph replay).

Compiled with nvcc for the device's own architecture on first use and cached under
`$BULLET_CACHE_DIR/gpu` keyed by the source's hash (nvcc links the CUDA runtime statically, so the
library needs only the driver at run time). Building needs no GPU — the tests compile it on a CPU
machine; launching needs a device and caller-owned device buffers (torch tensors' pointers)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from bullet.doctor.smid_probe import build_cuda_library

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "sm_probe.cu"
ABI_VERSION = 2
FMA_CHAINS = 8  # independent FMA chains per thread in the kernel (flop count)


class KernelsUnavailable(RuntimeError):
    pass


def build(arch: str, out_dir: Path | None = None, nvcc: str | None = None) -> Path:
    """Compile for `arch` (e.g. "90" for sm_90) once per source hash; the library's path."""
    return build_cuda_library(SOURCE, "libbullet_sm_probe", arch, KernelsUnavailable, out_dir, nvcc)


class Kernels:
    """ctypes binding; every call raises KernelsUnavailable on a CUDA error. The calls that block
    (sync) release the GIL, so two threads can each drive their own stream."""

    def __init__(self, path: str | os.PathLike, device: int = 0):
        self.path = str(path)
        lib = self._lib = ctypes.CDLL(self.path)
        if lib.sm_probe_abi_version() != ABI_VERSION:
            raise KernelsUnavailable(f"{path}: probe ABI mismatch (rebuild it)")
        vp, u, ull, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_int
        for name, args in {"sm_probe_init": [i, ctypes.POINTER(i)], "sm_probe_spin": [vp, u, ull, vp, vp],
                           "sm_probe_fma": [vp, u, u, i, vp], "sm_probe_copy": [vp, u, vp, vp, ctypes.c_size_t],
                           "sm_probe_sync": [vp],
                           "sm_probe_graph_capture": [vp, u, ull, vp, vp, i, ctypes.POINTER(vp)],
                           "sm_probe_graph_launch": [vp, vp], "sm_probe_graph_destroy": [vp]}.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, i
        shared = ctypes.c_int(0)
        self._check(lib.sm_probe_init(device, ctypes.byref(shared)), "init")
        self.spin_shared_bytes = shared.value

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise KernelsUnavailable(f"sm_probe {what} failed with cudaError {rc}")

    def spin(self, stream: int, blocks: int, spin_ns: int, smids: int | None = None,
             starts: int | None = None) -> None:
        self._check(self._lib.sm_probe_spin(stream, blocks, spin_ns, smids, starts), "spin")

    def fma(self, stream: int, blocks: int, threads: int, iters: int, sink: int) -> None:
        self._check(self._lib.sm_probe_fma(stream, blocks, threads, iters, sink), "fma")

    def copy(self, stream: int, blocks: int, src: int, dst: int, nbytes: int) -> None:
        self._check(self._lib.sm_probe_copy(stream, blocks, src, dst, nbytes), "copy")

    def sync(self, stream: int) -> None:
        self._check(self._lib.sm_probe_sync(stream), "sync")

    def graph_capture(self, stream: int, blocks: int, spin_ns: int, smids: int | None, starts: int | None,
                      launches: int) -> int:
        exec_ = ctypes.c_void_p(0)
        self._check(self._lib.sm_probe_graph_capture(stream, blocks, spin_ns, smids, starts, launches,
                                                     ctypes.byref(exec_)), "graph capture")
        return int(exec_.value)

    def graph_launch(self, exec_: int, stream: int) -> None:
        self._check(self._lib.sm_probe_graph_launch(exec_, stream), "graph launch")

    def graph_destroy(self, exec_: int) -> None:
        self._check(self._lib.sm_probe_graph_destroy(exec_), "graph destroy")


def load_for_current_device() -> Kernels:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return Kernels(build(f"{major}{minor}"), torch.cuda.current_device())
