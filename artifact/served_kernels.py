"""What each served system's workers said about their kernels, read back from their step
timelines (`bullet.workers.kernel_stats`): Triton compiles while serving (after the start-up
warm-up; the goal is none) and kernels that fell back to torch lines, per system and role.

  python -m artifact.served_kernels logs/timeline     # one folder per system, <role>.jsonl in each

A row carries the fields only once they are non-zero, so a system whose rows have none compiled
nothing while serving and gave up on no kernel."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def role_kernels(path: Path) -> dict:
    """{"triton_compiles": the most any row says, "kernel_fallbacks": every fallback any row lists,
    "rows": rows read} for one role's timeline."""
    compiles, fallbacks, rows = 0, [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rows += 1
            if "triton_compiles" not in line and "kernel_fallbacks" not in line:
                continue  # the common row: nothing to parse for
            row = json.loads(line)
            compiles = max(compiles, int(row.get("triton_compiles", 0)))
            fallbacks += [f for f in row.get("kernel_fallbacks", []) if f not in fallbacks]
    return {"triton_compiles": compiles, "kernel_fallbacks": fallbacks, "rows": rows}


def served_kernels(timelines: Path) -> dict:
    """{system: {role: role_kernels(...)}} for each system folder under `timelines` (or, for a
    folder of <role>.jsonl files itself, under its own name)."""
    timelines = Path(timelines)
    folders = [timelines] if list(timelines.glob("*.jsonl")) else sorted(p for p in timelines.iterdir() if p.is_dir())
    return {folder.name: {path.stem: role_kernels(path) for path in sorted(folder.glob("*.jsonl"))}
            for folder in folders if list(folder.glob("*.jsonl"))}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.split("\n\n")[1])
        return 2
    for system, roles in served_kernels(Path(args[0])).items():
        for role, r in roles.items():
            print(f"{system} {role}: {r['triton_compiles']} Triton compiles while serving, "
                  f"{len(r['kernel_fallbacks'])} kernel fallbacks ({r['rows']} timeline rows)")
            for line in r["kernel_fallbacks"]:
                print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
