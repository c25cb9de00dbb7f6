"""bench_quality's arithmetic, on NLL tensors made here: the windows it cuts, the paired ratio to fp32,
greedy agreement, and the table — with llama.cpp's PPL in the PPL column where both tokenizers agree,
and in a column of its own (beside every mode scored on llama.cpp's ids) where they do not."""

from __future__ import annotations

import math

import pytest
import torch

from artifact.benchmarks.bench_quality import windows
from artifact.benchmarks.quality_report import agreement, paired, table, window_nll


def test_windows_are_consecutive_and_too_short_a_text_is_refused():
    assert windows(list(range(10)), 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(SystemExit, match="2 windows of 4, 3 asked for"):
        windows(list(range(10)), 4, 3)


def test_paired_ratio_is_exp_of_the_mean_nll_difference_with_its_interval():
    ref = torch.rand(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 1
    delta = torch.tensor([0.01, 0.03] * 16, dtype=torch.float64).reshape(4, 8)
    p = paired(ref + delta, ref)
    assert p["mean_nll_delta"] == pytest.approx(0.02)
    assert p["ppl_ratio"] == pytest.approx(math.exp(0.02))
    se = float(delta.flatten().std()) / math.sqrt(32)
    assert p["ppl_ratio_95"] == pytest.approx([math.exp(0.02 - 1.96 * se), math.exp(0.02 + 1.96 * se)])
    assert paired(ref, ref)["ppl_ratio_95"] == [1.0, 1.0]


def test_agreement_counts_first_tokens_exact_continuations_and_the_common_prefix():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got = [[1, 2, 3], [4, 0, 6], [0, 8, 9]]
    assert agreement(got, ref) == {"first_token": 2 / 3, "exact": 1 / 3,
                                   "mean_tokens_before_first_difference": (3 + 1 + 0) / 3}


def test_window_nll_is_recovered_from_llama_perplexitys_running_ppl():
    means = [1.3, 1.7, 1.5]
    running = [math.exp(sum(means[:k]) / k) for k in (1, 2, 3)]
    output = "perplexity: 0.5 seconds per pass\n" + ",".join(f"[{k}]{p:.4f}" for k, p in enumerate(running, 1))
    assert window_nll(output) == pytest.approx(means, abs=1e-4)


def ratio(r: float) -> dict:
    return {"ppl_ratio": r, "ppl_ratio_95": [r - 0.001, r + 0.001]}


def result(ppl: float, vs_fp32: float, on_llama: float | None = None, llamacpp_vs_this: float = 1.01) -> dict:
    r = {"ppl": ppl, "vs_fp32": ratio(vs_fp32), "llamacpp_vs_this": ratio(llamacpp_vs_this)}
    if on_llama is not None:
        r["on_llamacpp_ids"] = {"ppl": on_llama, "vs_fp32": ratio(vs_fp32)}
    return r


GREEDY = {"int8": {"first_token": 0.9, "exact": 0.25, "mean_tokens_before_first_difference": 15.0},
          "fp32, 8 at a time": {"first_token": 1.0, "exact": 1.0, "mean_tokens_before_first_difference": 32.0}}


def test_table_without_llamacpp_has_no_llamacpp_columns():
    rows = table({"fp32": result(5.0, 1.0), "int8": result(5.02, 1.004)}, GREEDY, None)
    assert [r["mode"] for r in rows] == ["fp32", "int8", "fp32, 8 at a time"]
    assert not any("llama" in column for column in rows[0])


def test_table_with_the_same_token_ids_puts_llamacpp_beside_fp32():
    rows = table({"fp32": result(5.0, 1.0), "int8": result(5.02, 1.004, llamacpp_vs_this=1.006)}, GREEDY,
                 {"ppl": 5.05, "same_token_ids": True})
    assert [r["mode"] for r in rows] == ["fp32", "int8", "fp32, 8 at a time", "llama.cpp (llama-perplexity)"]
    assert "PPL, llama.cpp's ids" not in rows[0]
    assert rows[1]["PPL / fp32"] == "1.0040 [1.0030, 1.0050]" and rows[1]["all tokens = fp32"] == 0.25
    assert rows[1]["llama.cpp / this, by window"] == "1.0060 [1.0050, 1.0070]"
    assert rows[3]["PPL"] == 5.05 and rows[3]["PPL / fp32"] == "1.0100 [1.0090, 1.0110]"


def test_table_with_other_token_ids_compares_llamacpp_on_its_own_ids():
    rows = table({"fp32": result(5.0, 1.0, on_llama=4.9), "int8": result(5.02, 1.004, on_llama=4.92)}, GREEDY,
                 {"ppl": 4.949, "same_token_ids": False})
    llama = rows[-1]
    assert llama["PPL"] == "" and llama["PPL, llama.cpp's ids"] == 4.949
    assert llama["/ fp32 (llama.cpp's ids)"] == "1.0100 [1.0090, 1.0110]"
    assert rows[1]["PPL, llama.cpp's ids"] == 4.92 and rows[1]["PPL"] == 5.02
    assert all(list(r) == list(rows[0]) for r in rows)  # every row has every column, in one order
