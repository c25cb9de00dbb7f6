"""Does the `cpu` backend really restrict a worker? Ask a child process to apply a share, then read
every one of its threads' allowed cores from /proc — the kernel's view, not the child's claim."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bullet.doctor.child import JsonLineChild
from bullet.doctor.results import CheckResult, failed, passed, skipped
from bullet.partition import format_id_list, parse_id_list
from bullet.partition.cpu import THREAD_BINDING_ENV


class CpuProbeChild(JsonLineChild):
    """Drives `python -m bullet.doctor.cpu_probe_child` over its stdin/stdout."""

    def __init__(self, role: str, cores: str | None = None, size: int = 128, preexec_fn=None,
                 timeout: float = 60.0):
        cmd = [sys.executable, "-m", "bullet.doctor.cpu_probe_child", "--role", role, "--size", str(size)]
        if cores:
            cmd += ["--cores", cores]
        super().__init__(cmd, timeout, preexec_fn)


def thread_affinities(pid: int) -> dict[int, set[int]]:
    """tid -> allowed cpu ids, from /proc/<pid>/task/<tid>/status."""
    result = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue  # thread exited
        line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list:"))
        result[int(task.name)] = parse_id_list(line.split(":", 1)[1])
    return result


def check_cpu_backend() -> CheckResult:
    name = "cpu backend restricts a worker"
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return skipped(name, f"only {len(allowed)} core allowed: nothing to divide")
    binding = {k: os.environ[k] for k in THREAD_BINDING_ENV if k in os.environ}
    if binding:
        return failed(name, "thread-binding variables are set: OpenMP would re-pin threads it creates later",
                      variables=binding)
    try:
        with CpuProbeChild("decode") as child:
            reply = child.send("apply 1")
            affinity = thread_affinities(child.pid)
    except (RuntimeError, OSError, ValueError) as e:
        return failed(name, f"probe child failed: {e}")
    want = {allowed[-1]}
    wrong = {tid: format_id_list(cpus) for tid, cpus in affinity.items() if cpus != want}
    details = {"threads": len(affinity), "expected_cores": format_id_list(want),
               "torch_threads": reply["torch_threads"], "apply_us": reply["apply_cost"]["mean_us"]}
    if wrong:
        return failed(name, f"{len(wrong)} of {len(affinity)} threads not restricted", wrong=wrong, **details)
    if reply["torch_threads"] != 1:
        return failed(name, f"torch uses {reply['torch_threads']} threads on a 1-core share", **details)
    return passed(name, f"all {len(affinity)} threads of a child pinned to core {allowed[-1]}, torch threads 1",
                  **details)
