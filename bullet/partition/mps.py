"""Is the CUDA MPS control daemon running? Two CUDA processes run kernels side by side only under MPS
(without it they time-slice), and which cross-process partition holds differs with MPS on or off,
so the doctor's verdicts and the backend choice are keyed by it.

Two independent signs, either is enough:
* the daemon's **control pipe**: a FIFO named `control` in `$CUDA_MPS_PIPE_DIRECTORY` (default
  /tmp/nvidia-mps). CUDA clients find the daemon through this directory, so it is the sign that
  matters to them — and the one still visible from a container whose PID namespace hides the
  daemon's process. (A daemon killed with SIGKILL may leave a stale pipe behind: the process scan
  and the doctor's timing check tell the two apart.)
* its **process**, by full command line: the kernel cuts `comm` to 15 characters, and
  `nvidia-cuda-mps-control` and `nvidia-cuda-mps-server` both read `nvidia-cuda-mps` there, so
  `/proc/<pid>/cmdline` (argv[0]) is read instead.

Every probe takes its roots as parameters (a `/proc` tree, the environment), so tests run them on a
fake tree."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

PIPE_DIR_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
CONTROL = "nvidia-cuda-mps-control"
SERVER = "nvidia-cuda-mps-server"
THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


@dataclass(frozen=True)
class MpsStatus:
    pipe_directory: str
    control_pipe: bool  # a FIFO named `control` exists in the pipe directory
    processes: dict[int, str] = field(default_factory=dict)  # pid -> CONTROL or SERVER

    @property
    def control_pids(self) -> list[int]:
        return sorted(p for p, name in self.processes.items() if name == CONTROL)

    @property
    def running(self) -> bool:
        return self.control_pipe or bool(self.control_pids)

    @property
    def label(self) -> str:
        """"on" / "off": how verdicts and reports name the MPS state."""
        return "on" if self.running else "off"

    def evidence(self) -> str:
        if self.control_pids and self.control_pipe:
            return f"control daemon pid {self.control_pids[0]}, control pipe in {self.pipe_directory}"
        if self.control_pids:
            return (f"control daemon pid {self.control_pids[0]}, but no control pipe in {self.pipe_directory} "
                    f"(is {PIPE_DIR_ENV} the daemon's?)")
        if self.control_pipe:
            return (f"control pipe in {self.pipe_directory}; the daemon's process is not visible here "
                    "(another PID namespace, or a stale pipe)")
        return f"no control pipe in {self.pipe_directory} and no {CONTROL} process"

    def as_dict(self) -> dict:
        return {"running": self.running, "pipe_directory": self.pipe_directory, "control_pipe": self.control_pipe,
                "processes": {str(p): n for p, n in sorted(self.processes.items())}}


def pipe_directory(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(PIPE_DIR_ENV) or DEFAULT_PIPE_DIR)


def control_pipe_exists(directory: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(Path(directory) / "control").st_mode)
    except OSError:
        return False


def program_name(cmdline: bytes) -> str:
    """The program a /proc/<pid>/cmdline names: argv[0]'s base name ('' for kernel threads)."""
    argv0 = cmdline.split(b"\0", 1)[0].decode(errors="replace")
    return os.path.basename(argv0.split(" ", 1)[0]) if argv0 else ""


def mps_processes(proc_root: Path = Path("/proc")) -> dict[int, str]:
    """pid -> CONTROL / SERVER for every MPS daemon process visible under `proc_root`."""
    found = {}
    try:
        entries = list(Path(proc_root).iterdir())
    except OSError:
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            name = program_name((entry / "cmdline").read_bytes())
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if name in (CONTROL, SERVER):
            found[int(entry.name)] = name
    return found


def detect_mps(proc_root: Path = Path("/proc"), env: Mapping[str, str] | None = None) -> MpsStatus:
    directory = pipe_directory(env)
    return MpsStatus(str(directory), control_pipe_exists(directory), mps_processes(proc_root))
