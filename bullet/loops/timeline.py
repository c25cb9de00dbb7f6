"""Every scheduling decision and partition change, recorded for a timeline like Bullet Fig. 20:
one JSON object per line in `<timeline_dir>/<role>.jsonl` (time, role, units, whether the worker ran,
layers, batch, queue, tokens, predicted and observed step time, the rule that decided). Buffered,
flushed every second and at exit; recording nothing when no directory is configured.

A two-worker step row says what the other worker ran when the step was decided (`decode_batch` on a
prefill row, `prefill_units` on a decode row) and, since 2026-11-29, what the step is learnt as
running beside (`beside`: decode's batch for a prefill group, prefill's tokens in flight for a decode
step, 0 alone; `bullet.policies.views.beside_size`, from the peer's state at the decision and at the
step's end). `recorded_beside` reads either."""

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


def recorded_beside(row: dict) -> int:
    """What a prefill or decode step row ran beside: its `beside` where the timeline recorded it, else
    (timelines before 2026-11-29) the decision's view — a prefill group beside the decode batch it saw,
    a decode step beside a prefill that held units (1: its size was not recorded)."""
    if "beside" in row:
        return int(row["beside"] or 0)
    if row.get("role") == "prefill":
        return int(row.get("decode_batch") or 0)
    return 1 if row.get("role") == "decode" and row.get("prefill_units") else 0


def load_timeline(directory: str | Path) -> list[dict]:
    rows = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return sorted(rows, key=lambda r: r["t"])
