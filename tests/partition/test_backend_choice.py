"""Cross-process partition candidates: the `mps-percentage` backend (MPS's per-client SM cap, fixed
at CUDA initialisation) and how `--partition-backend auto` picks a backend from the doctor's
isolation verdicts, keyed by GPU, driver and MPS on/off."""

from __future__ import annotations

import os

import pytest

from bullet.partition import PartitionUnavailable, make_backend
from bullet.partition.backend_choice import (
    choose_backend,
    read_isolation_verdicts,
    record_isolation_verdict,
)
from bullet.partition.mps_share import environment, fixed_split, percentage_for, units_for, worker_environment

H200, DRIVER_13 = "NVIDIA H200", 13000
ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def test_percentages_cover_the_share_and_back():
    assert percentage_for(64, 132) == 49 and units_for(49, 132) == 65  # rounded up both ways: never fewer SMs
    assert percentage_for(132, 132) == 100 and percentage_for(1, 132) == 1
    assert worker_environment("mps-percentage", 40, 132) == {ENV: "31"}
    assert worker_environment("green-ctx", 40, 132) == {}
    with pytest.raises(ValueError):
        percentage_for(0, 132)


def test_the_cap_is_fixed_and_apply_records_only_the_request():
    backend = make_backend("mps-percentage", "decode", total_units=132, env={ENV: "31"})
    assert backend.current_units == units_for(31, 132) == 41
    backend.apply(100)
    assert backend.current_units == 41 and backend.requested_units == 100
    backend.apply(8)
    assert backend.current_units == 41 and backend.describe()["requested_units"] == 8
    assert backend.apply_costs().count == 2
    assert backend.unit_set() == frozenset(range(132 - 41, 132))


@pytest.mark.parametrize("env,why", [({}, "not set"), ({ENV: "lots"}, "not a number"), ({ENV: "0"}, "outside"),
                                     ({ENV: "150"}, "outside")])
def test_a_missing_or_bad_cap_is_refused_with_the_reason(env, why):
    with pytest.raises(PartitionUnavailable, match=why):
        make_backend("mps-percentage", "prefill", total_units=132, env=env)


def test_verdicts_are_keyed_by_gpu_driver_and_mps_state(tmp_path):
    path = tmp_path / "verdicts.json"
    record_isolation_verdict("green-ctx", H200, DRIVER_13, True, "shared", "A keeps 51 %", path, kept_a=0.51)
    record_isolation_verdict("green-ctx", H200, DRIVER_13, False, "shared", "time-sliced", path)
    record_isolation_verdict("mps-percentage", H200, DRIVER_13, True, "disjoint", "both >= 90 %", path)
    on = read_isolation_verdicts(H200, DRIVER_13, True, path)
    assert on["green-ctx"]["outcome"] == "shared" and on["green-ctx"]["kept_a"] == 0.51
    assert on["mps-percentage"]["outcome"] == "disjoint" and "measured_at" in on["mps-percentage"]
    assert set(read_isolation_verdicts(H200, DRIVER_13, False, path)) == {"green-ctx"}
    assert read_isolation_verdicts(H200, 12080, True, path) == {}  # another driver: nothing measured
    record_isolation_verdict("green-ctx", H200, DRIVER_13, True, "disjoint", "re-measured", path)
    assert read_isolation_verdicts(H200, DRIVER_13, True, path)["green-ctx"]["outcome"] == "disjoint"


def verdicts(**outcomes) -> dict:
    return {b.replace("_", "-"): {"outcome": o, "measured_at": "2026-11-26 05:00:00"} for b, o in outcomes.items()}


def test_the_first_proven_candidate_wins_in_order_of_preference():
    all_proven = verdicts(green_ctx="disjoint", libsmctrl="disjoint", mps_percentage="disjoint")
    choice = choose_backend("cuda", all_proven, True, DRIVER_13, "/opt/libsmctrl.so", True)
    assert choice.backend == "green-ctx" and choice.proven and "MPS on" in choice.reason
    second = choose_backend("cuda", verdicts(green_ctx="shared", libsmctrl="disjoint", mps_percentage="disjoint"),
                            True, 12080, "/opt/libsmctrl.so")
    assert second.backend == "libsmctrl" and second.proven


