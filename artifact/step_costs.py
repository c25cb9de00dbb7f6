"""What a served run's steps cost, read from its step timelines alone (no device model): for each
kind of step, a straight line through the work it did.

A served comparison keeps every worker's steps, with their observed times, under
`<out>/timeline/<system>/<role>.jsonl` (`artifact.served_steps` fits a profile's device model to
them). This asks a plainer question of the same rows, the one that found two of the GPU path's
costs on an H200 (2026-11-26):

* **decode steps** (decode rows only), on each share of units they ran on: milliseconds = a + b x
  (thousands of context tokens);
* **mixed steps** (prompt chunks beside decode rows, the chunked baselines'): those whose new tokens
  lie within `BAND` of the most any step ran (a full chunk budget), milliseconds = a + b x (decode
  rows): b is what a decode row adds to a step that computes anyway — a few hundredths of a
  millisecond if its attention is read as decode reads it; there, 0.37 ms (its rows ran through the
  prompt-attention kernel);
* **prefill layer groups** (a two-worker system's prefill worker): the median time per layer in
  bins of tokens: where the smallest bin costs as much as the larger ones, kernel launches, not the
  math, set a prefill's pace (there, 0.8 ms a layer for 16 tokens and for 400).

Steps more than `OUTLIER` times their group's median are left out (a server's first steps, a
per-shape set-up); each line says how many steps it rests on.

    python -m artifact.step_costs DIR/timeline [--json OUT.json]"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

BAND = 0.1  # mixed steps: new tokens within 10 % of the most any step ran (its chunk budget)
MIN_SHARE_STEPS = 20  # a decode share's line needs this many steps
OUTLIER = 3.0
TOKEN_BINS = (1, 64, 256, 1024, 4096, 1 << 30)


def _rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off when the server stopped
        if isinstance(row, dict) and row.get("run") and isinstance(row.get("obs_ms"), (int, float)):
            out.append(row)
    return out


def _kept(rows: list[dict]) -> list[dict]:
    if not rows:
        return rows
    median = statistics.median(r["obs_ms"] for r in rows)
    return [r for r in rows if r["obs_ms"] <= OUTLIER * median]


def line_fit(x: list[float], y: list[float]) -> dict | None:
    """Least squares y = a + b x, with its R^2 and the steps it rests on (None below 3 steps or
    without spread in x)."""
    if len(x) < 3 or max(x) == min(x):
        return None
    a_mat = np.column_stack([np.ones(len(x)), np.asarray(x, dtype=float)])
    (a, b), *_ = np.linalg.lstsq(a_mat, np.asarray(y, dtype=float), rcond=None)
    fitted = a_mat @ np.array([a, b])
    total = float(np.sum((np.asarray(y) - np.mean(y)) ** 2))
    r2 = 1.0 - float(np.sum((np.asarray(y) - fitted) ** 2)) / total if total > 0 else 1.0
    return {"a_ms": float(a), "b_ms": float(b), "r2": r2, "steps": len(x)}


def _tokens(row: dict) -> int:
    chunks = row.get("chunks")
    return sum(int(c[0]) for c in chunks) if chunks else int(row.get("tokens", 0))


def worker_costs(path: Path) -> dict:
    """The lines for one worker's timeline (unified, prefill or decode)."""
    rows, out = _rows(path), {}
    role = path.stem
    if role in ("unified", "decode"):
        # a decode worker's rows count their batch in `batch`; a unified worker's, in `decode_batch`
        decode = [r for r in rows if (r.get("batch") if role == "decode" else
                                      not r.get("chunks") and r.get("decode_batch"))]
        shares = sorted({r.get("units") for r in decode}, key=lambda u: (u is None, u))
        for units in shares:  # a two-worker system's decode runs on shares: a line for each one
            on = _kept([r for r in decode if r.get("units") == units])
            fit = line_fit([r["context"] / 1e3 for r in on], [r["obs_ms"] for r in on])
            if fit and (len(shares) == 1 or fit["steps"] >= MIN_SHARE_STEPS):
                out[f"decode on {units} units: ms = a + b x 1k context tokens"] = fit
    if role == "unified":
        mixed = [r for r in rows if r.get("chunks") and r.get("decode_batch")]
        if mixed:
            full = max(_tokens(r) for r in mixed)  # the chunk budget, as full steps fill it
            band = _kept([r for r in mixed if _tokens(r) >= (1 - BAND) * full])
            fit = line_fit([r["decode_batch"] for r in band], [r["obs_ms"] for r in band])
            if fit:
                out[f"mixed, {round((1 - BAND) * full)}-{full} new tokens: ms = a + b x decode rows"] = fit
    if role == "prefill":
        groups = [r for r in rows if r.get("layers")]
        bins = {}
        for lo, hi in zip(TOKEN_BINS, TOKEN_BINS[1:]):
            picked = _kept([r for r in groups if lo <= r.get("tokens", 0) < hi])
            if picked:
                bins[f"{lo}-{hi - 1}" if hi < TOKEN_BINS[-1] else f">={lo}"] = {
                    "ms_per_layer": statistics.median(r["obs_ms"] / r["layers"] for r in picked), "steps": len(picked)}
        if bins:
            out["prefill layer groups: median ms per layer, by tokens"] = bins
    return out


def step_costs(timeline_dir: Path) -> dict:
    """{system: {role: lines}} for every `<system>/<role>.jsonl` under `timeline_dir`."""
    out: dict[str, dict] = {}
    for path in sorted(Path(timeline_dir).glob("*/*.jsonl")):
        costs = worker_costs(path)
        if costs:
            out.setdefault(path.parent.name, {})[path.stem] = costs
    return out


def markdown(costs: dict) -> list[str]:
    lines = ["| system | worker | steps | line | fit |", "|---|---|---|---|---|"]
    for system, roles in costs.items():
        for role, found in roles.items():
            for name, value in found.items():
                if "a_ms" in value:
                    lines.append(f"| {system} | {role} | {value['steps']} | {name} | a {value['a_ms']:.2f}, "
                                 f"b {value['b_ms']:.3f} (R² {value['r2']:.2f}) |")
                else:
                    cells = ", ".join(f"{k}: {v['ms_per_layer']:.2f} ({v['steps']})" for k, v in value.items())
                    lines.append(f"| {system} | {role} | {sum(v['steps'] for v in value.values())} | {name} | {cells} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline", type=Path, help="a served run's timeline folder (<system>/<role>.jsonl inside)")
    ap.add_argument("--json", type=Path, default=None, help="also write the lines as JSON here")
    args = ap.parse_args(argv)
    if not args.timeline.is_dir():
        ap.error(f"{args.timeline} is not a folder")
    costs = step_costs(args.timeline)
    if not costs:
        print(f"no step with an observed time under {args.timeline}/<system>/<role>.jsonl")
        return 1
    print("\n".join(markdown(costs)))
    if args.json:
        args.json.write_text(json.dumps(costs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
