"""On a machine with an NVIDIA GPU: the doctor's GPU checks must not FAIL. Skipped elsewhere — the
GPU path stays unverified until these have run on hardware (see DESIGN.md §7)."""

from __future__ import annotations

import pytest

from bullet.doctor import gpu_checks, mask_checks

NO_GPU = gpu_checks.gpu_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")]


def test_device_and_ipc():
    for result in (gpu_checks.check_cuda(None), gpu_checks.check_cuda_ipc(None)):
        assert result.status == "PASS", (result.summary, result.details)


def test_green_context_pools_confine_kernels():
    result = mask_checks.check_green_ctx_pools(None)
    assert result.status != "FAIL", (result.summary, result.details)


def test_libsmctrl_masks_confine_kernels_when_a_library_is_given():
    result = mask_checks.check_libsmctrl_masks(None, None, allow_untested=False)
    assert result.status != "FAIL", (result.summary, result.details)


def test_worker_stream_graphs_and_profiler_timing():
    from bullet.doctor import stream_checks

    for result in (stream_checks.check_worker_stream(None), stream_checks.check_decode_graphs(None),
                   stream_checks.check_profiler_timing(None)):
        assert result.status != "FAIL", (result.name, result.summary, result.details)

