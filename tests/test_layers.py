"""The package layering holds (import-linter contracts in pyproject.toml), the policy layer loads
without torch, and every function-local import of our own modules says why it is deferred."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bullet", "engines", "estimator", "artifact")


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (bash scripts/install.sh --test installs it)")
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    # every contract of pyproject.toml ran and held (among them bullet's own layers)
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken." in result.stdout, result.stdout[-3000:]


def test_policies_loops_and_simulator_import_without_torch():
    code = ("import sys, bullet.policies.factory, bullet.loops.factory, bullet.sim; "
            "heavy = sorted(m for m in ('torch', 'posix_ipc', 'zmq', 'bullet._shmatomic') if m in sys.modules); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the policy layer pulled in {out.stdout.strip()}"


def _local_imports(path: Path):
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.module and inner.module.split(".")[0] in PACKAGES:
                    yield inner.lineno, lines[inner.lineno - 1], lines[inner.lineno - 2]
                elif isinstance(inner, ast.Import) and any(a.name.split(".")[0] in PACKAGES for a in inner.names):
                    yield inner.lineno, lines[inner.lineno - 1], lines[inner.lineno - 2]


def test_every_deferred_import_of_our_own_modules_says_why():
    unexplained = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for lineno, line, before in _local_imports(path):
                if "# deferred:" not in line and "# deferred:" not in before:
                    unexplained.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not unexplained, "function-local imports without a '# deferred: <reason>' comment:\n" + "\n".join(unexplained)
