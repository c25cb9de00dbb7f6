"""On a machine with an NVIDIA GPU: the isolation probe counts SMs. Skipped elsewhere.

* the control (no partition, both sides on every SM) must come out shared, and a side alone must
  count about every SM of the device — else the probe measures something other than SMs;
* two green contexts in one process (disjoint by construction) must come out disjoint, each side
  counting about the SMs it was granted, also when its spins are replayed from a CUDA graph.
A configuration that could not run fails here: a check that did not run proves nothing."""

from __future__ import annotations

import pytest

from artifact.gpu_check import sm_probe
from bullet.doctor import gpu_checks

NO_GPU = gpu_checks.gpu_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")]

CONFIGS = {c.name: c for c in sm_probe.GPU_CONFIGS}


def _measure(name: str) -> dict:
    total = sm_probe.device_sms()
    assert total, "torch sees no GPU"
    result = sm_probe.measure(CONFIGS[name], "cuda", total, kinds=("spin",), phase_s=0.3, rounds=2)
    assert result["verdict"]["outcome"] != "failed", result["verdict"]
    return result


def test_without_a_partition_both_sides_share_every_sm():
    result = _measure("none-1proc")
    eff = result["rates"]["spin"]["effective_units"]
    assert eff["alone_A"] == pytest.approx(result["total"], rel=0.05), eff
    assert result["verdict"]["outcome"] == "shared", result["verdict"]


def test_two_green_contexts_in_one_process_are_disjoint_and_graphs_stay_inside():
    result = _measure("green-ctx-1proc")
    eff = result["rates"]["spin"]["effective_units"]
    for side in "AB":
        assert eff[f"alone_{side}"] == pytest.approx(result["units"][side], rel=0.05), (side, eff, result["units"])
        assert result["graph"][side]["outcome"] == "held", result["graph"][side]
    assert result["verdict"]["outcome"] == "disjoint", result["verdict"]
