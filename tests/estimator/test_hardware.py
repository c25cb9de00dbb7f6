"""Hardware descriptions: built-in GPUs from spec sheets, JSON round trip, measured tables."""

from __future__ import annotations

import pytest

from estimator.hardware import BUILTIN, HardwareSpec


@pytest.mark.parametrize("name, sms, tb_s", [("a100", 108, 2.039), ("h100", 132, 3.35), ("h200", 132, 4.8),
                                               ("h20", 78, 4.0)])
def test_builtin_gpus_match_the_spec_sheets(name, sms, tb_s):
    hw = HardwareSpec.builtin(name)
    assert hw.units == sms and hw.peak_bandwidth == pytest.approx(tb_s * 1e12)
    assert 0 < hw.bandwidth_inflection < sms
    assert hw.partition_step == 2 and hw.units // hw.partition_step == {108: 54, 132: 66, 78: 39}[sms]
    assert hw.assumptions, "every built-in GPU states what it assumes"


def test_unknown_hardware_is_refused():
    with pytest.raises(ValueError, match="known"):
        HardwareSpec.builtin("tpu")


def test_partition_sizes_follow_tpc_granularity():
    sizes = HardwareSpec.builtin("a100").partition_sizes()
    assert sizes[0] == 2 and sizes[-1] == 108 and all(s % 2 == 0 for s in sizes)


def test_json_round_trip(tmp_path):
    for hw in BUILTIN.values():
        path = tmp_path / f"{hw.name}.json"
        hw.to_json(path)
        assert HardwareSpec.from_json(path) == hw


def cpu_spec(**extra) -> HardwareSpec:
    return HardwareSpec(name="cpu", kind="cpu", units=2, unit_name="core", peak_flops={"fp32": 50e9},
                        peak_bandwidth=9e9, bandwidth_inflection=1.0, wave_quantization=False, **extra)


def test_measured_tables_replace_the_linear_model():
    linear = cpu_spec()
    assert linear.compute_rate(1, "fp32") == 25e9 and linear.bandwidth(1) == 9e9
    measured = cpu_spec(measured_flops={"fp32": [35e9, 51e9]}, measured_bandwidth=[9.3e9, 9.2e9])
    assert measured.compute_rate(1, "fp32") == 35e9 and measured.compute_rate(2, "bf16") == 51e9
    assert measured.bandwidth(2) == 9.2e9


def test_measured_tables_must_cover_every_unit_count():
    with pytest.raises(ValueError):
        cpu_spec(measured_bandwidth=[9e9])
