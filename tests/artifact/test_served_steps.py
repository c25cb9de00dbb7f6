"""The served steps' fit (`artifact.served_steps`): a step log whose steps ran k times the device
model's latency plus a fixed overhead gives back k and the overhead; rows it cannot price are
skipped; and a simulated run on a device slowed by k, read back from its own timeline, fits k."""

from __future__ import annotations

import gzip
import json

import pytest

from artifact.served_steps import (OUTLIER, fit, fit_by_role, priced_by_role, priced_dirs, priced_steps, read_timelines,
                                   served_step_times)
from bullet.sim import SimConfig, Simulation
from estimator.profile import load_estimator
from estimator.reference.profiles import H200_PROFILE, SHIPPED_PROFILE


@pytest.fixture(scope="module")
def est():
    return load_estimator(str(SHIPPED_PROFILE))


def step_rows(est, scale: float, overhead_s: float) -> list[dict]:
    """A prefill, decode and hybrid step log of a device running `scale` x the model, + overhead."""
    rows = []
    for tokens, batch, layers, beside in ((300, 1, 4, 0), (900, 3, 4, 12), (2048, 2, 8, 40)):
        lens = [tokens // batch + (1 if i < tokens % batch else 0) for i in range(batch)]
        s = est.prefill_time(lens, 54, num_layers=layers, include_head=False, co_decode_batch=beside)
        rows.append({"role": "prefill", "run": True, "units": 54, "tokens": tokens, "batch": batch, "layers": layers,
                     "decode_batch": beside, "obs_ms": (overhead_s + scale * s) * 1e3})
    for batch in (1, 8, 32, 64):
        s = est.decode_time(batch, 500 * batch, 108)
        rows.append({"role": "decode", "run": True, "units": 108, "batch": batch, "context": 500 * batch,
                     "prefill_units": 0, "obs_ms": (overhead_s + scale * s) * 1e3})
    for chunk, decodes in ((256, 10), (1024, 0), (64, 40)):
        s = est.hybrid_step_time([(chunk, 0)], decodes, 300 * decodes, 108)
        rows.append({"role": "unified", "run": True, "units": 108, "chunks": [[chunk, 0]], "decode_batch": decodes,
                     "context": 300 * decodes, "obs_ms": (overhead_s + scale * s) * 1e3})
    return rows


def test_fit_recovers_the_scale_and_the_overhead(est):
    pairs = priced_steps(step_rows(est, 1.3, 0.002), est)
    assert len(pairs) == 10
    times = fit(pairs)
    assert times.scale == pytest.approx(1.3, rel=1e-6)
    assert times.overhead_s == pytest.approx(0.002, abs=1e-8)


def test_a_negative_overhead_is_refitted_through_the_origin(est):
    rows = step_rows(est, 0.9, -0.0005)
    times = fit(priced_steps(rows, est))
    assert times.overhead_s == 0.0
    assert 0.8 < times.scale < 0.9


def test_rows_it_cannot_price_are_skipped(est):
    good = step_rows(est, 1.0, 0.0)
    junk = [
        {"role": "decode", "run": False, "units": 108, "batch": 4, "reason": "paused"},  # no step ran
        {"role": "decode", "run": True, "units": 54, "batch": 4, "context": 900, "prefill_units": 54, "obs_ms": 9.0},
        {"role": "prefill", "run": True, "units": 999, "tokens": 10, "layers": 4, "obs_ms": 1.0},  # no such share
        {"role": "prefill", "run": True, "units": 8, "tokens": "many", "layers": 4, "obs_ms": 1.0},
        {"role": "unified", "run": True, "units": 8, "chunks": [[1, 2, 3]], "obs_ms": 1.0},
        {"role": "router", "run": True, "units": 8, "obs_ms": 1.0},
    ]
    assert len(priced_steps(junk + good, est)) == len(good)


def test_a_decode_step_beside_a_prefill_is_priced_beside_the_group_it_started_in():
    """A decode row records only that a prefill held units: the prefill row whose span (start + its
    observed time) holds the decode step's start says how many tokens ran beside it (priced with the
    H200 profile's measured contention)."""
    est = load_estimator(str(H200_PROFILE))
    prefill = {"role": "prefill", "run": True, "t": 10.0, "units": 88, "tokens": 900, "batch": 1, "layers": 4,
               "decode_batch": 8, "obs_ms": 50.0}
    during = {"role": "decode", "run": True, "t": 10.03, "units": 40, "batch": 8, "context": 4000, "prefill_units": 88,
              "obs_ms": 12.0}
    after = {**during, "t": 10.2}  # the prefill group had ended: what ran beside it is not in the log
    by_role = priced_by_role([prefill, during, after], est)
    assert by_role["decode"] == [(0.012, est.decode_time(8, 4000, 40, co_prefill_tokens=900), 0)]
    assert est.decode_time(8, 4000, 40, co_prefill_tokens=900) > est.decode_time(8, 4000, 40)


def test_warm_ups_are_left_out_of_the_fit(est):
    rows = step_rows(est, 1.3, 0.0)
    warm_up = {**rows[3], "obs_ms": rows[3]["obs_ms"] * OUTLIER * 2}  # a server's first step
    set_up = {**rows[4], "obs_ms": rows[4]["obs_ms"] * 8}  # a per-prompt set-up the served run paid: kept
    times = fit(priced_steps(rows + [warm_up], est))
    assert times.outliers == 1 and times.scale == pytest.approx(1.3, rel=1e-6)
    assert fit(priced_steps(rows + [set_up], est)).outliers == 0


def test_each_role_fits_its_own_scale(est):
    """A prefill worker 2x off the model with 3 ms per step, a decode worker as modelled: per role
    they come back; a role with too few steps is left to the pooled fit."""
    prefill = [r for r in step_rows(est, 2.0, 0.003) if r["role"] == "prefill"]
    decode = [r for r in step_rows(est, 1.0, 0.0) if r["role"] == "decode"]
    rows = [{**r, "tokens": r["tokens"] + k, "obs_ms": None} for k in range(4) for r in prefill]
    for r in rows:
        lens = [r["tokens"] // r["batch"] + (1 if i < r["tokens"] % r["batch"] else 0) for i in range(r["batch"])]
        r["obs_ms"] = (0.003 + 2.0 * est.prefill_time(lens, 54, num_layers=r["layers"], include_head=False,
                                                      co_decode_batch=r["decode_batch"])) * 1e3
    pooled, roles = fit_by_role(priced_by_role(rows + decode, est))
    assert set(roles) == {"prefill"}  # 4 decode steps: too few for a fit of their own
    assert roles["prefill"].scale == pytest.approx(2.0, rel=1e-6)
    assert roles["prefill"].overhead_s == pytest.approx(0.003, abs=1e-8)
    assert pooled.as_dict()["steps"] == len(rows) + len(decode)
    _, roles = fit_by_role(priced_by_role(rows + decode * 3, est))
    assert roles["decode"].scale == pytest.approx(1.0, rel=1e-6) and roles["decode"].overhead_s == pytest.approx(0, abs=1e-9)


def prefill_batches(est, batches, setup_s: float, scale: float = 1.0) -> list[dict]:
    """Prefill step rows of whole batches (8 groups of 4 layers) of these (prompts, tokens), each
    first group paying `setup_s` per fresh prompt length the worker had not run before."""
    rows, seen = [], set()
    for batch, tokens in batches:
        lens = [tokens // batch + (1 if i < tokens % batch else 0) for i in range(batch)]
        new = batch if batch > 1 else len({tokens} - seen)  # several prompts: distinct lengths
        seen.add(tokens)
        for group in range(8):
            s = scale * est.prefill_time(lens, 54, num_layers=4, include_head=False) + (setup_s * new if not group else 0)
            rows.append({"role": "prefill", "run": True, "units": 54, "tokens": tokens, "batch": batch, "layers": 4,
                         "decode_batch": 0, "obs_ms": s * 1e3})
    return rows


def test_a_set_up_per_new_prompt_length_is_fitted_apart(est):
    """The first layer group of every prompt of a new length pays 55 ms (a per-shape attention plan):
    the fit gives it back per new length and the scale of the rest; a repeated length pays nothing."""
    batches = [(1, 403), (1, 1789), (2, 1136), (1, 403), (1, 700), (3, 900)]
    rows = prefill_batches(est, batches, 0.055, scale=1.2)
    steps = priced_steps(rows, est)
    assert [s[2] for s in steps[::8]] == [1, 1, 2, 0, 1, 3]  # 403 again: seen
    assert all(s[2] == 0 for i, s in enumerate(steps) if i % 8)  # only a batch's first group begins lengths
    times = fit(steps)
    assert times.setup_s == pytest.approx(0.055, rel=1e-6) and times.scale == pytest.approx(1.2, rel=1e-6)
    assert times.overhead_s == pytest.approx(0.0, abs=1e-9) and times.new_lengths == 8
    # without any set-up the term is not fitted
    assert fit(priced_steps(prefill_batches(est, batches, 0.0), est)).setup_s == pytest.approx(0.0, abs=1e-12)


def test_a_set_up_that_explains_little_is_not_fitted(est, monkeypatch):
    """A device that builds no plan per shape (this project's CPU): steps with their own spread, first
    groups no slower on purpose. Least squares would still hand a few ms to a set-up term; the fit
    keeps the term only where it removes MIN_SETUP_GAIN of the squared error."""
    import random

    rng = random.Random(0)
    rows = prefill_batches(est, [(1, 300 + 37 * k) for k in range(12)], 0.0, scale=1.1)
    for i, row in enumerate(rows):
        row["obs_ms"] *= rng.uniform(0.8, 1.2) * (1.1 if i % 8 == 0 else 1.0)  # first groups a little slower
    steps = priced_steps(rows, est)
    assert fit(steps).setup_s == 0.0 and fit(steps).new_lengths == 12
    assert fit(steps) == fit(steps, setup=False)
    monkeypatch.setattr("artifact.served_steps.MIN_SETUP_GAIN", 0.0)
    assert 0 < fit(steps).setup_s < 0.002  # what plain least squares would have invented


def test_a_batch_preempted_at_a_layer_boundary_begins_its_lengths_once(est):
    """A batch preempted after two groups resumes as the same batch: only its first group began."""
    first = prefill_batches(est, [(1, 1000)], 0.05)
    second = prefill_batches(est, [(1, 300)], 0.05)
    steps = priced_steps(first[:2] + second + first[2:], est)
    assert [s[2] for s in steps] == [1, 0, 1] + [0] * 7 + [0] * 6


def test_each_servers_timelines_are_read_on_their_own(est, tmp_path):
    """Two servers' timelines fitted together: a length one server ran is new to the other (each
    worker builds its own plans), and a decode step is priced beside its own server's prefill only."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        rows = prefill_batches(est, [(1, 403)], 0.05)
        (tmp_path / name / "prefill.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = priced_dirs(est, [tmp_path / "a", tmp_path / "b"])["prefill"]
    assert [s[2] for s in steps] == [1] + [0] * 7 + [1] + [0] * 7


def test_too_few_steps_fit_nothing(est):
    with pytest.raises(ValueError, match="too few"):
        fit(priced_steps(step_rows(est, 1.0, 0.0)[:3], est))


def test_read_timelines_skips_malformed_lines_and_wants_a_timeline(tmp_path):
    (tmp_path / "decode.jsonl").write_text('{"role": "decode"}\nnot json\n[1, 2]\n{"role": "decode", "run": true}\n')
    assert read_timelines([tmp_path]) == [{"role": "decode"}, {"role": "decode", "run": True}]
    (tmp_path / "prefill.jsonl.gz").write_bytes(gzip.compress(b'{"role": "prefill"}\n'))
    assert read_timelines([tmp_path])[0] == {"role": "prefill"}
    with pytest.raises(FileNotFoundError, match="timeline"):
        read_timelines([tmp_path / "missing"])


def test_a_slowed_simulated_device_fits_its_slowdown_from_its_own_timeline(tmp_path):
    """The chunked baseline on the A100 profile with every step 1.4 x slower: its unified timeline,
    priced by the same profile, fits 1.4 and no overhead."""
    config = SimConfig(policy="chunked:512", seed=1, noise=0.0, step_overhead_s=0.0, step_time_scale=1.4,
                       timeline_dir=str(tmp_path))
    Simulation(config, [(0.05 * i, 200 + 37 * i, 12) for i in range(20)]).run()
    rows = [json.loads(line) for line in (tmp_path / "unified.jsonl").read_text().splitlines()]
    assert rows and all("chunks" in r for r in rows if r.get("run"))
    times = served_step_times(SHIPPED_PROFILE, [tmp_path])
    assert times.scale == pytest.approx(1.4, rel=1e-6)
    assert times.overhead_s == pytest.approx(0.0, abs=1e-9)


def test_sim_validation_replays_on_the_served_steps_speed(tmp_path, monkeypatch):
    """`sim_validation --served-steps`: the fit of the timelines given sets the replay's device."""
    from artifact import sim_validation

    timeline = tmp_path / "timeline"
    Simulation(SimConfig(policy="chunked:512", seed=1, noise=0.0, step_overhead_s=0.0, step_time_scale=2.0,
                         timeline_dir=str(timeline)), [(0.05 * i, 300, 8) for i in range(12)]).run()
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"request_rate": 2.0, "output_throughput": 4.0, "input_lens": [120, 300],
                                 "output_lens": [4, 4], "ttfts": [0.05, 0.08], "itls": [[0.01] * 3, [0.02] * 3],
                                 "errors": ["", ""], "arrivals": [0.0, 0.4]}) + "\n")
    out = tmp_path / "validation"
    monkeypatch.setattr("sys.argv", ["sim_validation", "--bench-serving", f"{bench},chunked:512",
                                     "--profile", str(SHIPPED_PROFILE), "--max-total-tokens", "65536",
                                     "--max-running-requests", "64", "--seeds", "1", "--served-steps", str(timeline),
                                     "--out", str(out)])
    assert sim_validation.main() == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["served_steps"]["scale"] == pytest.approx(2.0, rel=1e-6)
    assert data["config"]["step_time_scale"] == pytest.approx(2.0, rel=1e-6)
    assert data["runs"][0]["predicted"]["ttft_p50_s"] > 0


