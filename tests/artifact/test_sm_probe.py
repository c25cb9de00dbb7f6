"""The SM-counting isolation probe on a CPU: its kernels compile with nvcc, its verdict arithmetic,
its NVML sampling (a stand-in NVML: the real one needs a driver), and its orchestration run for real
with cores as units — two processes, or one, spin threads pinned to disjoint cores."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifact.gpu_check import sm_probe, sm_probe_kernels, sm_probe_report, wheels
from artifact.gpu_check.nvml_sampler import NvmlSampler, reason_names, summarise
from artifact.gpu_check.plan import MECHANISM
from artifact.gpu_check.sm_probe_loops import overlapping_blocks
from artifact.gpu_check.sm_probe_verdict import DISJOINT_KEEP, NOISE_LIMIT, judge_graph, judge_spin, overlap_fraction
from artifact.gpu_check.steps import Context
from bullet.doctor.smid_probe import find_nvcc
from bullet.partition.libsmctrl import ALLOW_UNTESTED_ENV

CORES = sorted(os.sched_getaffinity(0))
QUIET = 0.9  # a side alone got at least this much of its core: other load did not decide the rates


# -- the kernels ------------------------------------------------------------------------------------
@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
def test_probe_kernels_compile_for_hopper_and_export_every_launcher(tmp_path):
    lib = sm_probe_kernels.build("90", out_dir=tmp_path)
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    for name in ("sm_probe_abi_version", "sm_probe_init", "sm_probe_spin", "sm_probe_fma", "sm_probe_copy",
                 "sm_probe_sync", "sm_probe_graph_capture", "sm_probe_graph_launch", "sm_probe_graph_destroy"):
        assert f" T {name}\n" in symbols, name
    assert sm_probe_kernels.build("90", out_dir=tmp_path) == lib  # cached by the source's hash


def test_the_spin_kernel_asks_for_more_than_half_an_sm_of_shared_memory():
    text = sm_probe_kernels.SOURCE.read_text()
    assert "%globaltimer" in text and "cudaDevAttrMaxSharedMemoryPerBlockOptin" in text
    assert "2 * optin <= per_sm" in text  # refuses a device where two such blocks would fit


# -- the verdict ------------------------------------------------------------------------------------
UNITS = {"A": 66, "B": 66}


def test_both_sides_keeping_their_spin_rate_are_disjoint():
    v = judge_spin({"A": [100, 101], "B": [200, 199]}, {"A": [99, 100], "B": [198, 197]}, UNITS)
    assert v["outcome"] == "disjoint" and min(v["kept"].values()) >= DISJOINT_KEEP


def test_half_the_rate_each_is_one_set_of_sms_or_time_slicing():
    v = judge_spin({"A": [100, 100], "B": [100, 100]}, {"A": [50, 51], "B": [49, 50]}, UNITS)
    assert v["outcome"] == "shared" and v["overlap_fraction"]["A"] == pytest.approx(1.0, abs=0.03)


def test_a_partial_overlap_is_estimated_from_the_spin_rate():
    v = judge_spin({"A": [100, 100], "B": [100, 100]}, {"A": [80, 80], "B": [90, 90]}, UNITS)
    assert v["outcome"] == "partial"
    # kept = (S - o/2) / S: 0.8 -> o = 0.4 S, 0.9 -> 0.2 S
    assert v["overlap_units"] == {"A": pytest.approx(26.4), "B": pytest.approx(13.2)}
    assert overlap_fraction(1.02) == 0.0 and overlap_fraction(0.3) == 1.0


def test_power_limited_clocks_do_not_move_the_verdict_only_a_side_below_097_does():
    # a GEMM-like 0.75 would be "partial"; the spin probe at 0.975 is still disjoint, at 0.96 not
    assert judge_spin({"A": [100], "B": [100]}, {"A": [97.5], "B": [99]}, UNITS)["outcome"] == "disjoint"
    assert judge_spin({"A": [100], "B": [100]}, {"A": [96], "B": [99]}, UNITS)["outcome"] == "partial"


def test_noisy_alone_rounds_and_missing_rates_are_named():
    assert judge_spin({"A": [100, 130], "B": [100, 100]}, {"A": [100], "B": [100]}, UNITS)["outcome"] == "noisy"
    assert judge_spin({"A": [100], "B": []}, {"A": [100], "B": [100]}, UNITS)["outcome"] == "failed"
    assert judge_spin({"A": [0], "B": [1]}, {"A": [1], "B": [1]}, UNITS)["outcome"] == "failed"


def test_a_side_that_alone_counts_far_fewer_units_than_granted_cannot_be_judged():
    v = judge_spin({"A": [100], "B": [100]}, {"A": [100], "B": [100]}, UNITS, effective_alone={"A": 40.0, "B": 65.0})
    assert v["outcome"] == "noisy" and "A alone counted 40.00 of its 66 units" in v["summary"]
    loose = judge_spin({"A": [100], "B": [100]}, {"A": [50], "B": [50]}, UNITS,
                       effective_alone={"A": 131.0, "B": 130.0})
    assert loose["outcome"] == "shared" and "not restricted" in loose["summary"]


def test_blocks_sharing_an_sm_break_the_probes_premise():
    assert overlapping_blocks([0, 0, 1, 1], [1_000, 201_000, 5_000, 205_000], 200_000) == 0
    assert overlapping_blocks([0, 0, 1, -1], [1_000, 3_000, 5_000, 0], 200_000) == 1
    v = judge_spin({"A": [100], "B": [100]}, {"A": [100], "B": [100]}, UNITS, shared_sm_blocks=3)
    assert v["outcome"] == "failed" and "one block per SM" in v["summary"]


def test_a_graph_replay_counting_more_sms_than_the_share_escaped_it():
    assert judge_graph(65.0, 65.5, 66, 132)["outcome"] == "held"
    escaped = judge_graph(65.0, 131.0, 66, 132)
    assert escaped["outcome"] == "escaped" and "131.0 of 132" in escaped["summary"]
    assert judge_graph(None, 60.0, 66, 132)["outcome"] == "failed"


def test_the_markdown_section_shows_verdicts_counts_clocks_graphs_and_skips():
    report = {"nvml_missing": None, "configs": [
        {"config": "green-ctx-1proc", "units": {"A": 68, "B": 64},
         "verdict": {"outcome": "disjoint", "kept": {"A": 0.995, "B": 0.991}, "summary": "..."},
         "rates": {"spin": {"effective_units": {"alone_A": 67.2, "alone_B": 63.4}},
                   "fma": {"kept": {"A": 0.93, "B": 0.94}}, "copy": {"error": "boom"}},
         "nvml": {"spin/together": summarise([{"sm_mhz": 1755, "power_w": 612.0, "reasons": 0x4}])},
         "graph": {"A": judge_graph(67.2, 131.0, 68, 132)}},
        {"config": "libsmctrl-mps", "skipped": "no libsmctrl library"}]}
    text = sm_probe_report.markdown(report)
    row = "| green-ctx-1proc | **disjoint** | 0.995 / 0.991 | 67.2 / 63.4 (68 / 64) | 0.930 / 0.940 | error |"
    assert row in text
    assert "1755 (1755-1755) | 612 | sw_power_cap 100% |" in text
    assert "side A: **escaped**" in text and "| libsmctrl-mps | skipped: no libsmctrl library |" in text


# -- NVML -------------------------------------------------------------------------------------------
class StandInNvml:
    """pynvml's calls the sampler makes, answering like a power-capped GPU (SM clock falling)."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self):
        self.sm = 1980
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetClockInfo(self, h, kind):
        if kind == self.NVML_CLOCK_SM:
            self.sm = max(1500, self.sm - 10)
            return self.sm
        return 3201

    def nvmlDeviceGetPowerUsage(self, h):
        return 700_000  # mW

    def nvmlDeviceGetTemperature(self, h, sensor):
        raise RuntimeError("not supported")  # an unsupported query leaves its field empty

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4  # sw power cap


