"""Shared test fixtures. Tests that need `../shared/data` skip with a reason when it is absent
(a user's clone may not have it; CI always does)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"reference data not found at {path} (present in CI, optional in a user's clone)")
    return path
