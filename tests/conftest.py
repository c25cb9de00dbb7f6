"""Shared test fixtures. Tests that need `../shared/data` skip with a reason when it is absent
(a user's clone may not have it; CI always does)."""

from __future__ import annotations

import os
import signal
import sys
import warnings
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
TESTS = Path(__file__).resolve().parent

# The quick lane (`pytest -m "not slow"`, a few minutes on 2 cores) leaves out these modules: each
# starts servers of its own, loads a reference model, measures a profile or runs a tool end to end
# (tens of seconds to minutes). It keeps every unit test, the import contract, the simulator's
# goldens, the default server of the HTTP tests (`tests/frontend/conftest.py`: a broken start fails
# every one of them) and one policy served end to end (below) — so it catches a broken import, a
# broken server start and a broken policy. CI runs everything.
SLOW_MODULES = {
    "artifact/test_bench_cpu_gemv.py", "artifact/test_bench_engine_gpu.py", "artifact/test_bench_engine_reference.py", "artifact/test_fuzz_soak.py", "artifact/test_loadgen.py",
    "artifact/test_router.py", "artifact/test_run_all.py", "artifact/test_work_bound.py",
    "cache/test_cached_outputs.py", "doctor/test_isolation.py",
    "engines/test_batching.py", "engines/test_engine_tensor_parallel.py", "engines/test_quantized.py", "engines/test_reference.py", "engines/test_sampling.py",
    "engines/test_served_cache.py",
    "estimator/test_local_profile.py",
    "frontend/test_bench_serving.py", "frontend/test_http_api_key.py", "frontend/test_http_capacity.py",
    "frontend/test_http_fuzz.py", "frontend/test_http_kv_full.py", "frontend/test_http_prefix_cache.py",
    "frontend/test_http_tokenizerless.py", "frontend/test_sglang_frontend.py", "frontend/test_tool_calls.py",
    "launcher/test_reliability.py", "launcher/test_tensor_parallel_serving.py", "launcher/test_two_process_runtime.py",
    "launcher/test_worker_failures.py",
    "policies/test_policies_served.py", "policies/test_priority_served.py",
}
# ... except these, the quick lane's proof that a policy serves (two workers, the estimator, greedy
# outputs equal to the offline engine's)
QUICK_ANYWAY = {"policies/test_policies_served.py::test_policy_serves_the_same_greedy_outputs[bullet]"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        if module in SLOW_MODULES and f"{module}::{item.name}" not in QUICK_ANYWAY:
            item.add_marker(pytest.mark.slow)


def _sigint_ignored() -> bool:
    """Whether this process ignores SIGINT, as the kernel sees it (a C library can set it too)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.fixture(autouse=True)
def _sigint_left_as_found(request):
    """A test that leaves this process ignoring SIGINT would make every later test's child processes
    ignore it too (ignored signals survive fork and exec), so a test of Ctrl-C behaviour fails or not
    by the order the tests ran in. Put it back and name the test that did it."""
    before, was_ignored = signal.getsignal(signal.SIGINT), _sigint_ignored()
    yield
    if _sigint_ignored() and not was_ignored:
        signal.signal(signal.SIGINT, before if before not in (None, signal.SIG_IGN) else signal.default_int_handler)
        warnings.warn(f"{request.node.nodeid} left SIGINT ignored in the test process; restored")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"reference data not found at {path} (present in CI, optional in a user's clone)")
    return path


@pytest.fixture(scope="session")
def fp32_srm_profile(tmp_path_factory) -> str:
    """An estimator profile of the embedded model in fp32 made of this CPU's probed rates alone (the
    SRM, no calibration; ~4 s): what a test server run with `--dtype float32 --policy bullet` is given
    when the test is about behaviour, not predictions — a measured quick profile costs ~40-50 s on a fresh
    2-core machine, and the default (int8) server of the HTTP tests still measures and caches its own,
    as a user's first launch does."""
    from engines.model_config import ModelConfig
    from estimator import Estimator, save_estimator
    from estimator.profiler.cpu_probe import probe_cpu

    path = tmp_path_factory.mktemp("srm-profile") / "smollm2-fp32.json"
    save_estimator(Estimator(ModelConfig.builtin("smollm2-135m"), probe_cpu(progress=False), dtype="fp32"), path)
    return str(path)
