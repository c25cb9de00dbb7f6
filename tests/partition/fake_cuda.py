"""A GPU this machine does not have, as the launcher and the workers see it through `CudaAccess`:
a fixed SM count and name, a recording `StreamApi`, the green-context driver of
`test_green_ctx.FakeDriver`, graphs that re-run their body (`graph_fakes.RerunGraphs`) —
and host memory for its tensors. Every call records the device it was handed, so a test can check
that the device object a user's `--device` became reached each consumer with index 0."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tests.partition.graph_fakes import RerunGraphs
from tests.partition.test_green_ctx import FakeDriver

GPU = torch.device("cuda", 0)
LEGACY_DEFAULT_STREAM = 0


class FakeStream:
    def __init__(self, handle: int, external: bool):
        self.handle, self.external = handle, external


class RecordingStreams:
    """`StreamApi` with a per-thread current-stream stack, like CUDA's; records synchronizations."""

    def __init__(self):
        self.current = [FakeStream(LEGACY_DEFAULT_STREAM, external=True)]
        self.created: list[FakeStream] = []
        self.synchronized: list[int] = []
        self._next = 0x7F3A_0000_1000

    def create(self):
        self._next += 0x200
        stream = FakeStream(self._next, external=False)
        self.created.append(stream)
        return stream

    def wrap(self, handle):
        return FakeStream(handle, external=True)

    def handle(self, stream):
        return stream.handle

    @contextmanager
    def use(self, stream):
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()

    def synchronize(self, stream):
        self.synchronized.append(stream.handle)

    def current_handle(self):
        return self.current[-1].handle


class RecordingDriver(FakeDriver):
    """The fake green-context driver, remembering which device each call named."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.devices: list = []

    def sm_resource(self, device):
        self.devices.append(device)
        return super().sm_resource(device)

    def split(self, device, group_sms, flags=0):
        self.devices.append(device)
        return super().split(device, group_sms, flags)


class FakeCuda:
    """`CudaAccess` for an H100-like GPU (132 SMs, green-context groups of 8) that is not there."""

    def __init__(self, sms: int = 132, devices: int = 1, name: str = "NVIDIA H100 80GB HBM3 (fake)",
                 streams: RecordingStreams | None = None, driver: FakeDriver | None = None):
        self.sms, self.devices, self.name = sms, devices, name
        self.api = streams or RecordingStreams()
        self.driver = driver or RecordingDriver(sms, min_partition=8, alignment=8)
        self.graph_apis: list[RerunGraphs] = []
        self.calls: list[tuple[str, object]] = []  # (what, the device it was asked about)

    def device_count(self) -> int:
        return self.devices

    def make_current(self, device):
        self.calls.append(("make_current", device))

    def sm_count(self, device):
        self.calls.append(("sm_count", device))
        return self.sms

    def device_name(self, device):
        self.calls.append(("device_name", device))
        return self.name

    def streams(self, device):
        self.calls.append(("streams", device))
        return self.api

    def graphs(self):
        api = RerunGraphs()
        self.graph_apis.append(api)
        return api

    def green_ctx_driver(self):
        return self.driver

    def tensor_device(self, device):
        self.calls.append(("tensor_device", device))
        return torch.device("cpu")

    def devices_asked(self) -> set:
        return {device for _, device in self.calls}
