"""The shipped A100 profile is what the public data says, and loads without shared/data."""

from __future__ import annotations

import json

from estimator.estimator import Estimator
from estimator.profile import load_estimator
from estimator.reference.profiles import SHIPPED_PROFILE, a100_llama3_8b_profile


def test_shipped_profile_is_regenerated_from_shared_data(shared_data):
    regenerated = a100_llama3_8b_profile(shared_data).model_dump(mode="json")
    assert json.loads(SHIPPED_PROFILE.read_text()) == regenerated, (
        "estimator/reference/data/a100-llama-3-8b.json is stale: run `python -m estimator.reference.profiles`")


def test_shipped_profile_uses_at_most_two_samples_per_kind():
    estimator = load_estimator(SHIPPED_PROFILE)
    counts = {}
    for sample in estimator.calibration.samples:
        counts[sample.kind] = counts.get(sample.kind, 0) + 1
    assert max(counts.values()) <= 2 and "attn_prefill" in counts and "attn_decode" in counts
    assert estimator.model.name == "llama-3.1-8b" and estimator.hardware.units == 108
