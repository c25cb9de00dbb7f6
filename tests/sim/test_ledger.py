"""The partition ledger: whole-device seconds booked interval by interval by the simulated device, and
the identity that makes it a ledger — work = busy − solo loss + co-run gain — on real runs."""

from __future__ import annotations

import json

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.sim.ledger import Ledger
from bullet.workloads.traces import build_workload


def test_intervals_are_booked_as_work_loss_and_gain():
    ledger = Ledger(total_units=10)
    ledger.solo(2.0, "decode", rate=0.5, units=4)  # alone on 4 of 10 units, at half the device's speed
    ledger.corun(1.0, rates={"prefill": 0.7, "decode": 0.5}, alone={"prefill": 0.8, "decode": 0.6},
                 units={"prefill": 6, "decode": 3})
    d = ledger.as_dict()
    assert d["busy_s"] == 3.0 and d["corun_s"] == 1.0 and d["solo_s"] == {"decode": 2.0}
    assert d["work_s"] == pytest.approx({"decode": 1.5, "prefill": 0.7})
    assert d["solo_loss_s"] == pytest.approx(1.0) and d["corun_gain_s"] == pytest.approx(0.2)
    assert d["split_gain_s"] == pytest.approx(0.4) and d["contention_loss_s"] == pytest.approx(0.2)
    assert d["idle_unit_s"] == pytest.approx(2 * 6 + 1) and d["corun_idle_unit_s"] == pytest.approx(1)
    assert d["corun_rate"] == pytest.approx(1.2) and d["mean_corun_units"] == {"prefill": 6, "decode": 3}
    assert d["work_total_s"] == pytest.approx(d["busy_s"] - d["solo_loss_s"] + d["corun_gain_s"])


@pytest.mark.parametrize("policy", ["bullet", "naive", "static:68"])
def test_a_run_balances_and_is_unchanged_by_the_accounting(policy):
    def run(ledger):
        config = SimConfig(policy=policy, hardware="h200", ttft_slo="3ms/token", tpot_slo="50ms", seed=1, ledger=ledger)
        return Simulation(config, build_workload("sharegpt", 30.0, 4.0, seed=1)).run()

    with_ledger, without = run(True), run(False)
    assert with_ledger.summary == without.summary  # booking changes nothing it books
    d = with_ledger.counters["ledger"]
    assert d["work_total_s"] == pytest.approx(d["busy_s"] - d["solo_loss_s"] + d["corun_gain_s"], rel=1e-9)
    assert d["corun_s"] == pytest.approx(with_ledger.device.corun_s)
    assert 0 < d["busy_s"] <= with_ledger.end_time and 0.0 <= d["idle_unit_fraction"] < 1.0
    if policy == "naive":  # both hold every unit: shared, none idle
        assert d["idle_unit_fraction"] == 0.0 and sum(d["mean_corun_units"].values()) == pytest.approx(132)
    if policy == "static:68":  # 68 + 64: the remainder goes with prefill, nothing idle while both run
        assert d["corun_idle_unit_s"] == pytest.approx(0.0, abs=1e-9)
    assert "ledger" not in without.counters


def test_the_ledger_tool_writes_its_tables(tmp_path):
    from artifact.partition_ledger import main

    assert main(["--workloads", "sharegpt", "--policies", "bullet", "naive", "--rates", "sharegpt=20",
                 "--seeds", "1", "--duration", "2", "--jobs", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ledger.json").read_text())
    assert {(r["policy"], r["seed"]) for r in data["rows"]} == {("bullet", 1), ("naive", 1)}
    assert set(data["summary"]["sharegpt"]) == {"bullet", "naive"}
    md = (tmp_path / "ledger.md").read_text()
    assert "SIMULATED" in md and "| bullet |" in md and "| naive |" in md


def test_the_ledger_tool_runs_a_built_in_device_without_a_profile(tmp_path):
    from artifact.partition_ledger import main

    assert main(["--workloads", "arxiv", "--policies", "bullet", "--rates", "arxiv=2", "--estimator-profile", "",
                 "--set", "hardware=a100", "--ttft-slo", "1.5ms/token", "--tpot-slo", "175ms", "--seeds", "1",
                 "--duration", "2", "--jobs", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ledger.json").read_text())
    assert data["header"].startswith("SIMULATED (built-in a100;") and data["overrides"]["hardware"] == "a100"
    assert data["rows"][0]["ledger"]["busy_s"] > 0
