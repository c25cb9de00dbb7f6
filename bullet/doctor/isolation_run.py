"""Measure cross-process isolation: two real processes (`isolation_child`), each holding one share
through a partition backend, timed alone and together (`isolation.judge_isolation` judges).

Rounds alternate which side is timed alone first; "together" starts both within a millisecond of
each other and each runs the same number of seconds, so the two loops overlap for all but that.
Runs on a GPU (green-ctx, libsmctrl, mps-percentage, none) and on a CPU with the `cpu` backend,
where cores are the units — the same path, short enough for a test.

    python -m bullet.doctor.isolation_run --backend cpu --device cpu --units-a 1 --units-b 1"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field

from bullet.doctor.cpu_check import JsonLineChild
from bullet.doctor.isolation import IsolationSamples, IsolationVerdict, judge_isolation


@dataclass(frozen=True)
class Side:
    """One process: its role (prefill takes units from the low end, decode from the high end), the
    units it asks for, and variables it starts with (mps-percentage's cap)."""

    role: str
    units: int
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class IsolationRun:
    backend: str
    samples: IsolationSamples
    verdict: IsolationVerdict
    granted: dict[str, int | None]

    def as_dict(self) -> dict:
        return {"backend": self.backend, "granted": self.granted, **self.verdict.as_dict(),
                "rates": {k: list(v) for k, v in asdict(self.samples).items() if k not in ("errors", "units")},
                "units": self.samples.units}


def _child(backend: str, side: Side, device: str, extra: list[str], timeout: float) -> JsonLineChild:
    cmd = [sys.executable, "-m", "bullet.doctor.isolation_child", "--backend", backend, "--role", side.role,
           "--units", str(side.units), "--device", device, *extra]
    return JsonLineChild(cmd, timeout=timeout, env={**os.environ, **side.env}, wait=False)


def _rate(reply: dict) -> float:
    if "rate" not in reply:
        raise RuntimeError(reply.get("error", f"unexpected answer {reply}"))
    return float(reply["rate"])


def measure_isolation(backend: str, a: Side, b: Side, device: str = "cuda", phase_s: float = 0.5, rounds: int = 2,
                      extra: list[str] | None = None, timeout: float = 180.0) -> IsolationRun:
    """Time side A and side B alone and together, `rounds` times; never raises for a side that
    fails (its error is in the samples, and the verdict is FAILED)."""
    return measure_pairs(backend, a, [b], device, phase_s, rounds, extra, timeout)[0]


def measure_pairs(backend: str, a: Side, bs: list[Side], device: str = "cuda", phase_s: float = 0.5,
                  rounds: int = 2, extra: list[str] | None = None, timeout: float = 180.0) -> list[IsolationRun]:
    """`measure_isolation` of A beside each of `bs` in turn, with the same two processes: B takes
    each next share in place (the env of the first B holds for all)."""
    children: dict[str, JsonLineChild] = {}
    measured: list[tuple[dict, dict, dict]] = []  # (rates, errors, granted) per pair
    errors: dict[str, str] = {}
    whole: list[float] = []
    total = None
    try:
        for name, side in (("A", a), ("B", bs[0])):  # both start at once; the rounds begin when both are ready
            children[name] = _child(backend, side, device, extra or [], timeout)
        answers: dict[str, dict] = {}
        granted = {name: _ready(child, child.wait_ready, errors, name, answers) for name, child in children.items()}
        for i, b in enumerate(bs):
            if i and not errors:
                granted["B"] = _ready(children["B"], lambda: children["B"].send(f"share {b.role} {b.units}"),
                                      errors, "B", answers)
            rates = {"alone_a": [], "alone_b": [], "together_a": [], "together_b": []}
            if not errors:
                try:
                    _rounds(children, rates, phase_s, rounds, phase_s + timeout)
                except (RuntimeError, OSError, ValueError) as e:
                    errors["run"] = str(e)
            measured.append((rates, dict(errors), dict(granted)))
        total = answers.get("A", {}).get("total")
        if not errors and total:
            whole = _whole_device(children["A"], a.role, int(total), phase_s, rounds, phase_s + timeout)
    finally:
        for child in children.values():
            child.close()
    runs = []
    for rates, errs, held in measured:
        units = (held["A"], held["B"], int(total)) if whole and held.get("A") and held.get("B") else None
        samples = IsolationSamples(**rates, errors=errs, whole=whole, units=units)
        runs.append(IsolationRun(backend, samples, judge_isolation(samples), held))
    return runs


def _whole_device(child: JsonLineChild, role: str, total: int, phase_s: float, rounds: int,
                  answer_s: float) -> list[float]:
    """Side A alone on every unit, `rounds` times (the device's own limit, `isolation.device_reference`);
    empty when the backend cannot give it (the verdict then goes without)."""
    try:
        answer = child.send(f"share {role} {total}", answer_s)
        if "error" in answer or answer.get("units") != total:
            return []
        return [_rate(child.send(f"run {phase_s}", answer_s)) for _ in range(rounds)]
    except (RuntimeError, OSError, ValueError):
        return []


def _ready(child: JsonLineChild, read, errors: dict[str, str], name: str, answers: dict[str, dict]) -> int | None:
    try:
        answer = read()
    except (RuntimeError, OSError, ValueError) as e:
        errors[name] = str(e)
        return None
    if "error" in answer:
        errors[name] = answer["error"]
    answers[name] = answer
    return answer.get("units")


def _rounds(children: dict[str, JsonLineChild], rates: dict[str, list[float]], phase_s: float, rounds: int,
            answer_s: float) -> None:
    for r in range(rounds):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            rates[f"alone_{name.lower()}"].append(_rate(children[name].send(f"run {phase_s}", answer_s)))
        for child in children.values():
            child.post(f"run {phase_s}")
        for name, child in children.items():
            rates[f"together_{name.lower()}"].append(_rate(child.read(answer_s)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--units-a", type=int, required=True)
    parser.add_argument("--units-b", type=int, required=True)
    parser.add_argument("--phase-s", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    run = measure_isolation(args.backend, Side("prefill", args.units_a), Side("decode", args.units_b), args.device,
                            args.phase_s, args.rounds)
    print(json.dumps(run.as_dict(), indent=2))
    return 0 if run.verdict.isolated else 1


if __name__ == "__main__":
    sys.exit(main())
