"""The simulated device: shares that overlap are split, contention slows co-running steps, and a
step charged partly alone and partly beside another pays each part at its own speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bullet.sim import Simulation
from bullet.sim.config import SimConfig, device_estimator, overlap_share, oversubscribed_slowdown
from bullet.sim.device import CPU_OVERSUBSCRIBED_SLOWDOWN, DecodeWork, PrefillWork, SimulatedDevice
from bullet.sim.events import EventLoop, VirtualClock
from bullet.sim.partition import SimulatedPartition, overlap
from estimator.analytic_contention import AnalyticContention
from estimator.contention import SharedUnitsPoint


@pytest.fixture(scope="module")
def est():
    return device_estimator(SimConfig())


def device(est, contention=True, overlap_share="demand"):
    loop = EventLoop(VirtualClock())
    return SimulatedDevice(est, loop, AnalyticContention(est) if contention else None, 0.0, 0, overlap_share), loop


def test_partition_rounds_up_to_tpcs_and_takes_opposite_ends(est):
    prefill, decode = SimulatedPartition("prefill", est.hardware), SimulatedPartition("decode", est.hardware)
    prefill.apply(33)
    decode.apply(80)
    assert prefill.current_units == 34 and decode.current_units == 80
    assert prefill.unit_mask() == sum(1 << u for u in prefill.unit_set())
    assert decode.unit_mask() == sum(1 << u for u in decode.unit_set())
    assert overlap(34, 80, 108) == len(prefill.unit_set() & decode.unit_set()) == 6


def test_overlapping_units_are_shared_by_demand_or_evenly(est):
    dev, _ = device(est)
    dev.start("prefill", PrefillWork((2048,), 4, False), 108, lambda e: None)
    dev.start("decode", DecodeWork(64, 64 * 1000), 108, lambda e: None)
    units = dev.effective_units()
    assert units["prefill"] + units["decode"] == pytest.approx(108)
    assert units["prefill"] == pytest.approx(108 * 16 / 17)  # 16 tile rows of prompt vs 1 of decode
    even, _ = device(est, overlap_share="even")
    even.start("prefill", PrefillWork((2048,), 4, False), 100, lambda e: None)
    even.start("decode", DecodeWork(64, 64 * 1000), 20, lambda e: None)
    assert even.effective_units() == {"prefill": pytest.approx(94.0), "decode": pytest.approx(14.0)}


def test_co_running_is_slower_than_alone_and_disjoint_shares_stay_whole(est):
    dev, _ = device(est)
    dev.start("decode", DecodeWork(128, 128 * 1500), 20, lambda e: None)
    alone = dev.latencies()["decode"]
    assert alone == pytest.approx(est.decode_time(128, 128 * 1500, 20))
    dev.start("prefill", PrefillWork((4096,), 4, False), 88, lambda e: None)
    corun = dev.latencies()
    assert dev.effective_units() == {"prefill": 88.0, "decode": 20.0}
    assert corun["decode"] > alone
    assert corun["prefill"] > est.prefill_time([4096], 88, num_layers=4, include_head=False)
    quiet, _ = device(est, contention=False)
    quiet.start("decode", DecodeWork(128, 128 * 1500), 20, lambda e: None)
    quiet.start("prefill", PrefillWork((4096,), 4, False), 88, lambda e: None)
    assert quiet.latencies()["decode"] == pytest.approx(alone)


def test_a_step_pays_each_part_at_the_speed_of_its_configuration(est):
    dev, loop = device(est)
    done = {}
    dev.start("decode", DecodeWork(128, 128 * 1500), 20, lambda e: done.setdefault("decode", e))
    alone = dev.latencies()["decode"]
    seen = {}

    def prefill_starts():
        dev.start("prefill", PrefillWork((4096,), 32, False), 88, lambda e: done.setdefault("prefill", e))
        seen["corun"] = dev.latencies()["decode"]

    loop.at(alone / 2, prefill_starts)
    loop.run()
    # half the decode step alone, the other half at the co-running rate
    assert done["decode"] == pytest.approx(alone / 2 + seen["corun"] / 2, rel=1e-9)
    assert done["decode"] > alone
    assert dev.stats.steps == {"decode": 1, "prefill": 1}
    assert dev.stats.corun_s == pytest.approx(seen["corun"] / 2, rel=1e-9)


def test_noise_stays_within_its_bounds_and_is_seeded(est):
    def elapsed(seed: int) -> list[float]:
        loop = EventLoop(VirtualClock())
        dev = SimulatedDevice(est, loop, None, 0.05, seed)
        out = []

        def step(k=0):
            if k < 50:
                dev.start("decode", DecodeWork(8, 8000), 108, lambda e: (out.append(e), step(k + 1)))

        step()
        loop.run()
        return out

    base = est.decode_time(8, 8000, 108)
    a, b, c = elapsed(1), elapsed(1), elapsed(2)
    assert a == b and a != c
    assert all(0.95 * base <= x <= 1.05 * base for x in a)
    assert max(a) - min(a) > 0.03 * base


@pytest.mark.parametrize("scale", [0.8, 1.5])
def test_a_corun_scale_prices_only_the_steps_that_run_side_by_side(est, scale):
    """`corun_scale`: a what-if for partitions that isolate worse (or better) than the profile —
    steps beside each other take `scale` times the model's co-run price; a step alone, none of it."""
    loop = EventLoop(VirtualClock())
    plain, _ = device(est)
    what_if = SimulatedDevice(est, loop, AnalyticContention(est), 0.0, 0, "demand", corun_scale=scale)
    for dev in (plain, what_if):
        dev.start("decode", DecodeWork(128, 128 * 1500), 20, lambda e: None)
    assert what_if.latencies() == plain.latencies()  # alone: as priced
    for dev in (plain, what_if):
        dev.start("prefill", PrefillWork((4096,), 4, False), 88, lambda e: None)
    side_by_side, priced = what_if.latencies(), plain.latencies()
    assert side_by_side == {role: pytest.approx(scale * t, rel=1e-12) for role, t in priced.items()}
    with pytest.raises(ValueError, match="corun_scale"):
        SimulatedDevice(est, loop, corun_scale=0.0)


