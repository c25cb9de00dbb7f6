"""The doctor's verdicts on disk: one JSON file per kind of verdict in the GPU cache directory,
`{key: {backend: entry}}`, where the key names what a verdict holds for (GPU name and driver; and
MPS on/off where that matters). Written atomically: a worker reading while the doctor writes sees
the old record or the new one, never half of one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def device_key(device_name: str, driver: int | None, mps: str | None = None) -> str:
    key = f"{device_name}|driver {driver}"
    return key if mps is None else f"{key}|mps {mps}"


def read_entries(path: Path, key: str) -> dict[str, dict]:
    """backend -> entry under `key` ({} when nothing was recorded or the file is unreadable)."""
    try:
        entries = json.loads(Path(path).read_text()).get(key, {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {b: e for b, e in entries.items() if isinstance(e, dict)} if isinstance(entries, dict) else {}


def write_entry(path: Path, key: str, backend: str, entry: dict) -> Path:
    """Store `entry` for `backend` under `key`, stamped with the time; other entries are kept."""
    path = Path(path)
    try:
        records = json.loads(path.read_text())
        if not isinstance(records, dict):
            records = {}
    except (OSError, ValueError):
        records = {}
    records.setdefault(key, {})[backend] = {**entry, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(records, indent=2) + "\n")
    os.replace(tmp, path)
    return path
