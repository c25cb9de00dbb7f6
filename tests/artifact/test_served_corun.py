"""The co-run scale a served run measured (`artifact.served_corun`): recovered from step logs whose
co-running steps ran a known factor off the profile's co-run table, silent where a share never ran
alone, and measured on the committed H200 run (its static split's co-running steps cost what the
profile's table said)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from artifact.benchmarks.llamacpp_build import safe_extract
from artifact.gpu_check import report
from artifact.served_corun import MIN_STEPS, corun_scale, ratios
from estimator.profile import load_estimator
from estimator.reference.profiles import H200_PROFILE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def est():
    return load_estimator(str(H200_PROFILE))


def server_rows(est, host: float, corun: float, decode_units: int = 40, alone_decode: bool = True,
                steps: int = 12) -> list[dict]:
    """One server's timelines: prefill groups on 88 units, alone and beside a decode batch; decode
    steps on `decode_units`, alone and during a prefill group. Every step takes `host` x its price,
    those beside the other worker's `corun` x more."""
    rows, t = [], 0.0
    for i in range(steps):
        beside = 8 if i % 2 else 0
        priced = est.prefill_time([600], 88, num_layers=4, include_head=False, co_decode_batch=beside)
        ms = priced * host * (corun if beside else 1.0) * 1e3
        # one prompt length throughout: only the first group begins a new length (left out)
        rows.append({"role": "prefill", "run": True, "t": t, "units": 88, "tokens": 600, "batch": 1, "layers": 4,
                     "decode_batch": beside, "obs_ms": ms})
        if beside:
            priced = est.decode_time(8, 4000, decode_units, co_prefill_tokens=600)
            rows.append({"role": "decode", "run": True, "t": t + ms / 2e3, "units": decode_units, "batch": 8,
                         "context": 4000, "prefill_units": 88, "obs_ms": priced * host * corun * 1e3})
        elif alone_decode:
            priced = est.decode_time(8, 4000, decode_units)
            rows.append({"role": "decode", "run": True, "t": t + ms / 1e3 + 0.001, "units": decode_units, "batch": 8,
                         "context": 4000, "prefill_units": 0, "obs_ms": priced * host * 1e3})
        t += 1.0
    return rows


