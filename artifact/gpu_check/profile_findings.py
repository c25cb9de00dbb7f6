"""What a GPU check's profile measured that the report should say in words: whether decode attention
pads to the batch's longest context (the profiler's padding probe), and how far the hybrid steps it
timed (a prompt chunk beside decode rows, as chunked-prefill runs them) are from what the estimator
predicts for them without those samples — borrowing decode's calibration, as it did before profiles
timed hybrid steps; and what each phase paid on every SM beside the other on every SM."""

from __future__ import annotations

import json
from pathlib import Path


def padding_verdict(profile: dict) -> str | None:
    """The padding probe's note (`estimator.profiler.padding`), as the profile keeps it."""
    return next((n for n in profile.get("notes", []) if n.startswith(("decode attention", "decode padding"))), None)


def hybrid_steps(profile: dict) -> list[str]:
    """One line per timed hybrid step: measured, and predicted without the hybrid samples."""
    from estimator.profile import EstimatorProfile  # deferred: pydantic comes with the carried wheels (after the install step)
    from estimator.profiler.prediction_errors import predict  # deferred: likewise

    profile = EstimatorProfile.model_validate(profile)
    measured = [s for s in profile.calibration.samples if s.kind == "hybrid"]
    if not measured:
        return []
    borrowed = profile.model_copy(update={"calibration": profile.calibration.model_copy(
        update={"samples": [s for s in profile.calibration.samples if s.kind != "hybrid"]})}).estimator()
    lines = []
    for s in measured:
        predicted = predict(borrowed, s)
        chunks = "+".join(map(str, s.prefill_lens))
        lines.append(f"hybrid[{chunks} + {s.decode_batch} decodes] on {s.units}: {s.seconds * 1e3:.2f} ms measured, "
                     f"{predicted * 1e3:.2f} ms from decode's calibration ({predicted / s.seconds - 1:+.0%})")
    return lines


def findings(path: Path) -> list[str]:
    """The report's lines about the profile at `path` (none when it cannot be read)."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    lines = [v for v in [padding_verdict(profile)] if v]
    try:
        lines += hybrid_steps(profile)
    except Exception as exc:  # the report must come out whatever the profile holds
        lines.append(f"hybrid steps not compared: {exc}")
    shared = shared_units(profile)
    if shared:
        lines.append(shared)
    return lines


def shared_units(profile: dict) -> str | None:
    """What each phase took on every SM beside the other on every SM (two MPS clients, no partition:
    how `naive` and `scheduler-only` share the device), which the simulator then charges in place of
    the demand split it assumes without it."""
    points = (profile.get("contention") or {}).get("shared_units") or []
    if not points:
        return None
    factors = ", ".join(f"{p['kind']} {p['factor']:.2f}x" for p in points)
    return (f"each phase on every SM beside the other on every SM took {factors} its time alone: the simulator "
            "prices SMs both workers hold by it (without it, by demand, assumed free)")
