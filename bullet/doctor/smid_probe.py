"""Build and launch `csrc/gpu_smid_probe.cu`: the SM ids a kernel on a given stream really ran on.

Built with nvcc on first use for the device's own architecture and cached beside the partition
helper (`$BULLET_CACHE_DIR/gpu`). Launching needs a CUDA device and torch's CUDA build (the
result buffer is a torch tensor); building does not, so the tests compile it here."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from bullet.partition.gpu_helper import SOURCE_DIR, cache_dir

SOURCE = SOURCE_DIR / "gpu_smid_probe.cu"
ABI_VERSION = 1
SPIN_CYCLES = 40_000  # ~20-30 µs per block: long enough that blocks spread over every allowed SM
BLOCKS_PER_SM = 8


class ProbeUnavailable(RuntimeError):
    pass


def find_nvcc() -> str | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(Path(root) / "bin" / "nvcc", os.X_OK):
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_cuda_library(source: Path, stem: str, arch: str, unavailable: type[Exception],
                       out_dir: Path | None = None, nvcc: str | None = None) -> Path:
    """Compile the CUDA source `source` for `arch` (e.g. "80" for sm_80) into a shared library, once per
    source, arch and compiler (cached under `out_dir`, by default $BULLET_CACHE_DIR/gpu); its path.
    Whatever is missing or fails raises `unavailable` with the reason."""
    if not source.is_file():
        raise unavailable(f"probe source {source} not found (use a source checkout of Bullet)")
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise unavailable("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    key = hashlib.sha256(source.read_bytes() + arch.encode() + nvcc.encode()).hexdigest()[:16]
    out_dir = Path(out_dir) if out_dir is not None else cache_dir()
    out = out_dir / f"{stem}-sm{arch}-{key}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-O2", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
           str(source), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise unavailable(f"nvcc failed: {' '.join(cmd)}\n{done.stderr}")
    os.replace(tmp, out)
    return out


def build_probe(arch: str, out_dir: Path | None = None, nvcc: str | None = None) -> Path:
    """Compile the probe for `arch` (e.g. "80" for sm_80) and return the shared library's path."""
    return build_cuda_library(SOURCE, "libbullet_smid_probe", arch, ProbeUnavailable, out_dir, nvcc)


class SmidProbe:
    def __init__(self, path: str | os.PathLike):
        self._lib = ctypes.CDLL(str(path))
        if self._lib.gpu_smid_probe_abi_version() != ABI_VERSION:
            raise ProbeUnavailable(f"{path}: probe ABI mismatch (rebuild it)")
        self._lib.gpu_smid_probe_launch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_longlong,
                                                    ctypes.c_void_p]
        self._lib.gpu_smid_probe_launch.restype = ctypes.c_int

    def launch(self, stream: int, buffer) -> None:
        """Enqueue the probe on `stream` writing into `buffer` (a CUDA int32 tensor, one slot per
        block). Works inside CUDA graph capture: nothing here synchronizes."""
        rc = self._lib.gpu_smid_probe_launch(stream, buffer.numel(), SPIN_CYCLES, buffer.data_ptr())
        if rc != 0:
            raise ProbeUnavailable(f"probe launch failed with cudaError {rc}")

    @staticmethod
    def buffer(total_sms: int):
        import torch

        buf = torch.full((BLOCKS_PER_SM * total_sms,), -1, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()  # the fill ran on torch's stream; the probe runs on another one
        return buf

    @staticmethod
    def observed(buffer) -> set[int]:
        import torch

        torch.cuda.synchronize()
        return {int(s) for s in buffer.cpu().tolist() if s >= 0}

    def run(self, stream: int, total_sms: int) -> set[int]:
        buf = self.buffer(total_sms)
        self.launch(stream, buf)
        return self.observed(buf)


def load_probe_for_current_device() -> SmidProbe:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return SmidProbe(build_probe(f"{major}{minor}"))