def test_libsmctrl_needs_its_library_and_the_opt_in_past_its_driver_range():
    found = verdicts(green_ctx="shared", libsmctrl="disjoint", mps_percentage="disjoint")
    past_range = choose_backend("cuda", found, True, DRIVER_13, "/opt/libsmctrl.so", allow_untested_driver=False)
    assert past_range.backend == "mps-percentage" and "--allow-untested-driver" in past_range.reason
    no_library = choose_backend("cuda", found, True, 12080, None)
    assert no_library.backend == "mps-percentage" and "no library" in no_library.reason
    opted_in = choose_backend("cuda", found, True, DRIVER_13, "/opt/libsmctrl.so", allow_untested_driver=True)
    assert opted_in.backend == "libsmctrl"


def test_without_a_proven_candidate_green_ctx_runs_and_says_why():
    none_hold = choose_backend("cuda", verdicts(green_ctx="shared", mps_percentage="partial"), True, DRIVER_13)
    assert none_hold.backend == "green-ctx" and not none_hold.proven
    assert "green-ctx: shared" in none_hold.reason and "not enforced between the processes" in none_hold.reason
    never_measured = choose_backend("cuda", {}, True, DRIVER_13)
    assert not never_measured.proven and "run `bullet doctor`" in never_measured.reason
    mps_off = choose_backend("cuda", verdicts(green_ctx="shared"), False, DRIVER_13)
    assert not mps_off.proven and "MPS is off" in mps_off.reason
    assert choose_backend("cpu", {}, False, None).backend == "cpu"


def test_workers_start_with_a_split_and_their_cap_in_the_environment(monkeypatch):
    assert fixed_split(66, 66, 132) == (66, 66)  # static: its own split
    assert fixed_split(132, 132, 132) == (66, 66)  # bullet starts both on everything: half each instead
    monkeypatch.delenv(ENV, raising=False)
    with environment(worker_environment("mps-percentage", 66, 132)):
        assert os.environ[ENV] == "50"
        backend = make_backend("mps-percentage", "prefill", total_units=132)  # reads this process's environment
        assert backend.current_units == 66
    assert ENV not in os.environ
    monkeypatch.setenv(ENV, "80")
    with environment({ENV: "20"}):
        assert os.environ[ENV] == "20"
    assert os.environ[ENV] == "80"


def test_a_capped_worker_takes_the_devices_sm_count_from_the_launcher(monkeypatch):
    """Under its MPS cap a worker's torch reports the capped SM count (a fake GPU reporting 64 of an
    H200's 132 here): the worker takes the launcher's uncapped count from its spec, so a 49 % cap is 65
    SMs, not 49 % of 64 again; the doctor's isolation child is told the count the same way."""
    import torch

    from bullet.doctor.isolation_check import isolation_plan
    from bullet.partition.launch_stream import open_worker_partition
    from bullet.workers.wiring import backend_options
    from tests.partition.fake_cuda import FakeCuda

    monkeypatch.setenv(ENV, "49")
    spec = type("Spec", (), {"args": type("Args", (), {"partition_backend": "mps-percentage"})(), "total_units": 132,
                             "model": None, "cores": []})()
    options = backend_options(spec)
    assert options == {"total_units": 132}
    backend, _ = open_worker_partition("mps-percentage", "decode", torch.device("cuda", 0), options, FakeCuda(sms=64))
    assert backend.total_units == 132 and backend.current_units == units_for(49, 132) == 65
    blind, _ = open_worker_partition("mps-percentage", "decode", torch.device("cuda", 0), {}, FakeCuda(sms=64))
    assert blind.current_units == 32  # what counting under the cap gave: the cap applied twice
    mps = {b: flags for b, _, _, flags in isolation_plan(132, None, False)}["mps-percentage"]
    assert mps == ["--total-units", "132"]