def test_sim_validation_fits_each_system_to_its_own_steps(tmp_path, monkeypatch):
    """`--served-steps-by-system ROOT`: each system replays on the fit of ROOT/<system>/; a system whose
    timeline prices no step (here: nothing but pauses) takes the others' pooled fit."""
    from artifact import sim_validation

    root = tmp_path / "timeline"
    Simulation(SimConfig(policy="chunked:512", seed=1, noise=0.0, step_overhead_s=0.0, step_time_scale=1.5,
                         timeline_dir=str(root / "chunked-512")), [(0.05 * i, 300, 8) for i in range(12)]).run()
    (root / "bullet").mkdir()
    (root / "bullet" / "decode.jsonl").write_text('{"role": "decode", "run": false, "reason": "paused"}\n')
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"request_rate": 2.0, "output_throughput": 4.0, "input_lens": [120, 300],
                                 "output_lens": [4, 4], "ttfts": [0.05, 0.08], "itls": [[0.01] * 3, [0.02] * 3],
                                 "errors": ["", ""], "arrivals": [0.0, 0.4]}) + "\n")
    out = tmp_path / "validation"
    monkeypatch.setattr("sys.argv", ["sim_validation", "--bench-serving", f"{bench},chunked:512", f"{bench},bullet",
                                     "--profile", str(SHIPPED_PROFILE), "--max-total-tokens", "65536",
                                     "--max-running-requests", "64", "--seeds", "1",
                                     "--served-steps-by-system", str(root), "--out", str(out)])
    assert sim_validation.main() == 0
    fits = json.loads(out.with_suffix(".json").read_text())["served_steps"]["by_system"]
    assert fits["chunked:512"]["scale"] == pytest.approx(1.5, rel=1e-6) and not fits["chunked:512"]["pooled"]
    assert fits["bullet"]["scale"] == pytest.approx(1.5, rel=1e-6) and fits["bullet"]["pooled"]
