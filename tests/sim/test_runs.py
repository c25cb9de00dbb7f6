"""Whole simulated runs: every request finishes and every page comes back, a seed fixes the run,
the policies are the runtime's own classes, Bullet repartitions under a burst while a static split
never does, and the chunked baseline respects its token budget."""

from __future__ import annotations

import json
import random

import pytest

from bullet.policies.bullet_decode import BulletDecodePolicy
from bullet.policies.bullet_prefill import BulletPrefillPolicy
from bullet.policies.hybrid import HybridScheduler
from bullet.policies.static import StaticDecodePolicy, StaticPrefillPolicy
from bullet.sim import SimConfig, Simulation

POLICIES = ["bullet", "static", "static:80", "naive", "chunked:512"]


def poisson(n: int, rate: float, seed: int, prompt=(50, 3000), output=(2, 200)) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, rng.randint(*prompt), rng.randint(*output)))
    return out


def simulate(policy: str, requests, **overrides):
    sim = Simulation(SimConfig(policy=policy, ttft_slo="1.5ms/token", tpot_slo="200ms", **overrides), requests)
    return sim, sim.run()


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_and_every_page_returns(policy):
    requests = poisson(150, 6.0, seed=1)
    sim, result = simulate(policy, requests)
    assert len(result.records) == len(requests)
    assert all(r.ok for r in result.records)
    assert {r.output_len for r in result.records} <= {o for _, _, o in requests}
    assert sorted(r.output_len for r in result.records) == sorted(o for _, _, o in requests)
    assert result.counters["free_pages"] == result.counters["total_pages"]
    assert sim.allocator.num_free() == sim.allocator.total_pages


@pytest.mark.parametrize("policy", ["bullet", "chunked:512"])
def test_conservation_under_memory_pressure(policy):
    """A KV pool far too small: decode hands requests back to prefill to be recomputed, chunked
    preempts and recomputes — every request still finishes, none is dropped, and the pool is whole."""
    requests = poisson(60, 20.0, seed=2, prompt=(500, 1500), output=(100, 300))
    sim, result = simulate(policy, requests, kv_memory_gb=0.5)  # ~3800 tokens of KV
    assert len(result.records) == len(requests)
    assert result.counters["free_pages"] == result.counters["total_pages"]
    pressure = result.counters.get("preemptions", 0) + result.counters.get("recomputed", 0)
    assert pressure > 0  # the pool really was too small
    assert result.summary["dropped"] == 0 and all(r.ok for r in result.records)


@pytest.mark.parametrize("policy", ["bullet", "chunked:1024"])
def test_a_seed_fixes_the_run(policy):
    requests = poisson(80, 8.0, seed=3)
    runs = [simulate(policy, requests, seed=seed)[1] for seed in (7, 7, 8)]
    same = [[(r.rid, r.first_token_time, r.finish_time) for r in run.records] for run in runs]
    assert same[0] == same[1]
    assert same[0] != same[2]  # the seed drives the latency noise


def test_the_policies_are_the_runtime_classes():
    requests = [(0.0, 100, 2)]
    bullet, _ = simulate("bullet", requests)
    assert type(bullet.drivers[0].core.policy) is BulletPrefillPolicy
    assert type(bullet.drivers[1].core.policy) is BulletDecodePolicy
    static, _ = simulate("static:30", requests)
    assert type(static.drivers[0].core.policy) is StaticPrefillPolicy and static.drivers[0].core.policy.units == 30
    assert type(static.drivers[1].core.policy) is StaticDecodePolicy and static.drivers[1].core.policy.units == 108 - 30
    chunked, _ = simulate("chunked:256", requests)
    assert type(chunked.drivers[0].core.scheduler) is HybridScheduler
    for worker in [d.core for d in bullet.drivers + static.drivers]:
        assert type(worker.policy).__module__.startswith("bullet.policies.")


def _units(tmp_path, role: str) -> list[int]:
    rows = [json.loads(line) for line in (tmp_path / f"{role}.jsonl").read_text().splitlines()]
    return [r["units"] for r in rows if r.get("run")]


def burst() -> list[tuple[float, int, int]]:
    """A few long-running decodes, then 20 long prompts at once."""
    return [(0.01 * i, 200, 400) for i in range(8)] + [(1.0 + 0.001 * i, 2500, 20) for i in range(20)]


def test_bullet_repartitions_under_a_burst_and_a_static_split_does_not(tmp_path):
    simulate("bullet", burst(), timeline_dir=str(tmp_path / "bullet"))
    prefill, decode = _units(tmp_path / "bullet", "prefill"), _units(tmp_path / "bullet", "decode")
    assert len(set(prefill)) >= 3 and len(set(decode)) >= 3
    assert max(prefill) == 108 and min(prefill) < 108
    simulate("static:60", burst(), timeline_dir=str(tmp_path / "static"))
    assert set(_units(tmp_path / "static", "prefill")) == {60}
    assert set(_units(tmp_path / "static", "decode")) == {48}


def _complement_steps(directory) -> list[float]:
    """Observed / predicted time of every decode step that ran on the complement of prefill's share."""
    rows = [json.loads(line) for line in (directory / "decode.jsonl").read_text().splitlines()]
    return [r["obs_ms"] / r["pred_ms"] for r in rows if r.get("run") and r["reason"].startswith("complement")]


def test_prefill_never_grows_into_a_running_decode_steps_units(tmp_path):
    """A decode step keeps its units to its end: prefill's new share waits beside them until the step
    ends (`prefill_grow="after-decode-step"`), so a step on the complement of prefill's share takes
    about what decode predicted; taking them at once (the rule before) left steps sharing units with
    prefill's thread blocks, several times slower than predicted."""
    simulate("bullet", burst(), timeline_dir=str(tmp_path / "after"))
    after = _complement_steps(tmp_path / "after")
    assert after and max(after) < 1.5
    simulate("bullet", burst(), timeline_dir=str(tmp_path / "at-once"), prefill_grow="at-once")
    assert max(_complement_steps(tmp_path / "at-once")) > 3.0


@pytest.mark.parametrize("budget", [64, 700])
def test_chunked_never_exceeds_its_token_budget(tmp_path, budget):
    requests = poisson(80, 10.0, seed=4)
    simulate(f"chunked:{budget}", requests, timeline_dir=str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "unified.jsonl").read_text().splitlines()]
    tokens = [r["tokens"] for r in rows]
    assert max(tokens) <= budget
    assert tokens.count(budget) > 0  # the budget binds: prompts were split into chunks


def _decode_batches(directory) -> list[int]:
    rows = [json.loads(line) for line in (directory / "decode.jsonl").read_text().splitlines()]
    return [r["batch"] for r in rows if r.get("run")]


@pytest.mark.parametrize("policy", ["bullet", "static"])
def test_max_running_requests_caps_the_two_worker_policies(tmp_path, policy):
    """`--max-running-requests` as SGLang counts it: prompts beyond the cap wait before their first
    token, so the decode batch never exceeds it — and every request still finishes."""
    requests = poisson(60, 30.0, seed=5, prompt=(50, 400), output=(150, 300))
    simulate(policy, requests, timeline_dir=str(tmp_path / "free"))
    assert max(_decode_batches(tmp_path / "free")) > 6  # without a cap the batch grows past it
    sim, result = simulate(policy, requests, max_running_requests=6, timeline_dir=str(tmp_path / "capped"))
    assert max(_decode_batches(tmp_path / "capped")) <= 6
    assert len(result.records) == len(requests) and all(r.ok for r in result.records)
    assert sim.allocator.num_free() == sim.allocator.total_pages
