"""Every scheduling decision and partition change, recorded for a timeline like Bullet Fig. 20:
one JSON object per line in `<timeline_dir>/<role>.jsonl` (time, role, units, whether the worker ran,
layers, batch, queue, tokens, predicted and observed step time, the rule that decided). Buffered,
flushed every second and at exit; recording nothing when no directory is configured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable


class Timeline:
    """`annotate`: fields added to every row, read when the row is recorded (a worker's counters
    that should be visible beside its steps, e.g. Triton compiles while serving; an empty dict
    adds nothing)."""

    def __init__(self, directory: str | None, role: str, flush_every_s: float = 1.0,
                 annotate: Callable[[], dict] | None = None):
        self.path = Path(directory) / f"{role}.jsonl" if directory else None
        self.role = role
        self.annotate = annotate
        self._buffer: list[str] = []
        self._last_flush = time.monotonic()
        self.flush_every_s = flush_every_s
        self.last_units: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record(self, t: float, units: int, **fields) -> None:
        if self.path is None:
            return
        changed = units != self.last_units
        self.last_units = units
        extra = self.annotate() if self.annotate is not None else None
        self._buffer.append(json.dumps({"t": round(t, 6), "role": self.role, "units": units,
                                        "repartition": changed, **fields, **(extra or {})}))
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if self.path is None or not self._buffer:
            return
        with open(self.path, "a") as f:
            f.write("\n".join(self._buffer) + "\n")
        self._buffer.clear()
        self._last_flush = time.monotonic()


def load_timeline(directory: str | Path) -> list[dict]:
    rows = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return sorted(rows, key=lambda r: r["t"])
