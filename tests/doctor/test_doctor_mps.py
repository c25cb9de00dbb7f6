"""The doctor finds the MPS daemon by its control pipe and by full command lines (on a fake /proc
tree and a fake pipe directory), and judges a worker step against its own share's SMs and %smid ids
that MPS virtualises — with the observations of the H200 run of 2026-11-26 (driver 13.0)."""

from __future__ import annotations

import os
from pathlib import Path

from bullet.doctor.gpu_checks import check_mps
from bullet.doctor.mask_checks import ids_look_virtualised
from bullet.doctor.stream_checks import judge_worker_step
from bullet.partition import parse_id_list
from bullet.partition.mps import CONTROL, SERVER, detect_mps, mps_processes, program_name


def fake_proc(root: Path, processes: dict[int, tuple[bytes, str]]) -> Path:
    """A /proc tree: pid -> (cmdline bytes, comm)."""
    proc = root / "proc"
    proc.mkdir()
    (proc / "self").mkdir()  # non-numeric entries are skipped
    (proc / "meminfo").write_text("MemTotal: 1 kB\n")
    for pid, (cmdline, comm) in processes.items():
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cmdline").write_bytes(cmdline)
        (proc / str(pid) / "comm").write_text(comm + "\n")
    return proc


# what the kernel shows for the daemon pair: comm is cut to 15 characters, identical for both
DAEMONS = {
    811: (b"nvidia-cuda-mps-control\0-d\0", "nvidia-cuda-mps"),
    902: (b"/usr/bin/nvidia-cuda-mps-server\0", "nvidia-cuda-mps"),
    1000: (b"/opt/torch/.venv/bin/python3\0-m\0bullet.cli\0doctor\0", "python3"),
    2: (b"", "kthreadd"),  # a kernel thread: empty command line
    1200: (b"/home/u/nvidia-cuda-mps-control-notes.sh\0", "nvidia-cuda-mps"),  # a look-alike name
}


def test_program_name_is_argv0s_base_name():
    assert program_name(b"/usr/local/nvidia/bin/nvidia-cuda-mps-control\0-d\0") == CONTROL
    assert program_name(b"nvidia-cuda-mps-server\0") == SERVER
    assert program_name(b"") == ""
    assert program_name(b"nvidia-cuda-mps-control -d") == CONTROL  # a process that rewrote its argv into one


def test_daemons_are_found_by_full_command_line_not_the_15_character_comm(tmp_path):
    proc = fake_proc(tmp_path, DAEMONS)
    assert mps_processes(proc) == {811: CONTROL, 902: SERVER}
    status = detect_mps(proc, env={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")})
    assert status.running and status.control_pids == [811] and not status.control_pipe
    assert "no control pipe" in status.evidence()


def test_the_control_pipe_alone_shows_mps_running(tmp_path):
    """The H200 run: the pipe existed and the process scan found nothing (by comm); now it is running."""
    pipes = tmp_path / "mps-pipes"
    pipes.mkdir()
    os.mkfifo(pipes / "control")
    proc = fake_proc(tmp_path, {1000: DAEMONS[1000]})
    status = detect_mps(proc, env={"CUDA_MPS_PIPE_DIRECTORY": str(pipes)})
    assert status.running and status.control_pipe and status.processes == {}
    assert status.label == "on" and "not visible here" in status.evidence()
    result = check_mps(None, proc, {"CUDA_MPS_PIPE_DIRECTORY": str(pipes)})
    assert result.status == "PASS" and result.details["control_pipe"]


def test_no_pipe_and_no_daemon_fails_and_a_regular_file_is_not_a_pipe(tmp_path):
    pipes = tmp_path / "mps-pipes"
    pipes.mkdir()
    (pipes / "control").write_text("")  # not a FIFO: nothing listens
    proc = fake_proc(tmp_path, {1000: DAEMONS[1000]})
    result = check_mps(None, proc, {"CUDA_MPS_PIPE_DIRECTORY": str(pipes)})
    assert result.status == "FAIL" and "not running" in result.summary
    assert result.details["pipe_directory"] == str(pipes) and not result.details["running"]


def test_the_default_pipe_directory_and_the_real_proc_scan(tmp_path):
    status = detect_mps(fake_proc(tmp_path, {}), env={})
    assert status.pipe_directory == "/tmp/nvidia-mps"
    assert isinstance(mps_processes(), dict)  # the real /proc: readable, whatever runs here
    assert check_mps("no CUDA device").status == "SKIP"


def ids(text: str) -> set[int]:
    return set(parse_id_list(text))


def test_a_step_on_its_own_pools_sms_passes_whatever_the_logical_positions():
    """doctor-nomps.txt: the decode-40 pool ran on 68-77,82-91,96-105,110-119 in the pools check, and the
    step on 68-77 was failed against the logical positions 92-131. Against its own pool it passes."""
    pool = ids("68-77,82-91,96-105,110-119")
    assert judge_worker_step(40, pool, ids("68-77"), True) is None
    assert judge_worker_step(40, pool, pool, True) is None
    pool72 = ids("12-15,28-31,44-47,60-119")
    assert judge_worker_step(72, pool72, ids("12-15,28-31,44-47"), True) is None


def test_a_step_outside_its_pool_or_off_the_partitioned_stream_fails():
    pool = ids("68-77,82-91,96-105,110-119")
    problem = judge_worker_step(40, pool, ids("60-77"), True)
    assert problem is not None and "60-67" in problem
    assert "not the partitioned stream" in judge_worker_step(40, pool, ids("68-77"), False)
    assert "ran on 132 SMs" in judge_worker_step(40, set(range(132)), ids("0-9"), True)  # pool not confined
    assert "no SM" in judge_worker_step(40, set(), set(), True)
    assert "no SM" in judge_worker_step(40, pool, set(), True)


def test_mps_virtualised_ids_are_recognised():
    under_mps = {("decode", 40): ids("0-39"), ("decode", 72): ids("0-71"), ("decode", 132): ids("0-131"),
                 ("prefill", 40): ids("0-39"), ("prefill", 72): ids("0-71"), ("prefill", 132): ids("0-131")}
    assert ids_look_virtualised(under_mps)
    without_mps = {("decode", 40): ids("68-77,82-91,96-105,110-119"), ("decode", 132): ids("0-131"),
                   ("prefill", 40): ids("0-9,16-25,32-41,48-57"), ("prefill", 132): ids("0-131")}
    assert not ids_look_virtualised(without_mps)
    assert not ids_look_virtualised({("decode", 132): ids("0-131"), ("prefill", 132): ids("0-131")})