def write(rows: list[dict], folder: Path) -> Path:
    folder.mkdir(parents=True)
    for role in ("prefill", "decode"):
        (folder / f"{role}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["role"] == role))
    return folder


def test_the_scale_of_co_running_steps_is_recovered_whatever_the_hosts_speed(est, tmp_path):
    for host, corun in ((1.0, 1.0), (1.7, 1.3), (0.8, 0.9)):
        out = corun_scale(est, [write(server_rows(est, host, corun), tmp_path / f"{host}-{corun}")])
        assert out["scale"] == pytest.approx(corun, rel=1e-9)
        assert out["roles"] == {"decode": pytest.approx(corun), "prefill": pytest.approx(corun)}
        prefill = next(s for s in out["shares"] if s["role"] == "prefill")
        assert (prefill["alone_steps"], prefill["beside_steps"]) == (5, 6)  # the first group began a new length


def test_steps_count_as_what_the_worker_learnt_them_as_not_what_it_saw_at_the_decision(est, tmp_path):
    """Since 2026-11-29 a row records `beside`: a prefill group that saw a decode batch which then paused
    for it ran alone (priced and judged alone); a decode step that began while prefill was idle and
    ran under a prefill group that started meanwhile ran beside it (priced beside its tokens)."""
    rows = server_rows(est, 1.3, 1.25, steps=24)
    for row in rows:
        row["beside"] = row["decode_batch"] if row["role"] == "prefill" else 600 * bool(row["prefill_units"])
    paused = [r for r in rows if r["role"] == "prefill" and not r["decode_batch"]]
    for row in paused[1:4]:
        row["decode_batch"] = 8  # seen at the decision; decode paused for the group: alone all the same
    lone = [r for r in rows if r["role"] == "decode" and not r["prefill_units"]]
    for row in lone[:2]:  # a prefill group started during the step
        row.update(beside=600, obs_ms=est.decode_time(8, 4000, 40, co_prefill_tokens=600) * 1.3 * 1.25 * 1e3)
    out = corun_scale(est, [write(rows, tmp_path / "labelled")])
    assert out["scale"] == pytest.approx(1.25, rel=1e-9)
    steps = {s["role"]: (s["alone_steps"], s["beside_steps"]) for s in out["shares"]}
    assert steps == {"prefill": (11, 12), "decode": (10, 14)}
    for row in rows:
        del row["beside"]
    old = corun_scale(est, [write(rows, tmp_path / "decision")])  # the decision's view, as before the label
    assert {s["role"]: (s["alone_steps"], s["beside_steps"]) for s in old["shares"]} == {
        "prefill": (8, 15), "decode": (12, 12)}


def test_a_share_that_never_ran_alone_says_nothing(est, tmp_path):
    rows = server_rows(est, 1.2, 1.5, decode_units=16, alone_decode=False)  # bullet's small decode shares
    out = corun_scale(est, [write(rows, tmp_path / "s")])
    assert out["roles"]["decode"] is None and out["scale"] == pytest.approx(1.5)  # the prefill side still judges
    few = [r for r in rows if r["role"] == "decode"] + [r for r in rows if r["role"] == "prefill"][: MIN_STEPS]
    assert corun_scale(est, [write(few, tmp_path / "few")])["scale"] is None
    assert set(ratios(rows, est)) == {("prefill", 88), ("decode", 16)}


def test_the_committed_h200_runs_static_split_co_ran_as_profiled(tmp_path):
    """Run -b (2026-11-26): static's workers ran on fixed shares, alone and side by side, for hundreds
    of steps each — its co-running steps cost what the profile's co-run table says (S ~ 1); bullet's
    decode shares never ran alone, so its decode side is not judged."""
    with tarfile.open(ROOT / "docs" / "gpu" / "nvidia-h200-2026-11-26-b" / "logs.tgz") as tgz:
        safe_extract(tgz, tmp_path)
    logs = tmp_path / "logs"
    est = load_estimator(str(logs / "profile.json"))
    static = corun_scale(est, [logs / "timeline" / "static"])
    assert 0.9 < static["scale"] < 1.1 and 0.9 < static["roles"]["decode"] < 1.1
    assert sum(s["beside_steps"] for s in static["shares"]) > 1000
    assert corun_scale(est, [logs / "timeline" / "bullet"])["roles"]["decode"] is None
    lines = report._corun_lines({"static": static})
    assert lines[2].startswith("- static: S = 0.99") and "decode on 88 units 0.97" in lines[2]


CPU_PROFILE = ROOT / "docs" / "served" / "amd-2026-12-01-a" / "profile.json"


def test_the_oversubscribed_slowdown_is_recovered_from_a_naive_servers_timelines(tmp_path):
    """A CPU naive server (both workers on both cores) simulated with a known slowdown on shared cores and
    1.3x host speed: `--oversubscribed` reads the slowdown back from the rows' spans alone (they record no
    `beside`), and the served-steps fit, which leaves those steps out, reads back the host speed."""
    import random

    from artifact.served_corun import main, oversubscribed_slowdown
    from artifact.served_steps import fit, priced_steps, read_timelines
    from bullet.sim import SimConfig, Simulation

    rng = random.Random(5)
    t, load = 0.0, []
    for _ in range(60):
        t += rng.expovariate(2.0)
        load.append((t, rng.choice([20, 80, 200]), 24))
    Simulation(SimConfig(policy="naive", estimator_profile=str(CPU_PROFILE), max_total_tokens=32768, noise=0.0,
                         step_time_scale=1.3, oversubscribed_slowdown=4.0, timeline_dir=str(tmp_path)), load).run()
    cpu = load_estimator(str(CPU_PROFILE))
    result = oversubscribed_slowdown(cpu, [tmp_path])
    assert result["steps"] >= 2 * MIN_STEPS
    assert result["scale"] == pytest.approx(4.0, rel=0.02)
    assert {(s["role"], s["units"]) for s in result["shares"] if "scale" in s} == {("prefill", 2), ("decode", 2)}
    assert fit(priced_steps(read_timelines([tmp_path]), cpu)).scale == pytest.approx(1.3, rel=0.02)
    assert main(["--oversubscribed", "--profile", str(CPU_PROFILE), str(tmp_path)]) == 0