def test_a_corun_scale_leaves_a_single_worker_system_alone():
    """chunked runs one worker: nothing of it ever co-runs, so the what-if changes none of its
    requests' latencies (bullet's, whose workers co-run, it does change)."""
    from bullet.sim import Simulation

    requests = [(0.02 * i, 600 + 50 * i, 12) for i in range(12)]
    runs = {}
    for policy in ("chunked:512", "bullet"):
        for scale in (1.0, 1.6):
            config = SimConfig(policy=policy, noise=0.0, step_overhead_s=0.0, corun_scale=scale)
            runs[policy, scale] = [(r.ttft, r.tpot) for r in Simulation(config, requests).run().records]
    assert runs["chunked:512", 1.0] == runs["chunked:512", 1.6]
    assert runs["bullet", 1.0] != runs["bullet", 1.6]


CPU_PROFILE = Path(__file__).resolve().parents[2] / "docs" / "served" / "amd-2026-12-01-a" / "profile.json"


@pytest.fixture(scope="module")
def cpu_est():
    return device_estimator(SimConfig(estimator_profile=str(CPU_PROFILE)))


def test_a_cpu_is_time_sliced_and_a_gpu_demand_shared_unless_told(est, cpu_est):
    assert cpu_est.hardware.kind == "cpu" and cpu_est.hardware.units == 2
    assert overlap_share(SimConfig(), cpu_est) == "time-sliced"
    assert overlap_share(SimConfig(), est) == "demand"
    assert overlap_share(SimConfig(overlap_share="even"), cpu_est) == "even"
    with pytest.raises(ValueError, match="measured"):  # the profile never timed both phases on shared units
        overlap_share(SimConfig(overlap_share="measured"), est)
    # what a shared core costs: the config's, else the profile's own measurement, else the served one
    assert cpu_est.contention.shared_units_slowdown() is None  # profiled before the profiler measured it
    assert oversubscribed_slowdown(SimConfig(), cpu_est) == CPU_OVERSUBSCRIBED_SLOWDOWN
    assert oversubscribed_slowdown(SimConfig(oversubscribed_slowdown=3.0), cpu_est) == 3.0
    measured = cpu_est.contention.model_copy(update={"shared_units": [SharedUnitsPoint(kind="prefill", factor=4.0),
                                                                      SharedUnitsPoint(kind="decode", factor=9.0)]})
    with_own = device_estimator(SimConfig(estimator_profile=str(CPU_PROFILE)))
    with_own.contention = measured
    assert oversubscribed_slowdown(SimConfig(), with_own) == pytest.approx(6.0)


