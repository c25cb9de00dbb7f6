"""Cost of re-partitioning, recorded per `apply` call.

The runtime reports this as "resource re-configuration" time (Bullet Table 5: 4.1 µs mean, 5.9 µs
P99 for a libsmctrl stream mask on an A100). Apply runs every few milliseconds for the life of a
worker, so only a bounded window of samples is kept for percentiles, plus exact running totals."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ApplyCostSummary:
    count: int          # every apply since the backend was created
    mean_us: float      # over every apply
    p50_us: float       # over the recent window
    p99_us: float       # over the recent window
    max_us: float       # over every apply

    def as_dict(self) -> dict:
        return {"count": self.count, "mean_us": self.mean_us, "p50_us": self.p50_us,
                "p99_us": self.p99_us, "max_us": self.max_us}


class ApplyCostRecorder:
    def __init__(self, window: int = 4096):
        self._recent: deque[int] = deque(maxlen=window)
        self._count = 0
        self._total_ns = 0
        self._max_ns = 0

    def record(self, elapsed_ns: int) -> None:
        self._recent.append(elapsed_ns)
        self._count += 1
        self._total_ns += elapsed_ns
        if elapsed_ns > self._max_ns:
            self._max_ns = elapsed_ns

    def summary(self) -> ApplyCostSummary:
        if not self._count:
            return ApplyCostSummary(0, 0.0, 0.0, 0.0, 0.0)
        ordered = sorted(self._recent)
        return ApplyCostSummary(
            count=self._count,
            mean_us=self._total_ns / self._count / 1e3,
            p50_us=_percentile(ordered, 50) / 1e3,
            p99_us=_percentile(ordered, 99) / 1e3,
            max_us=self._max_ns / 1e3,
        )


def _percentile(ordered: list[int], q: float) -> float:
    """Nearest-rank percentile (no interpolation: every reported value was actually observed)."""
    rank = max(1, -(-len(ordered) * q // 100))
    return float(ordered[int(rank) - 1])
