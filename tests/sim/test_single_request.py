"""One request alone on the simulated A100: its TTFT is the estimator's prefill latency (charged a
layer group at a time), its TPOT the mean of the decode steps' latencies, and virtual time moves
by exactly the charged steps."""

from __future__ import annotations

import json

import pytest

from bullet.sim import SimConfig, Simulation

PROMPT, OUTPUT = 1000, 6


def run(policy: str, tmp_path, requests=((0.0, PROMPT, OUTPUT),), **overrides):
    config = SimConfig(policy=policy, timeline_dir=str(tmp_path), **{"noise": 0.0, "step_overhead_s": 0.0, **overrides})
    sim = Simulation(config, list(requests))
    return sim, sim.run()


def timeline(tmp_path, role: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"{role}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("layers_per_step", [4, 5])
def test_bullet_ttft_is_the_prefill_latency_and_tpot_the_decode_steps(tmp_path, layers_per_step):
    sim, result = run("bullet", tmp_path, prefill_layers_per_step=layers_per_step)
    est, units = sim.device_estimator, sim.device_estimator.hardware.units
    [rec] = result.records
    # decode is idle, so Bullet gives prefill every unit; the head is charged with the last group
    assert rec.ttft == pytest.approx(est.prefill_time([PROMPT], units), rel=1e-9)
    steps = timeline(tmp_path, "prefill")
    assert len(steps) == -(-32 // layers_per_step)  # one record per layer group
    assert {s["units"] for s in steps} == {units}
    # decode steps over contexts PROMPT+1 .. PROMPT+OUTPUT-1, on every unit (prefill idle)
    decode = [est.decode_time(1, PROMPT + k, units) for k in range(1, OUTPUT)]
    assert rec.tpot == pytest.approx(sum(decode) / len(decode), rel=1e-9)
    assert rec.output_len == OUTPUT


def test_static_split_charges_the_prefill_at_its_share(tmp_path):
    sim, result = run("static:40", tmp_path)
    [rec] = result.records
    assert rec.ttft == pytest.approx(sim.device_estimator.prefill_time([PROMPT], 40), rel=1e-9)
    decode = [sim.device_estimator.decode_time(1, PROMPT + k, 68) for k in range(1, OUTPUT)]
    assert rec.tpot == pytest.approx(sum(decode) / len(decode), rel=1e-9)


def test_chunked_ttft_is_the_hybrid_steps_of_its_chunks(tmp_path):
    sim, result = run("chunked:256", tmp_path)
    est = sim.device_estimator
    [rec] = result.records
    chunks = [est.hybrid_step_time([(min(256, PROMPT - start), start)]) for start in range(0, PROMPT, 256)]
    assert rec.ttft == pytest.approx(sum(chunks), rel=1e-9)
    decode = [est.hybrid_step_time([], 1, PROMPT + k) for k in range(1, OUTPUT)]
    assert rec.tpot == pytest.approx(sum(decode) / len(decode), rel=1e-9)


@pytest.mark.parametrize("policy", ["bullet", "naive", "chunked:512"])
def test_virtual_time_advances_only_by_charged_steps(tmp_path, policy):
    """A lone request runs its steps back to back (prefill layer groups or hybrid chunks, then
    decode iterations): it finishes exactly when the charged latencies, noise included, add up."""
    sim, result = run(policy, tmp_path, requests=[(0.0, 300, 3)], noise=0.05)
    steps = []
    for role in ("prefill", "decode", "unified"):
        path = tmp_path / f"{role}.jsonl"
        if path.exists():
            steps += [s for s in timeline(tmp_path, role) if s.get("run")]
    charged = sum(s["obs_ms"] for s in steps) / 1e3
    [rec] = result.records
    assert rec.finish_time == pytest.approx(charged, rel=1e-9)
    assert result.end_time == rec.finish_time
    assert sum(result.device.busy_s.values()) == pytest.approx(charged, rel=1e-9)


@pytest.mark.parametrize("policy", ["bullet", "chunked:256"])
def test_every_step_pays_the_stated_overhead(tmp_path, policy):
    """Launch and scheduling time after each step's kernels, the same for every system: a lone
    request's TTFT grows by one overhead per step that led to its first token."""
    base_sim, base = run(policy, tmp_path / "without")
    sim, with_overhead = run(policy, tmp_path / "with", step_overhead_s=1e-3)
    role = "prefill" if policy == "bullet" else "unified"
    steps_to_first = len(timeline(tmp_path / "without", role)) if policy == "bullet" else -(-PROMPT // 256)
    [a], [b] = base.records, with_overhead.records
    assert b.ttft == pytest.approx(a.ttft + steps_to_first * 1e-3, rel=1e-9)


@pytest.mark.parametrize("policy", ["bullet", "chunked:256"])
def test_a_step_time_scale_stretches_every_step(tmp_path, policy):
    """`step_time_scale`: a device whose steps all run k times slower than its model (the served
    machine against its profile) — a lone request's TTFT and TPOT are k times the unscaled ones."""
    _, plain = run(policy, tmp_path / "plain")
    _, slow = run(policy, tmp_path / "slow", step_time_scale=1.5)
    [a], [b] = plain.records, slow.records
    assert b.ttft == pytest.approx(1.5 * a.ttft, rel=1e-9)
    assert b.tpot == pytest.approx(1.5 * a.tpot, rel=1e-9)


def test_role_step_times_stretch_only_that_workers_steps(tmp_path):
    """`role_step_times`: bullet's prefill worker 2x slower with 1 ms after each of its steps, its
    decode worker as profiled — a lone request's TTFT is its prefill groups' (2x, + 1 ms each), its
    TPOT unchanged; the global scale is ignored for a role that has its own."""
    _, plain = run("bullet", tmp_path / "plain")
    groups = len(timeline(tmp_path / "plain", "prefill"))
    _, slow = run("bullet", tmp_path / "slow", step_time_scale=3.0, role_step_times={"prefill": (2.0, 1e-3),
                                                                                      "decode": (1.0, 0.0)})
    [a], [b] = plain.records, slow.records
    assert b.ttft == pytest.approx(2.0 * a.ttft + groups * 1e-3, rel=1e-6)
    assert b.tpot == pytest.approx(a.tpot, rel=1e-9)
    with pytest.raises(ValueError, match="role_step_times"):
        run("bullet", tmp_path / "bad", role_step_times={"prefill": (0.0, 0.0)})


def test_a_step_time_scale_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="time_scale"):
        run("bullet", tmp_path, step_time_scale=0.0)


@pytest.mark.parametrize("policy", ["bullet", "static:40"])
def test_a_new_prompt_length_pays_the_attention_set_up_once(tmp_path, policy):
    """`attention_setup_s`: the first prompt of a length pays it before its first layer group (its
    TTFT and that group's observed time grow by it); a later prompt of the same length does not, one
    of another length does."""
    requests = [(0.0, PROMPT, 2), (5.0, PROMPT, 2), (10.0, PROMPT + 1, 2)]
    _, plain = run(policy, tmp_path / "plain", requests)
    sim, paid = run(policy, tmp_path / "paid", requests, attention_setup_s=0.05)
    by_arrival = [sorted(r.records, key=lambda r: r.arrival) for r in (plain, paid)]
    extra = [b.ttft - a.ttft for a, b in zip(*by_arrival)]
    assert extra == pytest.approx([0.05, 0.0, 0.05], abs=1e-9)
    prefill = sim.drivers[0].core.env.executor
    assert prefill.setups == 2 and paid.counters["attention_setups"] == 2
    assert "attention_setups" not in plain.counters
    groups = timeline(tmp_path / "paid", "prefill")
    first = [g["obs_ms"] for g in timeline(tmp_path / "plain", "prefill")][0]
    assert groups[0]["obs_ms"] == pytest.approx(first + 50.0, rel=1e-9)  # the worker observes what it paid


def test_hybrid_steps_pay_the_set_up_only_without_decode_rows(tmp_path):
    """A unified worker runs SDPA only for a step of fresh prompts alone: the chunk that starts a
    prompt of a new length pays; a chunk beside decode rows (the paged kernel) does not."""
    alone = [(0.0, 200, 3)]
    _, plain = run("chunked:512", tmp_path / "a", alone)
    _, paid = run("chunked:512", tmp_path / "b", alone, attention_setup_s=0.05)
    assert paid.records[0].ttft - plain.records[0].ttft == pytest.approx(0.05, abs=1e-9)
    beside = [(0.0, 200, 400), (1.0, 300, 2)]  # the second arrives while the first decodes
    sim, _ = run("chunked:512", tmp_path / "c", beside, attention_setup_s=0.05)
    assert sim.entry.core.env.executor.setups == 1  # the first prompt's; the second ran beside decode rows
    [step] = [r for r in timeline(tmp_path / "c", "unified") if r.get("chunks") == [[300, 0]]]
    assert step["decode_batch"] == 1


def test_a_negative_attention_set_up_is_refused():
    with pytest.raises(ValueError, match="attention_setup_s"):
        Simulation(SimConfig(attention_setup_s=-0.01), [(0.0, 10, 2)])
