"""Build and bind `csrc/gpu_partition.c`, the C helper that drives green contexts.

The helper is compiled on first use with the system C compiler against the CUDA toolkit's `cuda.h`
(types only: it dlopen()s the driver at run time and never links -lcuda), cached under
`$BULLET_CACHE_DIR/gpu` (default `~/.cache/bullet/gpu`) keyed by the hash of its sources, so it
builds on machines without a GPU and rebuilds only when the sources change. A prebuilt helper can be
named with `BULLET_GPU_PARTITION_LIB`. Every failure surfaces as `PartitionUnavailable` whose
message says what is missing (source, cuda.h, compiler, driver, or a driver entry point)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bullet.partition.base import PartitionUnavailable

HELPER_ENV = "BULLET_GPU_PARTITION_LIB"
SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("gpu_partition.c", "gpu_partition.h")
ABI_VERSION = 1


def cuda_include_candidates() -> list[Path]:
    """Where cuda.h may live: CUDA_HOME/CUDA_PATH, the default toolkit, and the nvidia wheels."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    dirs = [Path(r) / "include" for r in roots if r]
    for site in sys.path:
        for sub in ("nvidia/cuda_runtime/include", "nvidia/cu13/include", "nvidia/cu12/include"):
            dirs.append(Path(site) / sub)
    return dirs


def find_cuda_include() -> Path | None:
    return next((d for d in cuda_include_candidates() if (d / "cuda.h").is_file()), None)


def cache_dir() -> Path:
    base = os.environ.get("BULLET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "bullet")
    return Path(base) / "gpu"


def build_helper(out_dir: Path | None = None, include_dir: Path | None = None,
                 compiler: str | None = None) -> Path:
    """Compile the helper (once per source hash) and return the shared library's path."""
    sources = [SOURCE_DIR / name for name in SOURCES]
    if not all(p.is_file() for p in sources):
        raise PartitionUnavailable(
            f"GPU helper sources not found in {SOURCE_DIR} (use a source checkout of Bullet, or set"
            f" {HELPER_ENV} to a built helper)")
    include_dir = include_dir or find_cuda_include()
    if include_dir is None:
        looked = ", ".join(str(d) for d in cuda_include_candidates()[:3])
        raise PartitionUnavailable(
            f"cuda.h not found (looked in {looked} and the nvidia-* wheels): install the CUDA toolkit"
            " or `pip install nvidia-cuda-runtime-cu12`, or set CUDA_HOME")
    compiler = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise PartitionUnavailable("no C compiler (gcc/cc, or $CC) to build the GPU helper")
    digest = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sources), (include_dir / "cuda.h").read_bytes(),
                 compiler.encode()]:
        digest.update(part)
    out_dir = Path(out_dir) if out_dir is not None else cache_dir()
    out = out_dir / f"libbullet_gpu_partition-{digest.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-Wall", "-shared", "-fPIC", "-pthread", f"-I{include_dir}",
           f"-I{SOURCE_DIR}", str(sources[0]), "-ldl", "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PartitionUnavailable(f"building the GPU helper failed: {' '.join(cmd)}\n{done.stderr}")
    os.replace(tmp, out)  # atomic: concurrent builders never load a half-written file
    return out


class DriverCallFailed(PartitionUnavailable):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


NO_DRIVER = -1


@dataclass(frozen=True)
class SmResource:
    sm_count: int
    min_partition_size: int
    coscheduled_alignment: int


@dataclass
class SmSplit:
    handle: int            # opaque gpu_sm_split* owned by the helper
    group_sms: list[int]   # SMs in each group, in the driver's order
    remainder_sms: int     # SMs left over (usable only together with the groups of this split)