def test_nvml_phases_summarise_clocks_power_and_limit_reasons():
    nvml = StandInNvml()
    sampler = NvmlSampler(nvml=nvml, period_s=0.002)
    with sampler.phase("spin/together"):
        time.sleep(0.05)
    with sampler.phase("spin/together"):  # a second round adds to the same phase
        time.sleep(0.02)
    s = sampler.phases["spin/together"]
    assert s["samples"] >= 5 and s["power_w"]["median"] == 700.0 and s["mem_mhz"]["max"] == 3201
    assert s["sm_mhz"]["min"] < s["sm_mhz"]["max"] <= 1980 and s["temp_c"] is None
    assert s["reasons"] == {"sw_power_cap": 1.0}
    sampler.close()
    assert nvml.shut


def test_without_nvml_every_phase_says_so_and_nothing_raises():
    class Broken:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    sampler = NvmlSampler(nvml=Broken())
    with sampler.phase("p"):
        pass
    assert not sampler.available and "libnvidia-ml" in sampler.phases["p"]["missing"]
    assert reason_names(0x4 | 0x40 | 0x10000) == ["sw_power_cap", "hw_thermal_slowdown", "0x10000"]
    assert summarise([]) == {"samples": 0}


def test_the_device_run_carries_nvidia_ml_py():
    assert any(p.name == "nvidia-ml-py" for p in wheels.read_pins())


