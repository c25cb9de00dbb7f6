"""On a machine with an NVIDIA GPU: the doctor's GPU checks must PASS. A check the doctor skipped (no
libsmctrl given, a driver without green contexts) is reported as a skipped test with the doctor's reason,
never as a passed one. Skipped elsewhere — the GPU path stays unverified until these have run on
hardware (see DESIGN.md §7)."""

from __future__ import annotations

import pytest

from bullet.doctor import gpu_checks, mask_checks

NO_GPU = gpu_checks.gpu_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")]


def must_pass(result) -> None:
    """PASS, or a skip that says why: a check that did not run proves nothing, so it cannot pass."""
    if result.status == "SKIP":
        pytest.skip(f"{result.name}: {result.summary}")
    assert result.status == "PASS", (result.name, result.summary, result.details)


def test_device_and_ipc():
    for result in (gpu_checks.check_cuda(None), gpu_checks.check_cuda_ipc(None)):
        assert result.status == "PASS", (result.summary, result.details)


def test_green_context_pools_confine_kernels():
    must_pass(mask_checks.check_green_ctx_pools(None))


def test_libsmctrl_masks_confine_kernels_when_a_library_is_given():
    must_pass(mask_checks.check_libsmctrl_masks(None, None, allow_untested=False))


def test_worker_stream_graphs_and_profiler_timing():
    from bullet.doctor import stream_checks

    results = [stream_checks.check_worker_stream(None), stream_checks.check_decode_graphs(None),
               stream_checks.check_profiler_timing(None)]
    for result in results:
        assert result.status in ("PASS", "SKIP"), (result.name, result.summary, result.details)
    for result in results:
        must_pass(result)

