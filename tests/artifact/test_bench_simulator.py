"""The simulator's speed benchmark: its instruction count (valgrind's, `--instructions`) is read from
callgrind's own exit line, and the table puts the two trees' counts side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from artifact.benchmarks import bench_simulator as bench

ROOT = Path(__file__).resolve().parents[2]


def test_the_count_is_callgrinds_exit_line():
    stderr = ("==4673== Callgrind, a call-graph generating cache profiler\n==4673== Events    : Ir\n"
              "==4673== Collected : 5892053183\n==4673== \n==4673== I   refs:      5,892,053,183\n")
    assert bench.collected(stderr) == 5892053183
    with pytest.raises(RuntimeError, match="no instruction count"):
        bench.collected("==1== Callgrind\nsegfault\n")


def test_the_table_gives_the_instruction_ratio_beside_the_times():
    run = {"requests": 10, "virtual_s": 12.0, "sim_cpu_s": 1.0, "sim_wall_s": 1.1}
    results = {"bullet": {"baseline": [run], "current": [run], "identical": True, "speedup_cpu": 1.0,
                          "speedup_wall": 1.0, "realtime_cpu_baseline": 12.0, "realtime_cpu_current": 12.0,
                          "instructions": {"baseline": 4_393_000_000, "current": 4_294_000_000}},
               "static": {"baseline": [run], "current": [run], "identical": False, "speedup_cpu": 1.0,
                          "speedup_wall": 1.0, "realtime_cpu_baseline": 12.0, "realtime_cpu_current": 12.0}}
    lines = bench.table(results, "aaa", "bbb")
    assert any(line.startswith("| static |") and line.endswith("| NO |") for line in lines)
    counted = lines[next(i for i, line in enumerate(lines) if "instructions (G)" in line) + 2:]
    assert counted == ["| bullet | 4.393 -> 4.294 | 1.023x |"]  # static was not counted: no row


def test_instructions_without_valgrind_is_a_clear_error():
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # python, no valgrind
    proc = subprocess.run([sys.executable, "artifact/benchmarks/bench_simulator.py", "--instructions"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs valgrind" in proc.stderr