class GpuPartitionHelper:
    """ctypes view of gpu_partition.h. Also the `driver` the green-context pool talks to."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        lib = self._lib = ctypes.CDLL(self.path)
        u32p, i32p, u64p = (ctypes.POINTER(t) for t in (ctypes.c_uint, ctypes.c_int, ctypes.c_uint64))
        sigs = {
            "gpu_partition_abi_version": ([], ctypes.c_int),
            "gpu_partition_last_error": ([], ctypes.c_char_p),
            "gpu_partition_load": ([], ctypes.c_int),
            "gpu_partition_driver_version": ([i32p], ctypes.c_int),
            "gpu_partition_device_info": ([ctypes.c_int, i32p, i32p, i32p], ctypes.c_int),
            "gpu_partition_green_ctx_supported": ([], ctypes.c_int),
            "gpu_partition_sm_resource": ([ctypes.c_int, u32p, u32p, u32p], ctypes.c_int),
            "gpu_partition_split": ([ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                     ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int),
            "gpu_partition_split_groups": ([ctypes.c_void_p], ctypes.c_uint),
            "gpu_partition_split_group_sms": ([ctypes.c_void_p, ctypes.c_uint], ctypes.c_uint),
            "gpu_partition_split_remainder_sms": ([ctypes.c_void_p], ctypes.c_uint),
            "gpu_partition_split_free": ([ctypes.c_void_p], None),
            "gpu_partition_create_stream": ([ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                                             u64p, u64p], ctypes.c_int),
            "gpu_partition_destroy_stream": ([ctypes.c_uint64, ctypes.c_uint64], ctypes.c_int),
        }
        for name, (args, res) in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        if lib.gpu_partition_abi_version() != ABI_VERSION:
            raise PartitionUnavailable(f"{self.path}: helper ABI {lib.gpu_partition_abi_version()},"
                                       f" expected {ABI_VERSION} (rebuild it)")

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise DriverCallFailed(rc, self._lib.gpu_partition_last_error().decode(errors="replace"))

    def load(self) -> None:
        self._check(self._lib.gpu_partition_load())

    def driver_version(self) -> int:
        v = ctypes.c_int(0)
        self._check(self._lib.gpu_partition_driver_version(ctypes.byref(v)))
        return v.value

    def device_info(self, device: int) -> tuple[int, tuple[int, int]]:
        """(SM count, (cc major, cc minor))."""
        sms, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.gpu_partition_device_info(device, ctypes.byref(sms), ctypes.byref(major),
                                                        ctypes.byref(minor)))
        return sms.value, (major.value, minor.value)

    def green_ctx_supported(self) -> None:
        self._check(self._lib.gpu_partition_green_ctx_supported())

    def sm_resource(self, device: int) -> SmResource:
        count, minimum, align = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        self._check(self._lib.gpu_partition_sm_resource(device, ctypes.byref(count), ctypes.byref(minimum),
                                                        ctypes.byref(align)))
        return SmResource(count.value, minimum.value, align.value)

    def split(self, device: int, group_sms: int, flags: int = 0) -> SmSplit:
        handle = ctypes.c_void_p()
        self._check(self._lib.gpu_partition_split(device, group_sms, flags, ctypes.byref(handle)))
        n = self._lib.gpu_partition_split_groups(handle)
        groups = [self._lib.gpu_partition_split_group_sms(handle, i) for i in range(n)]
        return SmSplit(handle.value, groups, self._lib.gpu_partition_split_remainder_sms(handle))

    def create_stream(self, split: SmSplit, first: int, count: int, with_remainder: bool) -> tuple[int, int]:
        """(green context handle, stream handle) over groups [first, first + count)."""
        ctx, stream = ctypes.c_uint64(), ctypes.c_uint64()
        self._check(self._lib.gpu_partition_create_stream(split.handle, first, count, int(with_remainder),
                                                          ctypes.byref(ctx), ctypes.byref(stream)))
        return ctx.value, stream.value

    def destroy_stream(self, green_ctx: int, stream: int) -> None:
        self._check(self._lib.gpu_partition_destroy_stream(green_ctx, stream))

    def free_split(self, split: SmSplit) -> None:
        if split.handle:
            self._lib.gpu_partition_split_free(split.handle)
            split.handle = 0


_loaded: GpuPartitionHelper | None = None


def load_helper() -> GpuPartitionHelper:
    """The process-wide helper (prebuilt from $BULLET_GPU_PARTITION_LIB, else built on demand)."""
    global _loaded
    if _loaded is None:
        path = os.environ.get(HELPER_ENV) or build_helper()
        _loaded = GpuPartitionHelper(path)
    return _loaded
