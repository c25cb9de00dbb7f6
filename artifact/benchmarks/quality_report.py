"""bench_quality's arithmetic and report: paired perplexity ratios, greedy agreement, the per-window
NLL recovered from llama-perplexity's output, and the table (console and markdown)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict:
    prefix = []
    for g, r in zip(got, ref):
        k = 0
        while k < min(len(g), len(r)) and g[k] == r[k]:
            k += 1
        prefix.append(k)
    n = len(ref)
    return {"first_token": sum(g[:1] == r[:1] for g, r in zip(got, ref)) / n,
            "exact": sum(g == r for g, r in zip(got, ref)) / n,
            "mean_tokens_before_first_difference": sum(prefix) / n}


def paired(nll: torch.Tensor, ref: torch.Tensor) -> dict:
    """Mean NLL difference to the reference per scored token, its standard error, and the PPL ratio."""
    d = (nll - ref).flatten()
    se = float(d.std() / math.sqrt(d.numel()))
    return {"mean_nll_delta": float(d.mean()), "nll_delta_se": se, "ppl_ratio": math.exp(float(d.mean())),
            "ppl_ratio_95": [math.exp(float(d.mean()) - 1.96 * se), math.exp(float(d.mean()) + 1.96 * se)]}


def window_nll(output: str) -> list[float]:
    """Each window's mean NLL, recovered from the running PPL llama-perplexity prints after every window
    (`[k]ppl`: exp of the mean over windows 1..k, every window scoring the same number of tokens). The
    printed 4 decimals leave each value within ~k * 2e-5 nats of the true mean."""
    running = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", output)]
    totals = [k * math.log(ppl) for k, ppl in enumerate(running, 1)]
    return [b - a for a, b in zip([0.0, *totals], totals)]


def table(results: dict, greedy_rows: dict, llamacpp: dict | None) -> list[dict]:
    """One row per mode. Where llama.cpp's tokenizer parts from Bullet's, the modes were also scored on
    llama.cpp's own windows: those PPLs (and llama-perplexity's) sit in a column of their own."""
    on_llama = any("on_llamacpp_ids" in r for r in results.values())
    blank = {"mode": "", "PPL": "", "PPL / fp32": "", **({"PPL, llama.cpp's ids": "", "/ fp32 (llama.cpp's ids)": ""}
                                                         if on_llama else {}),
             **({"llama.cpp / this, by window": ""} if llamacpp else {}),
             "first token = fp32": "", "all tokens = fp32": "", "tokens before 1st diff": ""}

    def interval(v: dict) -> str:
        lo, hi = v["ppl_ratio_95"]
        return f"{v['ppl_ratio']:.4f} [{lo:.4f}, {hi:.4f}]"

    rows = []
    for mode, r in results.items():
        row = {**blank, "mode": mode, "PPL": r["ppl"], "PPL / fp32": interval(r["vs_fp32"])}
        if "on_llamacpp_ids" in r:
            row["PPL, llama.cpp's ids"] = r["on_llamacpp_ids"]["ppl"]
            row["/ fp32 (llama.cpp's ids)"] = interval(r["on_llamacpp_ids"]["vs_fp32"])
        if llamacpp and "llamacpp_vs_this" in r:
            row["llama.cpp / this, by window"] = interval(r["llamacpp_vs_this"])
        rows.append(row)
    for row in rows:
        g = greedy_rows.get(row["mode"], {})
        row.update({"first token = fp32": g.get("first_token", ""), "all tokens = fp32": g.get("exact", ""),
                    "tokens before 1st diff": g.get("mean_tokens_before_first_difference", "")})
    for mode, g in greedy_rows.items():
        if mode not in results:
            rows.append({**blank, "mode": mode, "first token = fp32": g["first_token"], "all tokens = fp32": g["exact"],
                         "tokens before 1st diff": g["mean_tokens_before_first_difference"]})
    if llamacpp:
        row = {**blank, "mode": "llama.cpp (llama-perplexity)"}
        vs_fp32 = interval(results["fp32"]["llamacpp_vs_this"])  # paired by window, not by token
        if on_llama:
            row["PPL, llama.cpp's ids"], row["/ fp32 (llama.cpp's ids)"] = llamacpp["ppl"], vs_fp32
        else:
            row["PPL"], row["PPL / fp32"] = llamacpp["ppl"], vs_fp32
        rows.append(row)
    return rows


def write_markdown(rows: list[dict], meta: dict, llamacpp: dict | None, path: Path) -> None:
    cols = list(rows[0])
    lines = [f"# Quality of each serving mode ({meta['when']})", "",
             f"{meta['model']}; perplexity over {meta['chunks']} windows of {meta['ctx']} tokens of the first "
             f"{meta['conversations']} ShareGPT conversations ({meta['scored_tokens']} scored tokens, the second half "
             f"of each window, as llama-perplexity scores); greedy: {meta['prompts']} prompts, {meta['greedy_tokens']} "
             f"tokens each. PPL / fp32: paired ratio (by token) with its 95 % interval; llama.cpp / this: paired by "
             f"window. CPU flags: {' '.join(meta['cpu_flags'])}.",
             ""]
    if llamacpp and not llamacpp["same_token_ids"]:
        count = llamacpp["token_count"]
        lines += [f"llama.cpp's tokenizer gives other ids than Bullet's ({count['llama.cpp']} tokens, Bullet "
                  f"{count['bullet']}): every mode is also scored on llama-perplexity's own windows "
                  "(the llama.cpp's ids columns), the comparison with llama-perplexity on the same tokens.", ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    path.write_text("\n".join(lines) + "\n")