def test_cores_both_workers_hold_cost_a_many_threaded_step_the_oversubscribed_slowdown(cpu_est):
    """Served on 2 cores, a step of two threads on cores the other worker's threads also held took ~7x its
    time alone (OpenMP barriers wait for the descheduled thread); the demand share priced the same pair
    as if the cores had made room for both (prefill kept ~2 cores and decode got 1: three cores' work)."""
    def pair(prefill_units, decode_units, slowdown=CPU_OVERSUBSCRIBED_SLOWDOWN):
        loop = EventLoop(VirtualClock())
        dev = SimulatedDevice(cpu_est, loop, None, 0.0, 0, "time-sliced", measured_corun=True,
                              oversubscribed_slowdown=slowdown)
        dev.start("prefill", PrefillWork((256,), 4, False), prefill_units, lambda e: None)
        dev.start("decode", DecodeWork(8, 8 * 300), decode_units, lambda e: None)
        return dev.latencies()

    alone_p = cpu_est.prefill_time([256], 2, num_layers=4, include_head=False)
    alone_d = cpu_est.decode_time(8, 8 * 300, 2)
    both = pair(2, 2)
    assert both == {"prefill": pytest.approx(alone_p * CPU_OVERSUBSCRIBED_SLOWDOWN),
                    "decode": pytest.approx(alone_d * CPU_OVERSUBSCRIBED_SLOWDOWN)}
    assert pair(2, 2, slowdown=2.0)["decode"] == pytest.approx(alone_d * 2.0)  # fair slices, no barrier cost
    # prefill's two threads wait on the core decode's one thread shares; decode's one thread runs as a
    # co-run on its core (served: 1.26x its time alone, against 7x for the two-thread prefill)
    handover = pair(2, 1)
    assert handover["prefill"] == pytest.approx(alone_p * CPU_OVERSUBSCRIBED_SLOWDOWN)
    assert handover["decode"] == pytest.approx(cpu_est.decode_time(8, 8 * 300, 1, co_prefill_tokens=256))
    disjoint = pair(1, 1)  # a core each: the profile's co-run table, untouched
    assert disjoint["prefill"] == pytest.approx(cpu_est.prefill_time([256], 1, num_layers=4, include_head=False,
                                                                     co_decode_batch=8))
    with pytest.raises(ValueError, match="oversubscribed_slowdown"):
        SimulatedDevice(cpu_est, EventLoop(VirtualClock()), oversubscribed_slowdown=0.5)


