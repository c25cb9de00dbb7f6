"""Kernels this process gave up on: where a fast kernel failed (Triton could not compile or launch
it on this GPU, or does not import) the engine keeps serving on a slower torch path, and says so
once in its log. A log line is easy to miss in a benchmark's numbers, so each such switch is also
recorded here — which kernel, what runs instead, why — for the engine benchmark's JSON and the
worker's timeline to carry (`artifact.gpu_check.report` shows them)."""

from __future__ import annotations

import threading
import time

_LOCK = threading.Lock()
_RECORDS: list[dict] = []
MAX_RECORDS = 32  # one per kernel in practice (each falls back once); bounded whatever a caller does


def record(kernel: str, instead: str, error: BaseException | str) -> None:
    """`kernel` failed and `instead` runs from now on; `error` says why."""
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    with _LOCK:
        if len(_RECORDS) < MAX_RECORDS:
            _RECORDS.append({"kernel": kernel, "instead": instead, "error": reason[:500],
                             "unix_time": round(time.time(), 3)})


def fallbacks() -> list[dict]:
    """Every fallback recorded so far, oldest first (copies)."""
    with _LOCK:
        return [dict(r) for r in _RECORDS]


def clear() -> None:
    """Forget the records (the engine benchmark between its settings; tests)."""
    with _LOCK:
        _RECORDS.clear()