# -- the orchestration, on cores --------------------------------------------------------------------
OTHERS_MAX = 0.1  # of the machine's cores, on average over a probe, taken by processes other than ours


def _quiet_enough(result: dict) -> bool:
    eff = result["rates"]["spin"]["effective_units"]
    return min(eff["alone_A"], eff["alone_B"]) >= QUIET


def _declined(verdict: dict) -> tuple[str, ...]:
    """("noisy",) where the verdict declined to judge because a side's alone rounds differed by more than
    its noise limit — on a shared 2-core VM one round in ten can (a CI run: 10.7 % with each side alone on
    its core at full rate); the kept fractions beside it still have to say what the cores did."""
    return ("noisy",) if verdict["outcome"] == "noisy" and verdict["spread"] > NOISE_LIMIT else ()


def _busy_seconds() -> float:
    """CPU seconds every process has run on this process's cores (user, nice, system, irq, softirq),
    from /proc/stat's per-CPU lines."""
    ticks = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in CORES:
                ticks += sum(int(fields[i]) for i in (0, 1, 2, 5, 6))
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measured_alone(probe):
    """`probe()`'s result, and the share of the machine's cores other processes took while it ran. The
    sides' alone phases cannot see a single other process: it runs on the idle core while a side runs
    alone, and halves a side when both run (a CI run beside another job measured kept 0.49 and 0.85)."""
    busy, own, began = _busy_seconds(), _own_seconds(), time.monotonic()
    result = probe()
    wall = time.monotonic() - began
    others = max(0.0, (_busy_seconds() - busy) - (_own_seconds() - own)) / (wall * len(CORES))
    return result, others


@pytest.mark.slow  # two processes that import torch, nine timed phases: ~10-20 s on two cores
@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
@pytest.mark.parametrize("config", sm_probe.CPU_CONFIGS, ids=lambda c: c.name)
def test_one_core_each_comes_out_disjoint(config):
    # graph=True walks the graph-replay phase too (a CPU has no graphs: the replay is the same spin)
    result, others = measured_alone(lambda: sm_probe.measure(
        dataclasses.replace(config, graph=True), "cpu", 2, kinds=("spin",), phase_s=0.25, rounds=3,
        extra=["--cores", f"{CORES[0]},{CORES[1]}"]))
    assert "rates" in result, result["verdict"]
    assert result["units"] == {"A": 1, "B": 1}
    assert result["unit_sets"] == {"A": str(CORES[0]), "B": str(CORES[1])}
    spin = result["rates"]["spin"]
    assert all(len(spin[w][n]) == 3 for w in ("alone", "together") for n in "AB")
    assert set(result["graph"]) == {"A", "B"} and all(g["share"] == 1 for g in result["graph"].values())
    assert f"| {config.name} | **{result['verdict']['outcome']}** |" in sm_probe_report.markdown({"configs": [result]})
    if not _quiet_enough(result) or others > OTHERS_MAX:  # other processes, not the shares, set the rates
        pytest.skip(f"machine busy: alone each side got {spin['effective_units']} cores (< {QUIET}?), other "
                    f"processes {others:.0%} of the cores (> {OTHERS_MAX:.0%}?); verdict {result['verdict']['summary']}")
    # on two cores this test's own process and the machine's housekeeping share the sides' cores, so a
    # side may keep 0.9 of its rate or less with nothing shared (CI runs measured 0.89, and 0.77 beside a
    # side that kept 0.88): disjoint or nearly — the two together keep more than halfway from the one-core
    # control's ~1.0 (the test below: < 1.15) to 2, and neither is down at the control's ~0.5
    v = result["verdict"]
    assert v["outcome"] in ("disjoint", "partial", *_declined(v)), v
    assert sum(v["kept"].values()) >= 1.5 and min(v["kept"].values()) >= 0.65, v


