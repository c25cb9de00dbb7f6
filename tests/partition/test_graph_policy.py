"""When decode runs as CUDA graphs: the decision from the doctor's recorded verdicts and the record
itself (a worker's graphs themselves: test_worker_graphs.py)."""

from __future__ import annotations

import pytest

from bullet.partition.graph_policy import (
    EAGER,
    OVERRIDE_ENV,
    PER_SHARE,
    SHARED,
    ReplayVerdict,
    decide_decode_graphs,
    decide_for_worker,
    read_replay_verdict,
    record_replay_verdict,
)
from tests.partition.fake_cuda import GPU

FOLLOWS = ReplayVerdict(direct=True, replay_same_partition=True, replay_after_repartition=True)
KEEPS_CAPTURE = ReplayVerdict(direct=True, replay_same_partition=True, replay_after_repartition=False)
ESCAPES = ReplayVerdict(direct=True, replay_same_partition=False, replay_after_repartition=False)
BROKEN = ReplayVerdict(direct=False, replay_same_partition=False)


@pytest.mark.parametrize("backend, verdict, override, mode", [
    ("libsmctrl", FOLLOWS, None, SHARED),
    ("libsmctrl", KEEPS_CAPTURE, None, PER_SHARE),
    ("libsmctrl", ESCAPES, None, EAGER),        # MuxWise's report: masks do not reach replays
    ("libsmctrl", ESCAPES, "on", EAGER),        # "on" never overrides a measured escape
    ("libsmctrl", BROKEN, None, EAGER),
    ("libsmctrl", None, None, EAGER),           # nothing measured: eager, and the reason says to run the doctor
    ("libsmctrl", None, "on", PER_SHARE),
    ("green-ctx", None, None, PER_SHARE),       # documented behaviour until the doctor says otherwise
    ("green-ctx", ReplayVerdict(True, False), None, EAGER),
    ("green-ctx", ReplayVerdict(True, True), None, PER_SHARE),
    ("none", None, None, SHARED),
    ("none", None, "off", EAGER),
    ("libsmctrl", FOLLOWS, "off", EAGER),
])
def test_decision_table(backend, verdict, override, mode):
    decision = decide_decode_graphs(backend, "cuda", verdict, override)
    assert decision.mode == mode, decision.reason
    assert decision.enabled == (mode != EAGER)


def test_no_graphs_on_a_cpu_and_reasons_say_what_to_do():
    assert decide_decode_graphs("cpu", "cpu", None).mode == EAGER
    assert "run `bullet doctor`" in decide_decode_graphs("libsmctrl", "cuda", None).reason
    with pytest.raises(ValueError, match=OVERRIDE_ENV):
        decide_decode_graphs("none", "cuda", None, "maybe")


def test_verdicts_are_recorded_per_gpu_and_driver(tmp_path):
    path = tmp_path / "verdicts.json"
    record_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, KEEPS_CAPTURE, path)
    record_replay_verdict("green-ctx", "NVIDIA H100 80GB HBM3", 12080, ReplayVerdict(True, True), path)
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, path) == KEEPS_CAPTURE
    assert read_replay_verdict("green-ctx", "NVIDIA H100 80GB HBM3", 12080, path).replay_same_partition
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12090, path) is None  # driver changed
    assert read_replay_verdict("libsmctrl", "NVIDIA A100-SXM4-80GB", 12080, path) is None
    record_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, ESCAPES, path)  # re-measured
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, path) == ESCAPES
    path.write_text("{not json")
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, path) is None


def test_a_worker_reads_the_record_of_its_gpu(tmp_path, monkeypatch):
    import bullet.partition.graph_policy as policy

    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(policy, "current_device_identity", lambda device=None, cuda=None: ("GPU-X", 12060))
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    assert decide_for_worker("libsmctrl", GPU).mode == EAGER
    record_replay_verdict("libsmctrl", "GPU-X", 12060, FOLLOWS)
    assert decide_for_worker("libsmctrl", GPU).mode == SHARED
    monkeypatch.setenv(OVERRIDE_ENV, "off")
    assert decide_for_worker("libsmctrl", GPU).mode == EAGER