def test_a_gpu_profile_that_timed_both_phases_on_every_sm_prices_shared_sms_by_it():
    """A GPU profile with `shared_units` (each phase on every SM beside the other on every SM, two MPS
    clients) replaces the demand split, which hands SMs to each step by its demand for free: a step
    on SMs both workers hold takes its phase's measured factor times its time alone on its SMs; disjoint
    shares keep the co-run pricing; and a profile that timed only one phase cannot be 'measured'."""
    gpu = device_estimator(SimConfig())
    gpu.contention = gpu.contention.model_copy(update={"shared_units": [
        SharedUnitsPoint(kind="prefill", factor=1.3), SharedUnitsPoint(kind="decode", factor=2.2)]})
    assert overlap_share(SimConfig(), gpu) == "measured"
    assert overlap_share(SimConfig(overlap_share="demand"), gpu) == "demand"
    total = gpu.hardware.units

    def pair(mode, prefill_units, decode_units):
        dev = SimulatedDevice(gpu, EventLoop(VirtualClock()), None, 0.0, 0, mode,
                              shared_slowdowns={"prefill": 1.3, "decode": 2.2})
        dev.start("prefill", PrefillWork((2048,), 4, False), prefill_units, lambda e: None)
        dev.start("decode", DecodeWork(32, 32 * 1024), decode_units, lambda e: None)
        return dev.latencies()

    alone_p = gpu.prefill_time([2048], total, num_layers=4, include_head=False)
    alone_d = gpu.decode_time(32, 32 * 1024, total)
    assert pair("measured", total, total) == {"prefill": pytest.approx(alone_p * 1.3),
                                              "decode": pytest.approx(alone_d * 2.2)}
    assert pair("demand", total, total)["decode"] != pytest.approx(alone_d * 2.2)  # the split it replaces
    assert pair("measured", 80, total - 80) == pair("demand", 80, total - 80)  # disjoint: untouched
    gpu.contention = gpu.contention.model_copy(update={"shared_units": [SharedUnitsPoint(kind="decode", factor=2.2)]})
    assert overlap_share(SimConfig(), gpu) == "demand"
    with pytest.raises(ValueError, match="shared_slowdowns"):
        SimulatedDevice(gpu, EventLoop(VirtualClock()), None, 0.0, 0, "measured")


def test_a_simulation_of_such_a_profile_charges_naive_the_measured_factor(tmp_path):
    """Wired end to end: a profile file with `shared_units` makes `auto` price naive's steps (both
    workers on every SM) by it, and `--overlap-share demand` restores the assumed split."""
    from estimator.profile import EstimatorProfile
    from estimator.reference.profiles import H200_PROFILE

    profile = EstimatorProfile.read(H200_PROFILE)
    profile.contention.shared_units = [SharedUnitsPoint(kind="prefill", factor=1.5),
                                       SharedUnitsPoint(kind="decode", factor=2.5)]
    path = tmp_path / "h200-shared.json"
    profile.write(path)
    requests = [(0.01 * i, 900 + 40 * i, 16) for i in range(10)]

    def tpots(**extra):
        config = SimConfig(policy="naive", estimator_profile=str(path), noise=0.0, **extra)
        return [r.tpot for r in Simulation(config, requests).run().records]

    def sharing(**extra):  # what the run's summary says priced the shared units
        from bullet.sim.report import result_dict

        sim = Simulation(SimConfig(policy="naive", estimator_profile=str(path), **extra), requests[:2])
        return result_dict(sim.run(), sim)["device"]["shared_units"]

    assert sharing() == "priced by phase: prefill 1.50x, decode 2.50x its time alone (measured by the profile)"
    assert sharing(oversubscribed_slowdown=9.0).endswith("decode 9.00x its time alone (--oversubscribed-slowdown: a what-if)")
    assert sharing(overlap_share="demand") == "split by demand, thread-block rows (assumed, free)"

    measured, demand = tpots(), tpots(overlap_share="demand")
    # the demand split hands a 16-row decode beside a ~1,000-row prefill a sliver of the SMs (far worse
    # than 2.5x); the measured factor replaces it
    assert sum(measured) < sum(demand)
    assert sum(tpots(oversubscribed_slowdown=9.0)) > sum(measured)  # the what-if: both phases 9x on shared SMs


