"""`libsmctrl` backend: restrict a CUDA stream to a TPC range with a user-built `libsmctrl.so`.

libsmctrl (Bakita & Anderson, RTAS'23) is not on PyPI; users build it and point Bullet at it with
the `library=` option or `BULLET_LIBSMCTRL`. It writes the mask into CUDA's private stream struct
at a driver-version-specific offset, so it is known to work only on some drivers (CUDA <= 12.8,
compute capability 3.5–8.9; Hopper "untested" upstream). A newer driver is refused unless the
caller opts in (`allow_untested_driver=True`, or `BULLET_LIBSMCTRL_ALLOW_UNTESTED=1` for a server's workers), because a wrong offset corrupts the stream silently. `bullet doctor` launches an
%smid probe on a masked stream (and inside a CUDA graph replay) to check it on the real machine.

Units are SMs; one TPC holds `sms_per_tpc` (2 on Volta and later) so a share is rounded up to whole
TPCs. A new mask reaches kernels launched after `apply`; queued kernels keep the old one.

The 128-bit call
----------------
`libsmctrl_set_stream_mask_ext(void *stream, unsigned __int128 mask)` cannot be declared to ctypes
directly (no 128-bit integer type), so the mask is passed as 64-bit halves placed exactly where the
C calling convention puts an `unsigned __int128`:
* x86-64 System V: an __int128 argument is two INTEGER eightbytes passed in the next two free
  general-purpose registers, low half first. After `stream` in RDI: low in RSI, high in RDX — the
  same as declaring `(void *, uint64_t low, uint64_t high)`.
* AArch64 (AAPCS64): __int128 is 16-byte aligned, so it takes the next *even-numbered* register
  pair. After `stream` in X0, X1 is skipped and the mask travels in X2 (low) and X3 (high), i.e.
  `(void *, uint64_t ignored, uint64_t low, uint64_t high)`.
Other architectures are refused rather than guessed. The tests compile a fake libsmctrl with gcc
whose function really takes an `unsigned __int128` and check the halves arrive in order, and check
this table against the registers gcc (and aarch64-linux-gnu-gcc, when installed) uses for the call."""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Callable, Union

from bullet.partition import cuda_driver
from bullet.partition.base import Granularity, PartitionBackend, PartitionUnavailable, role_slice
from bullet.partition.tpc_mask import LOW64, disable_mask, format_mask, split_u128

LIBRARY_ENV = "BULLET_LIBSMCTRL"
ALLOW_UNTESTED_ENV = "BULLET_LIBSMCTRL_ALLOW_UNTESTED"  # "1": the opt-in for a server's workers
KNOWN_WORKING_MAX_DRIVER = 12080  # CUDA 12.8: the newest driver libsmctrl knows the offsets of

# argument slots for (stream, mask) after `stream`: each entry says what goes in that slot
_INT128_SLOTS = {
    "x86_64": ("low", "high"),
    "AMD64": ("low", "high"),
    "aarch64": ("pad", "low", "high"),
    "arm64": ("pad", "low", "high"),
}

StreamArg = Union[int, Callable[[], int]]


class LibSmCtrl:
    """ctypes binding to the four libsmctrl entry points Bullet uses."""

    def __init__(self, path: str):
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise PartitionUnavailable(f"libsmctrl: cannot load {path}: {e}") from e
        self.path = path
        lib = self._lib
        missing = [s for s in ("libsmctrl_get_tpc_info_cuda", "libsmctrl_set_stream_mask",
                               "libsmctrl_set_global_mask") if not hasattr(lib, s)]
        if missing:
            raise PartitionUnavailable(f"libsmctrl: {path} does not export {', '.join(missing)}")
        lib.libsmctrl_get_tpc_info_cuda.argtypes = [ctypes.POINTER(ctypes.c_uint32), ctypes.c_int]
        lib.libsmctrl_get_tpc_info_cuda.restype = ctypes.c_int
        lib.libsmctrl_set_stream_mask.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.libsmctrl_set_stream_mask.restype = None
        lib.libsmctrl_set_global_mask.argtypes = [ctypes.c_uint64]
        lib.libsmctrl_set_global_mask.restype = None
        self._int128_slots = _INT128_SLOTS.get(platform.machine())
        self.has_ext = hasattr(lib, "libsmctrl_set_stream_mask_ext") and self._int128_slots is not None
        if self.has_ext:
            lib.libsmctrl_set_stream_mask_ext.argtypes = [ctypes.c_void_p] + [ctypes.c_uint64] * len(
                self._int128_slots)
            lib.libsmctrl_set_stream_mask_ext.restype = None

    def ext_unavailable_reason(self) -> str:
        if self._int128_slots is None:
            return f"passing an unsigned __int128 through ctypes is not mapped for {platform.machine()}"
        return f"{self.path} does not export libsmctrl_set_stream_mask_ext (build a newer libsmctrl)"

    def num_tpcs(self, device: int) -> int:
        count = ctypes.c_uint32(0)
        rc = self._lib.libsmctrl_get_tpc_info_cuda(ctypes.byref(count), device)
        if rc != 0:
            raise PartitionUnavailable(
                f"libsmctrl: libsmctrl_get_tpc_info_cuda(device {device}) failed with code {rc}")
        return count.value

    def set_stream_mask(self, stream: int, mask: int) -> None:
        self._lib.libsmctrl_set_stream_mask(stream, mask & LOW64)

    def set_stream_mask_ext(self, stream: int, mask: int) -> None:
        low, high = split_u128(mask)
        halves = {"low": low, "high": high, "pad": 0}
        self._lib.libsmctrl_set_stream_mask_ext(stream, *(halves[s] for s in self._int128_slots))

    def set_global_mask(self, mask: int) -> None:
        self._lib.libsmctrl_set_global_mask(mask & LOW64)


