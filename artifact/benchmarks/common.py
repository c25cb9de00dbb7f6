"""Helpers shared by the benchmark scripts: where results go, how tables print."""

from __future__ import annotations

import contextlib
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


def load_kernel_build(path: str | Path):
    """Another build of the few-row kernel module (`engines._cpu_gemv`): a `.so` file, or a source tree
    whose `engines/` holds one (built there with `python setup.py build_ext --inplace`, e.g. in a
    `git worktree` of an older commit). Loaded beside this tree's own build, so one run times both."""
    import importlib.util

    path = Path(path)
    if path.is_dir():
        found = sorted((path / "engines").glob("_cpu_gemv*.so"))
        if not found:
            raise SystemExit(f"--against {path}: no engines/_cpu_gemv*.so there (build it: cd {path} && "
                             "python setup.py build_ext --inplace)")
        path = found[0]
    if not path.is_file():
        raise SystemExit(f"--against {path}: no such file")
    spec = importlib.util.spec_from_file_location("_cpu_gemv", path)  # the module's init names it _cpu_gemv
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def kernel_build(module):
    """`with kernel_build(module):` — `engines.model.cpu_gemv` calls `module` (another build) inside."""
    from engines.model import cpu_gemv  # deferred: torch loads only in the benchmarks that swap builds

    kept, cpu_gemv._ext = cpu_gemv._ext, module
    try:
        yield module
    finally:
        cpu_gemv._ext = kept
