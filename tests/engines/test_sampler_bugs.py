"""Sampler inputs the HTTP fuzz found to crash a worker (logits overflowing to inf, softmax of inf
giving NaN, torch.multinomial raising): tiny temperatures now sample greedily, the smallest allowed
repetition penalty keeps probabilities finite, and overflow is clamped before softmax."""

from __future__ import annotations

import pytest
import torch

from engines.sampler import SampleRow, sample
from engines.sampling_params import SamplingParams

LOGITS = torch.tensor([[20.0, 10.0, -2.0, 0.5]])  # real logits reach 20 and more


def test_tiny_temperature_samples_greedily():
    out = sample(LOGITS.clone(), [SampleRow(SamplingParams(temperature=1e-38))])
    assert out.token_ids == [0]


def test_overflowing_scaled_logits_still_sample():
    big = torch.tensor([[3e38, 1e38, -2.0, 0.5]])
    out = sample(big, [SampleRow(SamplingParams(temperature=1e-5 * 1.01), generator=torch.Generator().manual_seed(0))])
    assert out.token_ids[0] in range(4)


def test_tiny_repetition_penalty_keeps_probabilities_finite():
    row = SampleRow(SamplingParams(repetition_penalty=0.01, temperature=1.0), output_ids=[0])
    out = sample(LOGITS.clone(), [row])
    assert out.token_ids[0] in range(4)
