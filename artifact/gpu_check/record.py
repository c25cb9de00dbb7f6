"""Which device plan last ran, where and when: `docs/gpu/plans.json` in the repository.

Each run of a GPU plan writes its entry (commit, start date, GPU, report folder, the steps it ran
with their status) into `plans.json` beside its report folder, starting from the newest entries of
the record it was given (the checkout's `docs/gpu/plans.json`, and one already beside the report
folder): copying the report folder and `plans.json` back into `docs/gpu/` and committing them
updates the record.

`--plan stalest` reads it: plans never run first (in the plans' own order), then the oldest last
run; on a tie of dates, the plan with more steps that never ran, then the plans' own order."""

from __future__ import annotations

import json
from pathlib import Path

NOTE = ("Which device plan (artifact/gpu_check/plan.py) last ran at which commit and date; written by "
        "scripts/gpu_check.sh beside its report folder, read by `--plan stalest`.")


def load(*paths: Path) -> dict:
    """{plan: entry}: the newest entry of each plan over the records at `paths` (missing ones are empty)."""
    out: dict = {}
    for path in paths:
        try:
            plans = json.loads(Path(path).read_text()).get("plans", {})
        except (OSError, ValueError):
            continue
        for name, entry in plans.items():
            if name not in out or entry.get("date", "") > out[name].get("date", ""):
                out[name] = entry
    return out


def never_ran(entry: dict | None, steps: tuple[str, ...]) -> list[str]:
    """The plan's steps that no recorded run of it ran."""
    ran = set((entry or {}).get("steps", {}))
    return [s for s in steps if s not in ran]


def stalest(record: dict, plans: dict[str, tuple[str, ...]]) -> str:
    """The plan to run next, of `plans` ({name: its steps}, in their order)."""
    order = list(plans)

    def key(name: str):
        entry = record.get(name)
        missing = len(never_ran(entry, plans[name])) if entry is not None else 0
        return entry is not None, (entry or {}).get("date", ""), -missing, order.index(name)

    return min(order, key=key)


def lines(record: dict, plans: dict[str, tuple[str, ...]]) -> list[str]:
    """Each plan's last run, for the dry run and the progress log."""
    out = []
    for name, steps in plans.items():
        e = record.get(name)
        if e is None:
            out.append(f"  {name:<10} never run")
            continue
        missing = never_ran(e, steps)
        out.append(f"  {name:<10} {e.get('date', '?')} at {str(e.get('commit', '?'))[:12]} on {e.get('gpu', '?')}"
                   f" ({e.get('report', '?')})" + (f"; never ran: {', '.join(missing)}" if missing else ""))
    return out


def entry(results: dict, folder: Path | None) -> dict | None:
    """This run's entry, from its results; None when it ran nothing but the setup (no news)."""
    m, run = results.get("machine", {}), results.get("run", {})
    steps = {name: s.get("status") for name, s in results.get("steps", {}).items() if s.get("status") != "skipped"}
    if not set(steps) - {"env", "install", "build", "mps-start", "mps-stop"}:
        return None
    return {"date": m.get("started_utc") or run.get("started_utc"), "commit": m.get("commit", "unknown"),
            "gpu": m.get("gpu") or "no GPU", "driver": m.get("driver"), "report": folder.name if folder else None,
            "command": run.get("command"), "steps": steps}


def update(path: Path, plan: str, new: dict, *bases: Path) -> dict:
    """Write the record at `path`: the newest entries of `path` and `bases`, and `new` for `plan`."""
    plans = load(path, *bases)
    plans[plan] = new
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"note": NOTE, "plans": dict(sorted(plans.items()))}, indent=1) + "\n")
    return plans