def test_shared_slowdown_prices_each_phase_on_shared_sms_as_a_what_if(tmp_path, cpu_est):
    """`shared_slowdown` ({"prefill": F, "decode": F}) replaces, phase by phase, the factor a step on SMs
    both workers hold pays: both phases equal to F give `--oversubscribed-slowdown F`'s run to the bit and
    the same as a profile that measured F for both; one phase named keeps the other's from the profile;
    a run that cannot price by phase, an unknown phase or a factor below 1 is refused."""
    from bullet.sim.config import shared_slowdowns
    from bullet.sim.report import result_dict
    from estimator.profile import EstimatorProfile
    from estimator.reference.profiles import H200_PROFILE

    requests = [(0.01 * i, 900 + 40 * i, 16) for i in range(10)]

    def run(profile=H200_PROFILE, **extra):
        sim = Simulation(SimConfig(policy="naive", estimator_profile=str(profile), noise=0.0, **extra), requests)
        return result_dict(sim.run(), sim)

    uniform = run(shared_slowdown={"prefill": 1.7, "decode": 1.7})
    assert uniform["summary"] == run(oversubscribed_slowdown=1.7)["summary"]
    assert uniform["device"]["shared_units"] == ("priced by phase: prefill 1.70x, decode 1.70x its time alone "
                                                 "(--shared-slowdown for prefill and decode: a what-if)")
    profile = EstimatorProfile.read(H200_PROFILE)
    profile.contention.shared_units = [SharedUnitsPoint(kind="prefill", factor=1.2),
                                       SharedUnitsPoint(kind="decode", factor=1.7)]
    path = tmp_path / "h200-shared.json"
    profile.write(path)
    # the profile measured prefill 1.2x; naming decode alone keeps that, naming both replaces it
    by_phase = run(shared_slowdown={"prefill": 1.2, "decode": 1.7})
    assert run(path)["summary"] == by_phase["summary"] != uniform["summary"]
    assert run(path, shared_slowdown={"decode": 1.7})["summary"] == by_phase["summary"]
    assert run(path, shared_slowdown={"prefill": 1.7})["summary"] == uniform["summary"]
    assert run(path, shared_slowdown={"decode": 2.5})["device"]["shared_units"].endswith(
        "decode 2.50x its time alone (--shared-slowdown for decode: a what-if, the other measured by the profile)")
    gpu = device_estimator(SimConfig(estimator_profile=str(path)))
    assert shared_slowdowns(SimConfig(oversubscribed_slowdown=3.0, shared_slowdown={"decode": 2.0}), gpu) == \
        {"prefill": 3.0, "decode": 2.0}

    plain = device_estimator(SimConfig(estimator_profile=str(H200_PROFILE)))  # measured no shared units
    assert overlap_share(SimConfig(shared_slowdown={"prefill": 1.2, "decode": 2.0}), plain) == "measured"
    with pytest.raises(ValueError, match="both prefill and decode need a factor"):
        overlap_share(SimConfig(shared_slowdown={"decode": 2.0}), plain)
    with pytest.raises(ValueError, match="'demand'"):
        overlap_share(SimConfig(overlap_share="demand", shared_slowdown={"prefill": 1.2, "decode": 2.0}), plain)
    with pytest.raises(ValueError, match="on cores, --oversubscribed-slowdown"):
        overlap_share(SimConfig(shared_slowdown={"prefill": 1.2, "decode": 2.0}), cpu_est)
    with pytest.raises(ValueError, match=r"not \['unified'\]"):
        shared_slowdowns(SimConfig(shared_slowdown={"unified": 2.0}), plain)
    with pytest.raises(ValueError, match="at least 1"):
        shared_slowdowns(SimConfig(shared_slowdown={"prefill": 0.8, "decode": 2.0}), plain)


