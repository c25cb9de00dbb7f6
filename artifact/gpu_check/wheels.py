"""The wheels a GPU machine's image lacks: the pins (`wheels.txt`, read by scripts/gpu_wheels.sh too),
which of them a wheel folder holds, and the pip command that installs them there without internet."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

PINS_FILE = Path(__file__).with_name("wheels.txt")
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".gpu-wheels"
FETCH_COMMAND = "bash scripts/gpu_wheels.sh"
SOURCE_STAMP = "SOURCE"  # written by gpu_wheels.sh next to the wheels: the commit they were fetched for


@dataclass(frozen=True)
class Pin:
    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def key(self) -> tuple[str, str]:
        return normalize(self.name), self.version


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): case, '-', '_' and '.' do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = PINS_FILE) -> list[Pin]:
    pins = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path}:{n}: expected 'name==version', got {raw!r}")
        pins.append(Pin(name.strip(), version.strip()))
    return pins


def wheel_key(filename: str) -> tuple[str, str] | None:
    """(normalized name, version) of a wheel file name (`{name}-{version}-...whl`), None for others."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    return (normalize(parts[0]), parts[1]) if len(parts) >= 5 else None


def present(folder: Path) -> dict[tuple[str, str], Path]:
    found = {}
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        key = wheel_key(path.name)
        if key is not None:
            found[key] = path
    return found


def missing(folder: Path, pins: list[Pin] | None = None) -> list[Pin]:
    have = present(folder)
    return [p for p in (pins if pins is not None else read_pins()) if p.key not in have]


def pinned_files(folder: Path, pins: list[Pin] | None = None) -> list[Path]:
    """The pinned wheels of `folder`, one per pin (an extra or stale wheel there is not installed:
    two versions of one package would stop pip)."""
    have = present(folder)
    return [have[p.key] for p in (pins if pins is not None else read_pins()) if p.key in have]


def install_command(folder: Path, target: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", str(target),
            *map(str, pinned_files(folder))]


def total_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in pinned_files(folder))


def source_stamp(folder: Path) -> str | None:
    path = folder / SOURCE_STAMP
    return path.read_text().strip() if path.exists() else None

