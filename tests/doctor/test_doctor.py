"""`bullet doctor` end to end through the CLI, plus its failure paths."""

from __future__ import annotations

import json
import os

import pytest

from bullet.cli import main
from bullet.doctor import cpu_check, host_checks
from bullet.doctor.gpu_checks import gpu_unavailable_reason

NO_GPU = gpu_unavailable_reason() is not None
GPU_CHECKS = {"CUDA device", "MPS daemon", "driver within libsmctrl's range",
              "libsmctrl masks confine kernels (incl. graph replay)",
              "green-context pools confine kernels (incl. graph replay)", "CUDA IPC zero-copy",
              "worker steps run on the partitioned stream", "decode CUDA graphs",
              "profiler timing follows the partition", "cross-process isolation (timing)"}


def run_doctor(capsys, *argv) -> tuple[int, str]:
    code = main(["doctor", *argv])
    return code, capsys.readouterr().out


def test_json_report_on_this_machine(capsys):
    code, out = run_doctor(capsys, "--json")
    report = json.loads(out)
    checks = {c["name"]: c for c in report["checks"]}
    assert GPU_CHECKS <= set(checks)
    assert checks["cpu backend restricts a worker"]["status"] == ("PASS" if len(os.sched_getaffinity(0)) > 1
                                                                  else "SKIP")
    assert checks["/dev/shm writable"]["status"] == "PASS"
    assert code == (0 if report["ok"] else 1)
    # what every GPU number of the report holds for
    assert set(report["measured_on"]) >= {"gpu", "driver", "driver_version", "mps", "date"}
    assert report["measured_on"]["mps"] in ("on", "off")
    if NO_GPU:
        for name in GPU_CHECKS:
            assert checks[name]["status"] == "SKIP" and checks[name]["needs_gpu"]
            assert "no CUDA device" in checks[name]["summary"]
        assert "not run on this machine" in report["gpu_checks_note"]


def test_a_failing_check_gives_a_nonzero_exit_and_details(capsys, monkeypatch):
    monkeypatch.setattr(cpu_check, "check_cpu_backend", lambda: host_checks.check_cores())  # no child
    code, out = run_doctor(capsys, "--min-shm-mb", str(10**9))
    assert code == 1
    assert "[FAIL] /dev/shm writable" in out and "required_mb: 1000000000" in out
    assert "1 failed" in out


def test_a_check_that_raises_is_a_failure_not_a_crash(capsys, monkeypatch):
    def broken():
        raise OSError("boom")

    monkeypatch.setattr(host_checks, "check_cores", broken)
    monkeypatch.setattr(cpu_check, "check_cpu_backend", broken)
    code, out = run_doctor(capsys)
    assert code == 1 and "[FAIL] cores for two workers" in out and "OSError: boom" in out


def test_thread_binding_variables_fail_the_cpu_check(monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    result = cpu_check.check_cpu_backend()
    assert result.status == "FAIL" and "OMP_PROC_BIND" in result.details["variables"]


def test_leftover_segments_are_listed_as_stale_when_their_creator_is_gone():
    dead = next(pid for pid in range(4_000_000, 3_000_000, -1) if not os.path.exists(f"/proc/{pid}"))
    path = host_checks.SHM / f"bullet-{dead}x0badc0de-state"
    path.write_bytes(b"")
    try:
        result = host_checks.check_stale_segments()
    finally:
        path.unlink()
    assert result.status == "PASS"
    assert result.details["stale"][f"{dead}x0badc0de"] == [path.name]


def test_help_says_what_the_gpu_checks_need_and_record(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "without a GPU they report SKIP" in text and "--json" in text
    assert "isolation by timing" in text and "MPS state and date" in text
