"""Shared test fixtures. Tests that need `../shared/data` skip with a reason when it is absent
(a user's clone may not have it; CI always does)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Triton picks compiled or interpreted kernels when it decorates them (its own library's at its
# import): without a GPU, the paged-attention kernel tests (tests/engines/test_triton_attention.py)
# run on CPU tensors under its interpreter, so it is turned on here, before any test module can
# import triton. It only concerns Triton code; nothing else on a CPU runs any.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"reference data not found at {path} (present in CI, optional in a user's clone)")
    return path
