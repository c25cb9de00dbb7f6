"""Models the simulator knows by name, and which calibration describes them: the shipped A100
profile was measured on Llama-8B's kernels, so a model of another shape (qwen3-32b: head_dim x
heads != hidden) is charged the roofline alone, never Llama-8B's times."""

from __future__ import annotations

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.sim.config import device_estimator, is_calibrated
from engines.model_config import ModelConfig
from estimator.reference.profiles import SHIPPED_PROFILE


def test_qwen3_32b_is_a_builtin_shape():
    cfg = ModelConfig.builtin("qwen3-32b")
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and not cfg.qkv_bias
    assert (cfg.q_size, cfg.kv_size) == (64 * 128, 8 * 128) and cfg.q_size != cfg.hidden_size
    assert abs(cfg.num_parameters() - 32.8e9) < 0.05e9


def test_another_shape_on_the_a100_is_roofline_only_and_slower_than_8b():
    llama = device_estimator(SimConfig(model="llama-3.1-8b"))
    qwen = device_estimator(SimConfig(model="qwen3-32b"))
    assert is_calibrated(llama) and not is_calibrated(qwen)
    # a decode step reads every weight: 32.8B parameters in bf16 cannot take less than 65.5 GB at the
    # A100's ~2 TB/s
    assert qwen.decode_time(8, 8 * 512, 108) > 0.03 > llama.decode_time(8, 8 * 512, 108)
    result = Simulation(SimConfig(model="qwen3-32b"), [(0.0, 512, 16), (0.1, 256, 16)]).run()
    assert len(result.records) == 2


def test_a_given_profile_refuses_a_model_of_another_shape():
    with pytest.raises(ValueError, match="calibrated on llama-3.1-8b, whose kernels differ from qwen3-32b"):
        device_estimator(SimConfig(model="qwen3-32b", estimator_profile=str(SHIPPED_PROFILE)))
