"""Bugs found by the HTTP fuzz in code below the HTTP layer (engines/sampler.py, owned elsewhere).
The HTTP layer now keeps such values away from the workers (bullet/http/sampling.py); these tests
pin the underlying bug so that it is fixed where it lives. They are strict xfails: once the sampler
is fixed they pass, pytest reports XPASS as a failure, and the marker must go.

Proposed fix (engines/sampler.py): in `_sample_rows`, treat rows with temperature < 1e-6 as greedy
(SGLang's rule) and, after `_apply_penalties`, clamp finite-overflowing logits with
`torch.nan_to_num(logits, posinf=torch.finfo(logits.dtype).max)` — or bound repetition_penalty
below (e.g. ge=0.01) in engines/sampling_params.py."""

from __future__ import annotations

import pytest
import torch

from engines.sampler import SampleRow, sample
from engines.sampling_params import SamplingParams

LOGITS = torch.tensor([[20.0, 10.0, -2.0, 0.5]])  # real logits reach 20 and more


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="logits / 1e-38 overflow to inf; softmax gives NaN; torch.multinomial raises and the worker dies")
def test_tiny_temperature_samples_greedily():
    out = sample(LOGITS.clone(), [SampleRow(SamplingParams(temperature=1e-38))])
    assert out.token_ids == [0]


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="a repeated token's logit / 1e-38 overflows to inf; softmax gives NaN; the worker dies")
def test_tiny_repetition_penalty_keeps_probabilities_finite():
    row = SampleRow(SamplingParams(repetition_penalty=1e-38, temperature=1.0), output_ids=[0])
    out = sample(LOGITS.clone(), [row])
    assert out.token_ids[0] in range(4)