def test_cli_shared_slowdown_takes_phase_factor_pairs_and_refuses_others(capsys):
    from bullet.cli import main
    from estimator.reference.profiles import H200_PROFILE

    base = ["simulate", "--estimator-profile", str(H200_PROFILE), "--policy", "naive", "--duration", "2",
            "--rate", "2", "--quiet", "--json", "-"]
    assert main(base + ["--shared-slowdown", "prefill=1.2", "decode=2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["shared_slowdown"] == {"prefill": 1.2, "decode": 2.0}
    assert data["device"]["shared_units"].startswith("priced by phase: prefill 1.20x, decode 2.00x")
    with pytest.raises(SystemExit):
        main(base + ["--shared-slowdown", "decode=0.5"])
    assert "expected PHASE=FACTOR" in capsys.readouterr().err
    assert main(base + ["--shared-slowdown", "decode=2"]) == 2  # nothing prices prefill by phase
    assert "both prefill and decode need a factor" in capsys.readouterr().err


def test_a_layerwise_decode_step_gives_units_up_at_its_next_layer_boundary(cpu_est):
    """A decode step on every core hears, at its next layer boundary, that a prefill started on cores it
    holds, and goes on with what it keeps — as the served CPU worker does (`decode_yield_at=layer`)."""
    loop = EventLoop(VirtualClock())
    dev = SimulatedDevice(cpu_est, loop, None, 0.0, 0, "time-sliced", measured_corun=True)
    layers, heard, ended = cpu_est.model.num_hidden_layers, [], []

    def at_layer(done: int) -> None:
        heard.append((loop.clock.now(), done))
        dev.resize("decode", 1)

    work = DecodeWork(8, 8 * 300)
    alone = cpu_est.decode_time(8, 8 * 300, 2)
    dev.start("decode", work, 2, ended.append, layers, at_layer)
    loop.at(alone * 2.5 / layers, dev.start, "prefill", PrefillWork((256,), 4, False), 2, lambda e: None)
    loop.run()
    # started 2.5 layers in: two whole layers behind it, oversubscribed until the end of the third
    (when, done), = heard
    assert done == 3
    assert when == pytest.approx(alone * 2.5 / layers + alone * 0.5 / layers * CPU_OVERSUBSCRIBED_SLOWDOWN)
    assert ended and alone < ended[0] < alone * CPU_OVERSUBSCRIBED_SLOWDOWN
    dev.start("decode", work, 2, lambda e: None)
    with pytest.raises(ValueError, match="units must lie in 1..2"):
        dev.resize("decode", 3)


def test_the_cpu_simulator_replays_the_served_ablation_ranking(tmp_path):
    """On the CPU device model, what the served 2-core run of 2026-12-01 measured (bullet 89-95 %,
    scheduler-only 67-71 %, naive 0-2 % at 5-7 req/s): the unpartitioned systems lose the cores they
    share, and scheduler-only's decode gives a core up between layers as served."""
    import random

    rng = random.Random(3)
    t, load = 0.0, []
    for _ in range(90):
        t += rng.expovariate(6.0)
        load.append((t, rng.choice([12, 40, 150, 300]), 64))
    base = dict(estimator_profile=str(CPU_PROFILE), max_total_tokens=32768, max_running_requests=64,
                ttft_slo="21.9ms/token", tpot_slo="287ms", step_time_scale=1.35, seed=1)

    def attained(policy, timeline=None):
        result = Simulation(SimConfig(**base, policy=policy, timeline_dir=timeline), load).run()
        ok = [r for r in result.records if r.ok and r.ttft <= 0.0219 * r.input_len
              and (r.tpot is None or r.tpot <= 0.287)]
        return len(ok) / len(load)

    bullet, scheduler_only, naive = attained("bullet"), attained("scheduler-only", str(tmp_path)), attained("naive")
    reasons = [json.loads(line).get("reason", "") for line in (tmp_path / "decode.jsonl").read_text().splitlines()]
    assert bullet > scheduler_only > naive and naive < 0.2
    assert any("gave units to prefill after layer" in r for r in reasons)
