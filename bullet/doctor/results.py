"""Check results and how the doctor prints them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class CheckResult:
    name: str
    status: str          # PASS, FAIL or SKIP
    summary: str         # one line: what was found, or why it failed / was skipped
    details: dict = field(default_factory=dict)
    needs_gpu: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def passed(name, summary, **details) -> CheckResult:
    return CheckResult(name, PASS, summary, details)


def failed(name, summary, **details) -> CheckResult:
    return CheckResult(name, FAIL, summary, details)


def skipped(name, summary, **details) -> CheckResult:
    return CheckResult(name, SKIP, summary, details)


def exit_code(results: list[CheckResult]) -> int:
    return 1 if any(r.status == FAIL for r in results) else 0


def render_text(results: list[CheckResult], verbose: bool = False) -> str:
    width = max(len(r.name) for r in results)
    lines = []
    for r in results:
        lines.append(f"[{r.status}] {r.name:<{width}}  {r.summary}")
        if verbose or r.status == FAIL:
            for key, value in r.details.items():
                lines.append(f"{'':>7}{'':<{width}}  {key}: {value}")
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    return "\n".join(lines)


def render_json(results: list[CheckResult], context: dict) -> str:
    return json.dumps({**context, "ok": exit_code(results) == 0,
                       "checks": [r.as_dict() for r in results]}, indent=2)
