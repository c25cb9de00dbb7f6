"""Latency targets and attainment. TTFT is absolute ("2s", "500ms") or per input token ("3ms/token",
Bullet Table 4's normalized TTFT); TPOT is absolute. A request attains its SLO when both hold
(Bullet §4.1); TPOT of a request is its mean time per output token after the first."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_SPEC = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*(/\s*(token|tok))?\s*$")


def parse_duration(text: str, allow_per_token: bool) -> tuple[float, bool]:
    """'150ms' -> (0.15, False); '3ms/token' -> (0.003, True). Bare numbers are seconds."""
    m = _SPEC.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a duration like '150ms', '2s' or '3ms/token'")
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    per_token = m.group(3) is not None
    if per_token and not allow_per_token:
        raise ValueError(f"{text!r}: a per-token target only makes sense for TTFT")
    if seconds <= 0:
        raise ValueError(f"{text!r}: a latency target must be positive")
    return seconds, per_token


@dataclass(frozen=True)
class SLO:
    ttft: float  # seconds, or seconds per input token when ttft_per_token
    ttft_per_token: bool
    tpot: float  # seconds

    @classmethod
    def parse(cls, ttft: str, tpot: str) -> "SLO":
        t, per_token = parse_duration(ttft, allow_per_token=True)
        d, _ = parse_duration(tpot, allow_per_token=False)
        return cls(t, per_token, d)

    def ttft_target(self, prompt_tokens: int) -> float:
        return self.ttft * prompt_tokens if self.ttft_per_token else self.ttft

    def attained(self, prompt_tokens: int, ttft: float, tpot: float | None) -> bool:
        ok_ttft = ttft <= self.ttft_target(prompt_tokens)
        return ok_ttft and (tpot is None or tpot <= self.tpot)

    def describe(self) -> str:
        ttft = f"{self.ttft * 1e3:g}ms/token" if self.ttft_per_token else f"{self.ttft * 1e3:g}ms"
        return f"TTFT {ttft}, TPOT {self.tpot * 1e3:g}ms"
