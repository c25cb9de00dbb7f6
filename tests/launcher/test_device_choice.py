"""`--device` is decided once, before any weight is loaded: a device that is not there, or a
partition backend that cannot divide it, is one line on stderr and exit code 2 — through the real
command line — and what the launcher hands on is a `torch.device` with an index."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from bullet.cli import main
from bullet.config import ServerArgs
from bullet.launcher.device_choice import serving_device
from engines.device import require_device, resolve_device
from tests.partition.fake_cuda import GPU, FakeCuda

HAS_GPU = torch.cuda.is_available()
DUMMY = ["--load-format", "dummy", "--model-path", "smollm2-135m"]


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if anything starts loading weights or a server."""
    import bullet.commands.launch as launch
    import bullet.shared.model as shared_model

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the device was checked")

    monkeypatch.setattr(shared_model, "load_weights", refuse)
    monkeypatch.setattr(launch, "serve", refuse)


def launch_error(capsys, *flags: str) -> str:
    code = main(["launch", *DUMMY, *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is visible here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto"])
def test_cuda_without_a_gpu_is_one_line_and_exit_2(device, capsys, no_weights_loaded):
    backend = "green-ctx" if device != "auto" else "libsmctrl"
    err = launch_error(capsys, "--device", device, "--partition-backend", backend)
    if device == "auto":  # auto found the CPU, where libsmctrl cannot work
        assert err.startswith("bullet launch: --partition-backend libsmctrl restricts the SMs of an NVIDIA GPU")
        assert "--device auto" in err
    else:
        assert err.startswith(f"bullet launch: --device {device}: no CUDA device is visible")
        assert "or pass --device cpu" in err


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cpu_partition_cannot_divide_a_gpu(device, capsys, no_weights_loaded):
    # checked before looking for a GPU: no GPU would make this combination work
    err = launch_error(capsys, "--device", device, "--partition-backend", "cpu")
    assert err == (f"bullet launch: --partition-backend cpu pins CPU cores and cannot divide a GPU "
                   f"(--device {device}): pass --partition-backend auto (or green-ctx, libsmctrl, mps-percentage, none)")


@pytest.mark.parametrize("backend", ["green-ctx", "libsmctrl", "mps-percentage"])
def test_sm_partitions_cannot_divide_a_cpu(backend, capsys, no_weights_loaded):
    err = launch_error(capsys, "--device", "cpu", "--partition-backend", backend)
    assert err.startswith(f"bullet launch: --partition-backend {backend} restricts the SMs of an NVIDIA GPU, but the "
                          "server runs on the CPU (--device cpu)")


def test_an_unknown_device_name_is_refused(capsys, no_weights_loaded):
    err = launch_error(capsys, "--device", "gpu")
    assert "device" in err and "choose cpu, cuda, cuda:<index> or auto" in err


@pytest.mark.skipif(HAS_GPU, reason="a CUDA device is visible here")
def test_the_installed_command_fails_fast_before_loading_anything():
    """As a user runs it: `bullet launch --device cuda` on this GPU-less machine."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bullet.cli", "launch", "--device", "cuda", "--partition-backend",
                           "none", "--load-format", "dummy", "--model-path", "llama-3.1-8b"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("bullet launch: --device cuda: no CUDA device is visible")
    assert len(done.stderr.strip().splitlines()) == 1
    assert "[bullet] starting" not in done.stderr  # the server never started (8B dummy weights: never drawn)
    assert time.monotonic() - began < 60


# ---- the one device object ----------------------------------------------------------------------

@pytest.mark.parametrize("given", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), "auto", None])
def test_every_spelling_of_the_first_gpu_is_cuda_0(given):
    device = resolve_device(given, cuda_devices=2)
    assert device == GPU and device.index == 0 and require_device(device) is device


def test_cpu_and_other_gpus():
    assert resolve_device("cpu", cuda_devices=0) == torch.device("cpu")
    assert resolve_device("auto", cuda_devices=0) == torch.device("cpu")
    assert resolve_device("cuda:1", cuda_devices=2) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"--device cuda:2: only 2 CUDA device\(s\) are visible"):
        resolve_device("cuda:2", cuda_devices=2)
    with pytest.raises(ValueError, match="Bullet serves on cpu or cuda"):
        resolve_device("meta", cuda_devices=1)


def test_consumers_refuse_anything_but_a_resolved_device():
    for wrong in ("cuda", torch.device("cuda"), None):
        with pytest.raises(TypeError):
            require_device(wrong)


def test_the_launcher_resolves_against_the_cuda_it_is_given():
    args = ServerArgs(device=torch.device("cuda", 0), partition_backend="green-ctx")
    assert args.device == "cuda:0"
    assert serving_device(args, FakeCuda()) == GPU
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        serving_device(args, FakeCuda(devices=0))
    assert serving_device(ServerArgs(device="auto", partition_backend="none"), FakeCuda()) == GPU
    assert serving_device(ServerArgs(device="auto", partition_backend="cpu"), FakeCuda(devices=0)).type == "cpu"
    with pytest.raises(ValueError, match="--partition-backend cpu pins CPU cores and cannot divide a GPU"):
        serving_device(ServerArgs(device="auto", partition_backend="cpu"), FakeCuda())
