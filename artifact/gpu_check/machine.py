"""The machine a run is on — GPU, driver, CUDA, torch, the commit of the checkout — and the two
things of it the run changes and must put back: the MPS control daemon, and GPU memory held by the
servers it started. This process never initialises CUDA itself (a context of its own would hold
memory and, made before MPS starts, sit outside it): torch is asked in a child."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from artifact.gpu_check.wheels import source_stamp

MPS_CONTROL = "nvidia-cuda-mps-control"

_TORCH_PROBE = """
import json, sys, torch
d = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
     "cuda_available": torch.cuda.is_available()}
if d["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    d.update(device=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
             memory_gib=round(p.total_memory / 2**30, 1), devices=torch.cuda.device_count())
print(json.dumps(d))
"""


def _out(cmd: list[str], timeout: float = 20.0, stdin: str | None = None) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=stdin)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def describe(root: Path, wheel_dir: Path, env: dict) -> dict:
    """Everything a number of this run is labelled with."""
    info: dict = {"host": platform.node(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
                  "date": time.strftime("%Y-%m-%d", time.gmtime()),
                  "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    smi = _out(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode,clocks.max.sm",
                "--format=csv,noheader"]) if shutil.which("nvidia-smi") else None
    if smi:
        name, driver, memory, mode, clock = [x.strip() for x in smi.splitlines()[0].split(",")]
        info.update(gpu=name, driver=driver, gpu_memory=memory, compute_mode=mode, max_sm_clock=clock)
    probe = _out([sys.executable, "-c", _TORCH_PROBE], timeout=60)
    info["torch"] = json.loads(probe) if probe else {"error": "torch could not be imported"}
    nvcc = _out(["nvcc", "--version"]) if shutil.which("nvcc") else None
    info["nvcc"] = nvcc.splitlines()[-1] if nvcc else None
    info["mps_control"] = shutil.which(MPS_CONTROL)
    info["commit"], info["commit_source"] = commit(root, wheel_dir, env)
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def commit(root: Path, wheel_dir: Path, env: dict) -> tuple[str, str]:
    """The commit this checkout is: $BULLET_COMMIT, else git (a copy on a GPU machine may have no
    .git), else the stamp scripts/gpu_wheels.sh left beside the wheels."""
    if env.get("BULLET_COMMIT"):
        return env["BULLET_COMMIT"], "BULLET_COMMIT"
    head = _out(["git", "-C", str(root), "rev-parse", "HEAD"]) if shutil.which("git") else None
    if head:
        dirty = _out(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]) or ""
        return head, f"git ({len(dirty.splitlines())} uncommitted changes)"
    stamp = source_stamp(wheel_dir)
    if stamp:
        return stamp.split()[1] if stamp.startswith("commit ") else stamp, f"{wheel_dir.name}/SOURCE: {stamp}"
    return "unknown", "no BULLET_COMMIT, no .git, no wheel stamp"


def slug(info: dict, plan_name: str) -> str:
    """The report's folder name: the GPU's name, the date and the plan, e.g. nvidia-h200-2026-11-27-serve
    (the CPU smoke's: cpu-smoke-2026-11-27)."""
    def clean(text: str) -> str:
        return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")

    if plan_name == "cpu-smoke":
        return f"cpu-smoke-{info['date']}"
    return f"{clean(info.get('gpu') or 'unknown-gpu')}-{info['date']}-{clean(plan_name)}"


# -- MPS -------------------------------------------------------------------------------------------
def mps_running() -> bool:
    """The control daemon is up (a process named nvidia-cuda-mps-control; /proc truncates to 15)."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == MPS_CONTROL[:15]:
                return True
        except OSError:
            continue
    return False


def mps_start() -> tuple[bool, str]:
    if shutil.which(MPS_CONTROL) is None:
        return False, f"{MPS_CONTROL} is not installed"
    if mps_running():
        return True, "already running"
    try:
        proc = subprocess.run([MPS_CONTROL, "-d"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return False, f"{MPS_CONTROL} -d did not return in 15 s"
    time.sleep(1.0)
    ok = proc.returncode == 0 and mps_running()
    return ok, f"rc {proc.returncode}{': ' + proc.stderr.strip() if proc.stderr.strip() else ''}"


def mps_stop() -> tuple[bool, str]:
    if not mps_running():
        return True, "not running"
    try:
        proc = subprocess.run([MPS_CONTROL], input="quit\n", capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return False, "quit did not return in 15 s"
    for _ in range(20):
        if not mps_running():
            return True, "stopped"
        time.sleep(0.25)
    return False, f"still running after quit (rc {proc.returncode})"


# -- GPU memory --------------------------------------------------------------------------------------
def gpu_processes() -> list[dict] | None:
    """Processes holding GPU memory, the MPS server aside (it holds a little of its own); None
    without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = _out(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"])
    if out is None:
        return None
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and "mps-server" not in parts[1]:
            rows.append({"pid": parts[0], "name": parts[1], "used_mib": parts[2]})
    return rows


def wait_gpu_released(timeout_s: float = 20.0) -> list[dict] | None:
    """Poll until no process but the MPS server holds GPU memory; what is still held at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = gpu_processes()
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.5)
