"""The device run's report: `results.json` (everything measured, with what it was measured on) and
`report.md` (the same for a reader: steps, the issue's goals met or not, the engine benchmark, the
served comparison, the doctor's verdicts, the GPU tests). Both are rewritten after every step, so a
run cut short still leaves what it measured. Written from the results dict alone."""

from __future__ import annotations

import json
from pathlib import Path

# the served goals: the best policy's steady-state goodput, bullet's against the best
# baseline's, light-load TPOT (where a 1 req/s point was served)
SERVED_GOAL_REQ_S = 18.0
BULLET_GOAL_X = 1.2
SERVED_GOAL_TPOT_S = 8e-3
LIGHT_RATE = 1.0


def write(results: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    results["goals"] = goals(results)
    (folder / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (folder / "report.md").write_text(markdown(results))


def _step(results: dict, name: str) -> dict:
    return results.get("steps", {}).get(name) or {}


def served_goals(results: dict) -> list[dict]:
    """The served goals, for a GPU plan's load (dummy Llama-3.1-8B) only. Steady-state runs judge
    goodput; runs before them (bursts) the highest throughput."""
    if results.get("run", {}).get("device") != "cuda":
        return []
    systems = _step(results, "serve").get("systems", {})
    ran = {name: s for name, s in systems.items() if s.get("per_rate")}
    if not ran:
        return []
    out = []
    if all("goodput_req_s" in s and "bracket" in s for s in ran.values()):
        good = {n: s["goodput_req_s"] for n, s in ran.items()}
        best = max(good, key=good.get)
        out.append({"goal": f"steady-state goodput, best policy ({best})", "measured": good[best],
                    "target": f">= {SERVED_GOAL_REQ_S:g} req/s", "met": good[best] >= SERVED_GOAL_REQ_S, "unit": "req/s"})
        baselines = {n: g for n, g in good.items() if n != "bullet"}
        if "bullet" in good and baselines:
            rival = max(baselines, key=baselines.get)
            ratio = good["bullet"] / baselines[rival] if baselines[rival] > 0 else None
            out.append({"goal": f"bullet's goodput over the best baseline's ({rival})", "measured": ratio,
                        "target": f">= {BULLET_GOAL_X:g}x", "met": ratio is not None and ratio >= BULLET_GOAL_X,
                        "unit": "x"})
        judged = [(label, name) for label, name in (("best policy", best), ("bullet", "bullet")) if name in ran]
    else:
        saturated = {n: max(p["req_per_s"] for p in s["per_rate"].values()) for n, s in ran.items()}
        best = max(saturated, key=saturated.get)
        judged = [(label, name) for label, name in (("best policy", best), ("bullet", "bullet")) if name in ran]
        for label, name in judged:
            out.append({"goal": f"served throughput, {label} ({name})", "measured": saturated[name],
                        "target": f">= {SERVED_GOAL_REQ_S:g} req/s", "met": saturated[name] >= SERVED_GOAL_REQ_S,
                        "unit": "req/s"})
    for label, name in judged:
        light = ran[name]["per_rate"].get(f"{LIGHT_RATE:g}", {}).get("tpot_p50_s")
        if light is not None:
            out.append({"goal": f"TPOT p50 at {LIGHT_RATE:g} req/s, {label} ({name})", "measured": light * 1e3,
                        "target": f"<= {SERVED_GOAL_TPOT_S * 1e3:g} ms", "met": light <= SERVED_GOAL_TPOT_S, "unit": "ms"})
    return out


def compile_goals(results: dict) -> list[dict]:
    """The issue's "0 Triton compiles while serving": in the engine benchmark's sections after its
    warm-up, and in every served worker (from their timelines), where counted."""
    out = []
    compiles = _step(results, "bench").get("engine", {}).get("kernels", {}).get("triton_compiles", {})
    if compiles.get("counted"):
        n = compiles.get("after_warm_up", 0)
        out.append({"goal": "Triton compiles after the warm-up (engine benchmark)", "measured": n, "target": "0",
                    "met": n == 0, "unit": ""})
    served = _step(results, "replay").get("kernels") or {}
    if served:
        n = sum(r.get("triton_compiles", 0) for roles in served.values() for r in roles.values())
        out.append({"goal": "Triton compiles while serving (every served worker)", "measured": n, "target": "0",
                    "met": n == 0, "unit": ""})
    return out


def goals(results: dict) -> list[dict]:
    engine = _step(results, "bench").get("engine", {})
    models = _step(results, "models").get("models", {})
    return [*engine.get("goals", []), *models.get("goals", []), *served_goals(results), *compile_goals(results)]


def _fmt(x, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}{unit}" if abs(x) < 100 else f"{x:.0f}{unit}"
    return f"{x}{unit}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in row) + " |" for row in rows]
    return lines + [""]


def markdown(results: dict) -> str:
    m, run = results.get("machine", {}), results.get("run", {})
    t = m.get("torch", {})
    gpu = m.get("gpu") or "no GPU"
    lines = [f"# Device run: {gpu}, {m.get('date', '?')} ({run.get('plan', '?')} plan)", "",
             f"- **GPU** {gpu} ({t.get('sms', '-')} SMs, {t.get('memory_gib', '-')} GiB, compute capability "
             f"{t.get('capability', '-')}), driver {m.get('driver', '-')}, compute mode {m.get('compute_mode', '-')}",
             f"- **software** Python {t.get('python', '-')}, torch {t.get('torch', '-')} (CUDA {t.get('torch_cuda', '-')}), "
             f"nvcc: {m.get('nvcc') or 'none'}; host {m.get('host', '-')} ({m.get('cpus', '-')} CPUs, {m.get('cpu_model', '-')})",
             f"- **commit** `{m.get('commit', 'unknown')}` ({m.get('commit_source', '-')})",
             f"- **run** `{run.get('command', 'scripts/gpu_check.sh')}`: {run.get('model', '-')} on {run.get('device', '-')}, "
             f"started {m.get('started_utc', '-')}, {_fmt(run.get('elapsed_s'))} s of its {_fmt(run.get('budget_s'))} s budget"
             f"{' (ended early: ' + run['ended_early'] + ')' if run.get('ended_early') else ''}",
             "", "Every number below was measured in this run, on this machine and commit; MPS is the state the "
             "step ran under.", ""]
    lines += ["## Steps", ""]
    lines += _table(["step", "MPS", "status", "seconds (cap)", "summary"],
                    [[name, "on" if s.get("mps") else "off", s.get("status", "-"),
                      f"{_fmt(s.get('seconds'))} ({_fmt(s.get('cap_s'))})", s.get("summary", "")[:300]]
                     for name, s in results.get("steps", {}).items()])
    lines += _goals_section(results.get("goals") or goals(results))
    lines += _engine_section(_step(results, "bench"))
    if "models" in results.get("steps", {}):  # plans before 2026-11-29 had no such step
        lines += _models_section(_step(results, "models"))
    lines += _kernels_section(_step(results, "bench"), _step(results, "replay"))
    lines += _profile_section(_step(results, "profile"))
    lines += _served_section(_step(results, "serve"))
    lines += _costs_section(_step(results, "replay"))
    lines += _replay_section(_step(results, "replay"))
    lines += _doctor_section(_step(results, "doctor-nomps"), _step(results, "doctor-mps"))
    lines += _tests_section(_step(results, "gpu-tests"))
    lines += ["## Files", "", "`results.json` (all of the above, machine-readable); `../plans.json`: which plan last ran "
              "when (this run's entry included); `logs.tgz`: every step's log, "
              "the doctor's JSON reports, the servers' logs, the load generator's per-request files "
              "(`bench-<system>.jsonl`, `sglang.bench_serving --output-details` shape), the engine benchmark's "
              "JSON and the bullet policy's GPU profile.", ""]
    return "\n".join(lines)


def _goals_section(items: list[dict]) -> list[str]:
    if not items:
        return ["## Goals (issue 24)", "", "No goal measured in this run.", ""]
    return ["## Goals (issue 24)", "", *_table(["goal", "measured", "target", "verdict"],
            [[g["goal"], _fmt(g["measured"], " " + g.get("unit", "")), g["target"], "met" if g["met"] else "**not met**"]
             for g in items])]


def _replay_section(step: dict) -> list[str]:
    """The simulator's replay of this run's served points (`artifact.gpu_check.replay`): its table,
    one heading level down."""
    text = step.get("markdown")
    if not text:
        return [] if not step else _not_measured("Simulator vs this run", step)
    body = [line for line in text.splitlines() if not line.startswith("# ")]
    return ["## Simulator vs this run", "",
            "Each system's served points replayed by `bullet simulate`'s engine for the same policy, on the profile "
            "measured above, each worker's steps at the speed its own timeline recorded "
            "(`python -m artifact.sim_validation`; goal: P50s within 15 %, P90s within 30 %).",
            *(("#" + line) if line.startswith("## ") else line for line in body), ""]


def _costs_section(step: dict) -> list[str]:
    """What each kind of served step cost (`artifact.step_costs`): lines through the timelines."""
    from artifact.step_costs import markdown  # deferred: numpy, only to report

    costs = step.get("step_costs")
    if not costs:
        return []
    return ["## What the served steps cost", "", *_corun_lines(step.get("corun") or {}),
            "Straight lines through every worker's step timeline (`python -m artifact.step_costs logs/timeline`): "
            "a decode step against its context on each share; a mixed step of a full chunk budget against the decode "
            "rows beside it (what a decode row adds to a step that computes anyway); a prefill layer group's time "
            "per layer by tokens (equal across sizes: launches, not math, set the pace). Outliers (over 3x the "
            "median: set-ups, first steps) left out.", "", *markdown(costs), ""]


def _corun_lines(corun: dict) -> list[str]:
    """Each two-worker system's co-run scale S, against what the partition ledger's verdict needs."""
    if not corun:
        return []
    lines = ["Co-running steps against the profile's co-run table (`python -m artifact.served_corun`: per role and "
             "share, observed/priced beside the other worker over the same alone; 1 = as profiled). The simulated "
             "verdict (`docs/sim/ledger.md` §4) holds bullet >= 1.2x the best baseline on two workloads for S <~ 1.13 "
             "and a win beyond Azure-Code for S <~ 1.4.", ""]
    for system, c in corun.items():
        judged = ", ".join(f"{s['role']} on {s['units']} units {s['scale']:.2f} ({s['beside_steps']} beside, "
                           f"{s['alone_steps']} alone)" for s in c.get("shares", []) if "scale" in s)
        lines.append(f"- {system}: S = {_fmt(c.get('scale'))}" + (f" — {judged}" if judged else
                     " — no share ran enough steps both alone and beside the other worker's"))
    return lines + [""]


def _not_measured(title: str, step: dict) -> list[str]:
    return [f"## {title}", "", f"Not measured ({step.get('status', 'not run')}: {step.get('summary', '')}).", ""]


def _profile_section(step: dict) -> list[str]:
    found = step.get("findings")
    if not found:
        return []
    return ["## What the profile measured", "",
            "The bullet policy's profile (`bullet profile --device cuda --quick`): whether decode attention pays "
            "for each request's own context or the batch's longest, and its timed hybrid steps against what the "
            "estimator predicts for them from decode's calibration alone (the simulator's chunked baseline "
            "before profiles timed hybrid steps).", "", *(f"- {line}" for line in found), ""]


def _kernels_section(bench: dict, replay: dict) -> list[str]:
    """Triton compiles after the warm-ups and kernels that fell back to torch lines: the engine
    benchmark's own count and fallbacks, and each served worker's (from its timeline)."""
    kernels = (bench.get("engine") or {}).get("kernels") or {}
    served = replay.get("kernels") or {}
    if not kernels and not served:
        return []
    lines = ["## Triton compiles and kernel fallbacks", "",
             "Every Triton variant a runner can launch is compiled by a warm-up before measuring or serving "
             "(`engines.kernel_warmup`); a compile after it lands inside a timed or served step. A kernel that "
             "failed on this GPU runs as torch lines from then on (slower): its numbers above are torch's.", ""]
    if kernels:
        warm, compiles = kernels.get("warm_up", {}), kernels.get("triton_compiles", {})
        counted = compiles.get("counted")
        lines.append(f"- engine benchmark: warm-up of {warm.get('steps', '-')} steps in {_fmt(warm.get('seconds'))} s "
                     f"(decode split counts {warm.get('split_counts') or '-'}); Triton compiles "
                     + (f"{compiles.get('warm_up')} in the warm-up, **{compiles.get('after_warm_up')} after it**"
                        + (f" ({', '.join(compiles['kernels_after_warm_up'])})" if compiles.get("kernels_after_warm_up")
                           else "") if counted else "not counted (triton interpreted or absent)"))
        fallbacks = kernels.get("fallbacks") or []
        lines += [f"- engine benchmark: **{f['kernel']} fell back** to {f['instead']}: {f['error']}" for f in fallbacks]
        if not fallbacks:
            lines.append("- engine benchmark: no kernel fell back")
    if served:
        lines += ["", *_table(["system", "worker", "Triton compiles while serving", "kernel fallbacks", "timeline rows"],
                              [[system, role, r.get("triton_compiles", 0),
                                "; ".join(r.get("kernel_fallbacks") or []) or "none", r.get("rows", "-")]
                               for system, roles in served.items() for role, r in roles.items()])]
    return lines + [""]


def _cut_note(bench: dict) -> str:
    """What a benchmark stopped at its cap finished (its JSON is rewritten after every section)."""
    if bench.get("complete", True):
        return ""
    return (f" **Cut short**: only {', '.join(bench.get('sections_done', []))} finished; the sections after them "
            "were not measured.")


def _engine_section(step: dict) -> list[str]:
    e = step.get("engine")
    if not e or "rates" not in e:
        return _not_measured("Engine micro-benchmark", step)
    r, c, cut = e["rates"], e["config"], _cut_note(e)
    lines = ["## Engine micro-benchmark", "",
             f"{c['model']} ({c['dtype']}, dummy weights) on {c['device']} through `ModelRunner` / `DecodeGraphs`; "
             f"measured copy bandwidth {r['copy_gbs']:.0f} GB/s (read + write of {r['copy_mib']:.0f} MiB), "
             f"{c['dtype']} GEMM {r['gemm_tflops']:.1f} TFLOP/s ({r['gemm_n']}^3). Floor = (weights + KV read) / bandwidth; "
             f"prefill against model FLOPs / GEMM rate. {e.get('graphs_note', '')}{cut}", ""]
    p = e.get("prefill")
    rows = [] if not p else [[f"prefill {p['tokens']}", "-", f"{p['ms']:.2f}", f"{p['model_tflop']:.2f} TFLOP",
                              f"{p['tflops']:.1f} TFLOP/s", f"{p['of_gemm']:.0%} of GEMM"]]
    for d in e.get("decode", []):
        rows.append([f"decode {d['batch']}x{d['context']}", d["graphs"], f"{d['ms']:.2f}" if d.get("ms") else d.get("error", "-"),
                     f"{d['floor_ms']:.2f} ms floor", f"{d['tok_s']:.0f} tok/s" if d.get("tok_s") else "-",
                     f"{d['over_floor']:.2f}x floor" if d.get("over_floor") else "-"])
    lines += _table(["step", "graphs", "ms", "floor / work", "rate", "ratio"], rows)
    fresh = e.get("new_lengths")
    if fresh:  # benchmarks before 2026-11-26 did not measure it
        lines += ["", "Prefill of a prompt of a length not run before (first call, then the same prompt again; "
                  "medians over its lengths): what a per-shape set-up adds to every new prompt.", ""]
        lines += _table(["attention backends", "lengths", "first ms", "again ms"],
                        [[name, ", ".join(map(str, r["lengths"])), f"{r['first_ms']:.2f}", f"{r['again_ms']:.2f}"]
                         for name, r in fresh.items()])
    mixed = e.get("mixed")
    if mixed:  # benchmarks before 2026-11-27 did not measure it
        lines += ["", "Mixed steps (a fresh prompt chunk beside decode rows): the decode rows on the decode kernel "
                  "(the runner's split) against one extend kernel over every row (before the split).", ""]
        lines += _table(["step", "split ms", "one extend ms", "one extend / split"],
                        [[f"{r['prompt']} + {r['batch']}x{r['context']}", f"{r['split_ms']:.2f}",
                          f"{r['one_extend_ms']:.2f}", f"{r['one_extend_x_split']:.2f}x"] for r in mixed])
    stages = e.get("fused")
    if stages:  # benchmarks before 2026-11-27 did not measure it
        lines += ["", "The layer's small stages (RMSNorm, RoPE, SwiGLU) as one kernel each against torch's lines "
                  "(`BULLET_FUSED_KERNELS=0`); decode graphs captured anew for each.", ""]
        lines += _table(["step", "fused ms", "torch lines ms", "torch lines / fused"],
                        [[r["step"], f"{r['fused_ms']:.2f}" if "fused_ms" in r else r.get("error", "-"),
                          f"{r['torch_lines_ms']:.2f}" if "torch_lines_ms" in r else "-",
                          f"{r['torch_lines_x_fused']:.2f}x" if "torch_lines_x_fused" in r else "-"] for r in stages])
    return lines


def _models_section(step: dict) -> list[str]:
    m = step.get("models")
    if not m or "rates" not in m:
        return _not_measured("Other models and formats", step)
    c, g, cut = m["config"], m.get("fp8_gemm"), _cut_note(m)
    lines = ["## Other models and formats", "",
             f"`python -m artifact.benchmarks.bench_models_gpu` on {c['device']}: copy bandwidth "
             f"{m['rates']['copy_gbs']:.0f} GB/s. FP8 GEMMs: e4m3 operands with one scale per row "
             f"(`torch._scaled_mm`, and the engine's `Fp8Linear` with its per-row activation quantization) against "
             f"{c['dtype']} at {c['gemm_model']}'s projection shapes. Decode: dummy weights, floor = (weights read + KV) / "
             f"bandwidth, a mixture of experts counting the experts its tokens picked. {m.get('note', '')}{cut}", ""]
    if g:
        lines += _table(["projection", "M x N x K", f"{g['dtype']} TFLOP/s", "_scaled_mm TFLOP/s", "Fp8Linear TFLOP/s",
                         "block-scaled Fp8Linear TFLOP/s"],
                        [[r["proj"], f"{r['m']}x{r['n']}x{r['k']}", f"{r['float_tflops']:.1f}",
                          f"{r['scaled_mm_tflops']:.1f} ({r['scaled_mm_x_float']:.2f}x)",
                          f"{r['fp8_linear_tflops']:.1f} ({r['fp8_linear_x_float']:.2f}x)",
                          f"{r['block_linear_tflops']:.1f} ({r['block_linear_x_float']:.2f}x)" if "block_linear_tflops" in r
                          else "-"] for r in g["rows"]])
        lines += [g["block_note"], ""] if g.get("block_note") else []
    rows = []
    for model in m.get("models", []):
        name = model["model"] + (":fp8" if model["quantization"] == "fp8" else "")
        if model.get("prefill"):
            rows.append([name, f"prefill {model['prefill']['tokens']}", f"{model['prefill']['ms']:.2f}", "-", "-", "-"])
        for d in model.get("decode", []):
            experts = f"{d['experts_touched_per_layer']:.1f} ({d['experts_uniform_per_layer']:.1f} uniform)" \
                if "experts_touched_per_layer" in d else "-"
            rows.append([name, f"decode {d['batch']}x{d['context']}", f"{d['eager_ms']:.2f} / " +
                         (f"{d['graphs_ms']:.2f}" if "graphs_ms" in d else d.get("error", "-")),
                         f"{d['floor_ms']:.2f}", f"{d['over_floor']:.2f}x" if "over_floor" in d else "-", experts])
    if rows:
        lines += _table(["model", "step", "ms (eager / graphs)", "floor ms", "graphs / floor", "experts a layer"], rows)
    for model in m.get("models", []):
        k = model.get("kernels") or {}
        if k:
            fell = "; ".join(f"{f.get('kernel')} fell back to {f.get('instead')}" for f in k.get("fallbacks", []))
            lines.append(f"- {model['model']}{':fp8' if model['quantization'] == 'fp8' else ''}: warm-up "
                         f"{_fmt(model.get('warm_up_s'))} s, {k.get('warm_up_compiles', '-')} Triton compiles in it, "
                         f"{k.get('compiles_after_warm_up', '-')} after it; " + (fell or "no kernel fell back"))
    lines += [f"- **{e['model']} failed**: {e['error'][:300]}" for e in m.get("errors", [])]
    return lines + [""]


def _served_section(step: dict) -> list[str]:
    systems = step.get("systems")
    if not systems:
        return _not_measured("Served comparison", step)
    w = step.get("workload", {})
    if "warmup_s" not in w:
        return _burst_section(step)
    lines = ["## Served comparison (steady state)", "",
             f"Open-loop Poisson arrivals for {w['window_s']:g} s per point, the same prompts and arrival times for every "
             f"system (seed per rate); random token-id prompts of {w.get('prompt_tokens')} tokens, "
             f"{w.get('output_tokens')} output tokens (ignore_eos), streamed `/generate` with `input_ids`; each server "
             f"launched once for all its rates. The first {w['warmup_s']:g} s of arrivals are a warm-up, served and not "
             f"scored; after the last arrival a point drains until every request finished, at most {w['drain_cap_s']:.1f} s "
             "(the longest a request can take and still meet the SLO), sooner once every request left has missed; "
             f"requests cut either way count as misses. SLO: {step.get('slo')}. req/s: requests finished between the "
             "warm-up's end and the last arrival, over that span. Goodput: the highest rate with >= 90 % of its measured "
             "requests in SLO, with its 95 % bootstrap interval over the requests and the bracket up to the next rate served.",
             ""]
    if step.get("dropped_rates"):
        lines += [f"Not served, for time: {', '.join(step['dropped_rates'])}.", ""]
    rows = []
    for name, s in systems.items():
        if not s.get("per_rate"):
            rows.append([name, s.get("backend", "-"), "-", s.get("skipped") or s.get("error", "-")[:200], *["-"] * 8])
            continue
        interval = s.get("interval")
        good = f"{_fmt(s.get('goodput_req_s'))}" + (f" [{interval['low']:g}, {interval['high']:g}]" if interval else "")
        bracket = s.get("bracket") or [None, None]
        good += f"; knee in [{bracket[0]:g}, {'-' if bracket[1] is None else f'{bracket[1]:g}'})"
        for rate, p in s["per_rate"].items():
            rows.append([name, s["backend"], rate, f"{p['completed']}/{p['measured']} (+{p['warmup_requests']} warm-up)",
                         str(p["cut"]), f"{p['req_per_s']:.2f}", f"{_ms(p['ttft_p50_s'])} / {_ms(p['ttft_p90_s'])}",
                         f"{_ms(p['tpot_p50_s'])} / {_ms(p['tpot_p90_s'])}", _ms(p["itl_p99_s"]),
                         f"{p['attainment']:.0%}", p.get("ended", "-"), good])
    lines += _table(["system", "backend", "req/s offered", "measured done", "cut", "req/s", "TTFT p50/p90 ms",
                     "TPOT p50/p90 ms", "P99 gap ms", "SLO attained", "point ended", "goodput req/s"], rows)
    return lines + _system_notes(systems) + [""]


def _system_notes(systems: dict) -> list[str]:
    return [f"- {n}: started in {_fmt(s.get('launch_s'))} s, MPS {'on' if s.get('mps') else 'off'}, tokenizer "
            f"{s.get('tokenizer') or 'none'}"
            f"{' (token ids without one failed: ' + s['tokenless_error'] + ')' if s.get('tokenless_error') else ''}; "
            f"stopped with exit {s.get('exit')}, leftover processes killed: {s.get('killed_leftover_pids') or 'none'}, "
            f"GPU memory held after: {s.get('gpu_memory_held_after') or 'none'}"
            for n, s in systems.items() if s.get("launch_s") is not None]


def _burst_section(step: dict) -> list[str]:
    """Runs before the steady-state points (2026-11-26): each point a burst drained to its end."""
    systems, w = step["systems"], step.get("workload", {})
    lines = ["## Served comparison", "",
             f"Open-loop Poisson arrivals, random token-id prompts of {w.get('prompt_tokens')} tokens, "
             f"{w.get('output_tokens')} output tokens (ignore_eos), streamed `/generate` with `input_ids`; the same prompts "
             f"and arrival times per point for every system (seed per point). SLO: {step.get('slo')}. Goodput: the highest "
             "rate with >= 90 % attainment.", ""]
    rows = []
    for name, s in systems.items():
        if not s.get("per_rate"):
            rows.append([name, s.get("backend", "-"), "-", s.get("skipped") or s.get("error", "-")[:200], *["-"] * 7])
            continue
        for rate, p in s["per_rate"].items():
            rows.append([name, s["backend"], rate, f"{p['completed']}/{p['requests']}", f"{p['req_per_s']:.2f}",
                         f"{p['output_tok_per_s']:.0f}", f"{_ms(p['ttft_p50_s'])} / {_ms(p['ttft_p90_s'])}",
                         f"{_ms(p['tpot_p50_s'])} / {_ms(p['tpot_p90_s'])}", _ms(p["itl_p99_s"]),
                         f"{p['attainment']:.0%}", _fmt(s.get("goodput_req_s"))])
    lines += _table(["system", "backend", "req/s offered", "done", "req/s", "out tok/s", "TTFT p50/p90 ms",
                     "TPOT p50/p90 ms", "P99 gap ms", "SLO attained", "goodput"], rows)
    return lines + _system_notes(systems) + [""]


def _doctor_section(off: dict, on: dict) -> list[str]:
    if not off.get("checks") and not on.get("checks"):
        return []
    names = list(dict.fromkeys([c["name"] for c in off.get("checks", [])] + [c["name"] for c in on.get("checks", [])]))
    by = [{c["name"]: c for c in s.get("checks", [])} for s in (off, on)]
    rows = [[n, *(f"{d[n]['status']}: {d[n]['summary'][:140]}" if n in d else "-" for d in by)] for n in names]
    return ["## bullet doctor", "", *_table(["check", "MPS off", "MPS on"], rows)]


def _tests_section(step: dict) -> list[str]:
    if not step.get("cases"):
        return [] if not step else ["## GPU tests", "", f"{step.get('status')}: {step.get('summary')}", ""]
    rows = [[c["test"], c["outcome"], (c.get("message") or "")[:200]] for c in step["cases"]]
    return ["## GPU tests (`pytest -m gpu`)", "", *_table(["test", "outcome", "message"], rows)]
