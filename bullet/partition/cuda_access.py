"""Everything a server asks CUDA about its device, behind one small interface: how many devices are
visible, how many SMs and what name the serving device has, its streams, its graphs, the
green-context driver, and where tensors for it live.

The launcher and every worker reach CUDA only through a `CudaAccess`: `TorchCuda` (torch.cuda and
the C helper) in a server; in the tests a fake that answers for a GPU the machine does not have
and records the device each call was given, while tensors stay in host memory. The tests then run
the launcher's and the workers' real wiring with the device as a user passes it (`"cuda"`,
`"cuda:0"`, `torch.device("cuda", 0)`) and check that every backend was handed device index 0 —
the bug this guards against is a device that arrived as a string and was read as one.

Every method takes the serving device as a `torch.device` with an index (`engines.device.
resolve_device` makes it; `require_device` checks it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from engines.device import require_device

if TYPE_CHECKING:
    from bullet.partition.gpu_helper import GpuPartitionHelper
    from bullet.partition.launch_stream import StreamApi
    from engines.cuda_graphs import GraphApi


class CudaAccess(Protocol):
    def device_count(self) -> int:
        """CUDA devices visible to this process (0 on a machine without one)."""

    def make_current(self, device: torch.device) -> None:
        """Make `device` this process's current CUDA device: what code that says only "cuda" (the
        graph memory pool, the profiler's buffers) then uses."""

    def sm_count(self, device: torch.device) -> int: ...

    def device_name(self, device: torch.device) -> str: ...

    def streams(self, device: torch.device) -> "StreamApi":
        """The stream operations a worker's steps use, on `device`."""

    def graphs(self) -> "GraphApi":
        """Captures decode steps as CUDA graphs on the current stream."""

    def green_ctx_driver(self) -> "GpuPartitionHelper":
        """The driver calls the green-ctx backend makes (the C helper)."""

    def tensor_device(self, device: torch.device) -> torch.device:
        """Where a model served on `device` keeps its tensors."""


class TorchCuda:
    """`CudaAccess` over torch.cuda: what a server on an NVIDIA GPU uses."""

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def make_current(self, device: torch.device) -> None:
        torch.cuda.set_device(require_device(device))

    def sm_count(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(require_device(device)).multi_processor_count

    def device_name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(require_device(device))

    def streams(self, device: torch.device) -> "StreamApi":
        from bullet.partition.launch_stream import TorchCudaStreams  # deferred: launch_stream imports this module

        return TorchCudaStreams(require_device(device))

    def graphs(self) -> "GraphApi":
        from engines.cuda_graphs import TorchCudaGraphs  # deferred: only a decode worker that graphs needs it

        return TorchCudaGraphs()

    def green_ctx_driver(self) -> "GpuPartitionHelper":
        from bullet.partition.gpu_helper import load_helper  # deferred: compiles the helper on first use

        return load_helper()

    def tensor_device(self, device: torch.device) -> torch.device:
        return require_device(device)


def cuda_access(cuda: CudaAccess | None) -> CudaAccess:
    """`cuda`, or torch.cuda's."""
    return cuda if cuda is not None else TorchCuda()


def tensor_device(device: torch.device, cuda: CudaAccess | None = None) -> torch.device:
    """Where tensors of a model served on `device` live: the device itself, except under a fake CUDA."""
    device = require_device(device)
    return cuda_access(cuda).tensor_device(device) if device.type == "cuda" else device
