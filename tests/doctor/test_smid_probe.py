"""csrc/gpu_smid_probe.cu compiles with nvcc (compile-only here: no GPU). Loading it and launching
without a driver must fail with a CUDA error code, not crash."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from bullet.doctor.smid_probe import build_probe, find_nvcc
from bullet.partition import cuda_driver

pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found: the probe cannot be compiled here")


@pytest.fixture(scope="module")
def probe_sm80(tmp_path_factory):
    return build_probe("80", out_dir=tmp_path_factory.mktemp("probe"))


def test_probe_compiles_for_ampere_and_hopper(probe_sm80, tmp_path):
    assert probe_sm80.is_file()
    symbols = subprocess.run(["nm", "-D", str(probe_sm80)], capture_output=True, text=True).stdout
    assert "gpu_smid_probe_launch" in symbols and "gpu_smid_probe_abi_version" in symbols
    assert build_probe("90", out_dir=tmp_path).is_file()


@pytest.mark.skipif(cuda_driver.cuda_driver_version() is not None, reason="a CUDA driver is installed here")
def test_launch_without_a_driver_returns_a_cuda_error(probe_sm80):
    code = (
        "import ctypes, sys\n"
        "from bullet.doctor.smid_probe import SmidProbe, ProbeUnavailable\n"
        f"p = SmidProbe({str(probe_sm80)!r})\n"
        "class FakeBuffer:\n"
        "    def numel(self): return 64\n"
        "    def data_ptr(self): return 0x1000\n"
        "try:\n"
        "    p.launch(0, FakeBuffer())\n"
        "except ProbeUnavailable as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # cudaErrorInsufficientDriver (35) or cudaErrorNoDevice (100), depending on the runtime version
    assert re.search(r"probe launch failed with cudaError (35|100)\b", done.stdout), done.stdout
