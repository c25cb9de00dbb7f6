"""scripts/launch.sh: on a CPU it is `bullet launch "$@"`; serving on a GPU it starts MPS when the
policy has two worker processes, runs the doctor and refuses to launch when the doctor fails. The
GPU tools are fakes on PATH that record how they were called (no GPU here)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "launch.sh"


def fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\necho \"{name} $*\" >> \"$CALLS\"\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake(bin_dir, "bullet", 'if [ "$1 $2" = "doctor --help" ]; then echo "usage: bullet doctor [--json]"; fi\n'
                            'if [ "$1" = doctor ] && [ "$2" != --help ]; then exit "${DOCTOR_EXIT:-0}"; fi')
    return bin_dir


def launch(tools: Path, *args: str, gpu: bool, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    calls = tools.parent / "calls.txt"
    calls.unlink(missing_ok=True)
    if gpu:
        fake(tools, "nvidia-smi", 'echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-0)"')
        fake(tools, "nvidia-cuda-mps-control", "exit 0")
    path = f"{tools}:/usr/bin:/bin"
    out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                         env={"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "CALLS": str(calls),
                              "BULLET_BIN": str(tools / "bullet"), **env})
    return out, calls.read_text().splitlines() if calls.exists() else []


def test_on_a_cpu_it_only_launches(tools):
    out, calls = launch(tools, "--port", "0", "--policy", "bullet", gpu=False)
    assert out.returncode == 0, out.stderr
    assert calls == ["bullet launch --port 0 --policy bullet"]


def test_gpu_present_but_cpu_device_serves_on_the_cpu(tools):
    out, calls = launch(tools, "--policy", "bullet", gpu=True)
    assert out.returncode == 0 and "--device is cpu" in out.stderr
    assert calls == ["nvidia-smi -L", "bullet launch --policy bullet"]


def test_on_a_gpu_it_starts_mps_and_runs_the_doctor_first(tools):
    out, calls = launch(tools, "--device", "cuda", "--policy=bullet", gpu=True)
    assert out.returncode == 0, out.stderr
    assert "nvidia-cuda-mps-control -d" in calls
    doctor = calls.index("bullet doctor")
    assert calls.index("nvidia-cuda-mps-control -d") < doctor < calls.index("bullet launch --device cuda --policy=bullet")


def test_one_process_policy_needs_no_mps_and_a_failing_doctor_stops_the_launch(tools):
    for policy in ("chunked:1024", "sglang:1024"):  # each runs one worker process
        out, calls = launch(tools, "--device", "cuda", "--policy", policy, gpu=True)
        assert out.returncode == 0 and not any("mps" in c for c in calls), policy
    out, calls = launch(tools, "--device", "cuda", gpu=True, DOCTOR_EXIT="1")
    assert out.returncode == 1 and "doctor reported a failure" in out.stderr
    assert not any(c.startswith("bullet launch") for c in calls)
    out, calls = launch(tools, "--device", "cuda", gpu=True, DOCTOR_EXIT="1", BULLET_LAUNCH_FORCE="1")
    assert out.returncode == 0 and calls[-1] == "bullet launch --device cuda"


def test_the_doctor_runs_in_quick_mode_when_it_has_one(tools):
    fake(tools, "bullet", 'if [ "$1 $2" = "doctor --help" ]; then echo "  --quick  fast checks"; fi')
    out, calls = launch(tools, "--device", "auto", gpu=True)
    assert out.returncode == 0, out.stderr
    assert "bullet doctor --quick" in calls


def test_the_script_knows_every_one_process_policy():
    from bullet.policies.factory import ONE_PROCESS_POLICIES

    case = next(line for line in SCRIPT.read_text().splitlines() if "needs_mps=0" in line)
    assert all(f"{name}:*" in case for name in ONE_PROCESS_POLICIES), case