class LibSmCtrlBackend(PartitionBackend):
    name = "libsmctrl"
    unit_kind = "SM"

    def __init__(self, role: str, stream: StreamArg | None = None, library: str | None = None,
                 device: int = 0, num_tpcs: int | None = None, sms_per_tpc: int = 2,
                 scope: str = "stream", allow_untested_driver: bool = False):
        """`stream`: the CUDA stream handle to mask, or a callable returning it at each apply — a
        stream the worker created for the purpose and launches every step on
        (`launch_stream.open_worker_partition` does both; a fresh worker's *current* stream is the
        default stream, which cannot carry a mask). `scope="global"` masks every
        stream of the process instead (64-bit call: devices with <= 64 TPCs only). `num_tpcs`
        overrides libsmctrl's own count."""
        if scope not in ("stream", "global"):
            raise ValueError(f"scope must be 'stream' or 'global', got {scope!r}")
        if scope == "stream" and not stream:
            raise PartitionUnavailable(
                "libsmctrl: a stream handle is required: a stream the worker created and runs its steps on"
                " (bullet.partition.launch_stream.open_worker_partition); the legacy default stream (0)"
                " cannot carry a mask")
        self._check_driver(allow_untested_driver or untested_driver_allowed())
        self._lib = LibSmCtrl(_library_path(library))
        self._num_tpcs = num_tpcs if num_tpcs is not None else self._lib.num_tpcs(device)
        if not 0 < self._num_tpcs <= 128:
            raise PartitionUnavailable(f"libsmctrl: {self._num_tpcs} TPCs is outside 1..128")
        if self._num_tpcs > 64 and scope == "global":
            raise PartitionUnavailable(
                f"libsmctrl: the global mask is 64-bit and this device has {self._num_tpcs} TPCs;"
                " use scope='stream' (128-bit call)")
        if self._num_tpcs > 64 and not self._lib.has_ext:
            raise PartitionUnavailable(
                f"libsmctrl: {self._num_tpcs} TPCs need the 128-bit mask call, but "
                + self._lib.ext_unavailable_reason())
        super().__init__(role, self._num_tpcs * sms_per_tpc, Granularity(sms_per_tpc, sms_per_tpc))
        self._sms_per_tpc = sms_per_tpc
        self._scope = scope
        self._stream = stream
        self._mask: int | None = None  # None: never applied, the stream uses every TPC

    @staticmethod
    def _check_driver(allow_untested: bool) -> None:
        version = cuda_driver.cuda_driver_version()
        if version is not None and version > KNOWN_WORKING_MAX_DRIVER and not allow_untested:
            raise PartitionUnavailable(
                f"libsmctrl: CUDA driver {cuda_driver.format_cuda_version(version)} is newer than the"
                f" newest known to work ({cuda_driver.format_cuda_version(KNOWN_WORKING_MAX_DRIVER)});"
                " pass allow_untested_driver=True only after `bullet doctor` passed on this machine")

    def stream_handle(self) -> int | None:
        if self._scope == "global":
            return None
        return int(self._stream() if callable(self._stream) else self._stream)

    def launch_stream(self) -> int | None:
        return self.stream_handle()

    def mask(self) -> int | None:
        """The disable-mask last applied (128-bit form), None before the first apply."""
        return self._mask

    def _apply(self, units: int) -> None:
        tpcs = role_slice(self._num_tpcs, units // self._sms_per_tpc, self.role)
        mask = disable_mask(tpcs)
        if self._scope == "global":
            self._lib.set_global_mask(mask)
        elif self._num_tpcs <= 64:
            self._lib.set_stream_mask(self.stream_handle(), mask)
        else:
            self._lib.set_stream_mask_ext(self.stream_handle(), mask)
        self._mask = mask

    def _details(self) -> dict:
        return {
            "library": self._lib.path,
            "scope": self._scope,
            "num_tpcs": self._num_tpcs,
            "sms_per_tpc": self._sms_per_tpc,
            "mask": None if self._mask is None else format_mask(self._mask, self._num_tpcs),
            "call": "global" if self._scope == "global" else
                    ("stream_mask" if self._num_tpcs <= 64 else "stream_mask_ext (128-bit)"),
        }


def untested_driver_allowed() -> bool:
    """Whether the environment opts in to a driver past libsmctrl's known range (after `bullet
    doctor --libsmctrl PATH --allow-untested-driver` passed on this machine)."""
    return os.environ.get(ALLOW_UNTESTED_ENV) == "1"


def _library_path(library: str | None) -> str:
    path = library or os.environ.get(LIBRARY_ENV)
    if not path:
        raise PartitionUnavailable(
            f"libsmctrl: no library given — pass library=PATH or set {LIBRARY_ENV}=/path/to/libsmctrl.so"
            " (libsmctrl is not on PyPI: build it from its source with `make libsmctrl.so`)")
    if not os.path.exists(path):
        source = "library option" if library else LIBRARY_ENV
        raise PartitionUnavailable(f"libsmctrl: {path} (from {source}) does not exist")
    return path
