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


def load_kernel_build(path: str | Path, name: str = "_cpu_gemv"):
    """Another build of one of the engine's C modules (`engines._cpu_gemv` by default, or
    `_cpu_attention`): a `.so` file, or a source tree whose `engines/` holds one (built there with
    `python setup.py build_ext --inplace`, e.g. in a `git worktree` of an older commit). Loaded beside
    this tree's own build, so one run times both."""
    import importlib.util

    path = Path(path)
    if path.is_dir():
        found = sorted((path / "engines").glob(f"{name}*.so"))
        if not found:
            raise SystemExit(f"--against {path}: no engines/{name}*.so there (build it: cd {path} && "
                             "python setup.py build_ext --inplace)")
        path = found[0]
    if not path.is_file():
        raise SystemExit(f"--against {path}: no such file")
    spec = importlib.util.spec_from_file_location(name, path)  # the module's init is named after it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def kernel_build(module, wrapper: str = "cpu_gemv"):
    """`with kernel_build(module):` — `engines.model.cpu_gemv` (or the `wrapper` module of
    engines.model named) calls `module` (another build) inside."""
    import importlib

    around = importlib.import_module(f"engines.model.{wrapper}")  # deferred: torch loads only where builds swap
    kept, around._ext = around._ext, module
    try:
        yield module
    finally:
        around._ext = kept
