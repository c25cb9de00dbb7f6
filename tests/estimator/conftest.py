"""Fixtures shared by the estimator tests."""

from __future__ import annotations

import pytest

from engines.model_config import ModelConfig
from estimator.hardware import HardwareSpec
from estimator.reference.data import llama2_7b


@pytest.fixture(scope="session")
def llama3_8b() -> ModelConfig:
    return ModelConfig.builtin("llama-3.1-8b")


@pytest.fixture(scope="session")
def llama2() -> ModelConfig:
    return llama2_7b()


@pytest.fixture(scope="session")
def a100() -> HardwareSpec:
    return HardwareSpec.builtin("a100")