@pytest.mark.slow  # as above
@pytest.mark.skipif(len(CORES) < 1, reason="needs a core")
def test_two_sides_on_one_core_are_not_disjoint():
    # the control: both processes divide one core, so each holds that same core
    result, others = measured_alone(lambda: sm_probe.measure(
        sm_probe.CPU_CONFIGS[0], "cpu", 2, kinds=("spin",), phase_s=0.25, rounds=3, extra=["--cores", str(CORES[0])]))
    assert result["unit_sets"] == {"A": str(CORES[0]), "B": str(CORES[0])}
    v = result["verdict"]
    if not _quiet_enough(result) or others > OTHERS_MAX:
        pytest.skip(f"machine busy: alone each side got {result['rates']['spin']['effective_units']} cores "
                    f"(< {QUIET}?), other processes {others:.0%} of the cores (> {OTHERS_MAX:.0%}?); "
                    f"verdict {v['summary']}")
    assert v["outcome"] in ("shared", *_declined(v)) and sum(v["kept"].values()) < 1.15, v


def test_a_side_that_cannot_start_fails_the_configuration_not_the_run():
    config = sm_probe.Config("libsmctrl-on-cpu", "libsmctrl")
    result = sm_probe.measure(config, "cpu", 2, kinds=("spin",), phase_s=0.1, rounds=1, timeout=60)
    assert result["verdict"]["outcome"] == "failed" and "side B" in result["verdict"]["summary"]


def test_gpu_configurations_are_skipped_with_their_reasons():
    report = sm_probe.run_configs(sm_probe.GPU_CONFIGS, "cpu", 132, kinds=sm_probe.KINDS, phase_s=0.4, rounds=2,
                                  deadline=time.monotonic(), log=lambda m: None)
    why = {c["config"]: c["skipped"] for c in report["configs"]}
    assert set(why) == {c.name for c in sm_probe.GPU_CONFIGS}
    assert "no libsmctrl library" in why["libsmctrl-mps"]
    assert "needs MPS" in why["mps-percentage"] and "no time left" in why["green-ctx-1proc"]
    names = [c.name for c in sm_probe.GPU_CONFIGS]
    assert set(names) == {"green-ctx-1proc", "green-ctx-2proc", "green-ctx-2proc-mps", "mps-percentage",
                          "libsmctrl-mps", "none-1proc"}
    assert sm_probe.skip_reason(sm_probe.GPU_CONFIGS[2], None, True, False, manage_mps=False).startswith("needs MPS on")
    assert sm_probe.skip_reason(sm_probe.GPU_CONFIGS[2], None, True, False, manage_mps=True) is None


def test_libsmctrl_is_opted_into_only_after_its_masks_came_out_disjoint():
    env: dict = {}
    skipped = {"configs": [{"config": "libsmctrl-mps", "skipped": "no libsmctrl library"}]}
    assert sm_probe._opt_in_libsmctrl(skipped, env).startswith("not set") and not env
    partial = {"configs": [{"config": "libsmctrl-mps", "verdict": {"outcome": "partial"}}]}
    assert "came out partial" in sm_probe._opt_in_libsmctrl(partial, env) and not env
    disjoint = {"configs": [{"config": "libsmctrl-mps", "verdict": {"outcome": "disjoint"}}]}
    assert sm_probe._opt_in_libsmctrl(disjoint, env).startswith("set") and env == {ALLOW_UNTESTED_ENV: "1"}


def test_the_probe_step_without_a_gpu_is_an_error_not_a_crash(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    ctx = Context(root=tmp_path, plan=MECHANISM, work=tmp_path / "work", wheel_dir=tmp_path, env=env)
    out = sm_probe.probe_step(ctx, 60)
    assert out["status"] == "error" and "SM count" in out["summary"]


@pytest.mark.slow  # a process that starts the probe's process: ~5-12 s on two busy cores
def test_the_cli_runs_the_cpu_configurations(tmp_path):
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "-m", "artifact.gpu_check.sm_probe", "--device", "cpu", "--kinds", "spin",
                           "--configs", "cpu-1proc", "--phase-s", "0.1", "--rounds", "1", "--output", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert '"cpu-1proc"' in out.read_text() and "sm probe: cpu-1proc" in done.stderr
