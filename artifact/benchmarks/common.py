"""Helpers shared by the benchmark scripts: where results go, how tables print."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(os.environ.get("BULLET_RESULTS_DIR", Path(__file__).resolve().parents[1] / "results"))


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def print_table(rows: list[dict], columns: list[str], title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in columns])
    # a log file or pipe gets the whole table, not one cut to an 80-column guess
    Console(width=None if sys.stdout.isatty() else 200).print(table)
