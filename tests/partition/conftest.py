"""Fixtures for the partition tests: compile small C shared libraries with gcc at test time."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def compile_shared(source: Path, out: Path, *flags: str) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot build the C test doubles")
    cmd = [gcc, "-O1", "-Wall", "-Werror", "-shared", "-fPIC", *flags, str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"
    return out


@pytest.fixture(scope="session")
def c_build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cbuild")


@pytest.fixture(scope="session")
def build_c(c_build_dir):
    """build_c("fake_x.c", "libx.so", *flags) -> path of the shared library built from tests/partition."""
    return lambda source, name, *flags: compile_shared(HERE / source, c_build_dir / name, *flags)
