"""`python -m sglang.bench_serving` (sglang 0.5.2, run as a subprocess, offline) against the server
on the repaired ShareGPT file: every request completes, and the token counts the client reports
match the server's own /metrics counters.

* `--backend sglang` (/generate): exact. The client counts prompt tokens with the server's
  tokenizer directory and output tokens from the streamed `meta_info.completion_tokens`.
* `--backend sglang-oai-chat` (/v1/chat/completions): the client counts the raw user text, while
  the server also counts the chat template around it — a constant number of tokens per request,
  computed here from the tokenizer. Its output count is the requested length (the 0.5.2 chat
  parser only reads `usage`, which a spec-following server sends only when asked, and asking would
  break that parser), so the run sets ignore_eos to make "requested" and "generated" the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.frontend.helpers import token_counters

pytest.importorskip("sglang")
sharegpt = pytest.importorskip("bullet.workloads.sharegpt")

NUM_PROMPTS = 24
OUTPUT_LEN = 16
CONTEXT_CAP = 384  # prompt + output tokens: keeps the prefill work to ~2k tokens per run


@pytest.fixture(scope="module")
def dataset():
    try:
        return sharegpt.repaired_sharegpt_path()
    except sharegpt.DatasetMissing as exc:
        pytest.skip(str(exc))


def run_bench(server, dataset, tokenizer_dir: str, backend: str, out_file, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", server.url,
           "--tokenizer", tokenizer_dir, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
           "--num-prompts", str(NUM_PROMPTS), "--sharegpt-output-len", str(OUTPUT_LEN),
           "--sharegpt-context-len", str(CONTEXT_CAP), "--request-rate", "8", "--seed", "1",
           "--warmup-requests", "0",  # a warmup request would add to our counters but not to theirs
           "--output-file", str(out_file), "--output-details", "--disable-tqdm", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench_serving failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [ln for ln in out_file.read_text().splitlines() if ln.strip()]
    result = json.loads(lines[-1])
    print(f"\n{backend}: completed {result['completed']}, input {result['total_input_tokens']}, "
          f"output {result['total_output_tokens']}, retokenized {result['total_output_tokens_retokenized']}, "
          f"duration {result['duration']:.1f}s")
    return result


@pytest.fixture(scope="module")
def tokenizer_dir(server):
    return server.get("/model_info")[1]["tokenizer_path"]


def test_sglang_backend_counts_match_ours_exactly(server, dataset, tokenizer_dir, tmp_path):
    before = token_counters(server)
    result = run_bench(server, dataset, tokenizer_dir, "sglang", tmp_path / "sglang.jsonl")
    prompt, generated = (a - b for a, b in zip(token_counters(server), before))
    print(f"ours: input {prompt:.0f}, output {generated:.0f}")
    assert result["completed"] == NUM_PROMPTS
    assert result["total_input_tokens"] == sum(result["input_lens"]) == prompt
    assert result["total_output_tokens"] == generated == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos is on by default
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0  # cumulative completion_tokens streamed


def test_openai_chat_backend_counts_match_ours_up_to_the_template(server, dataset, tokenizer_dir, hf_tokenizer,
                                                                    tmp_path):
    before = token_counters(server)
    result = run_bench(server, dataset, tokenizer_dir, "sglang-oai-chat", tmp_path / "chat.jsonl",
                       "--extra-request-body", json.dumps({"ignore_eos": True}))
    prompt, generated = (a - b for a, b in zip(token_counters(server), before))
    template = _template_tokens(hf_tokenizer)
    print(f"ours: input {prompt:.0f} (= theirs + {NUM_PROMPTS} x {template} template tokens), output {generated:.0f}")
    assert result["completed"] == NUM_PROMPTS
    assert prompt == result["total_input_tokens"] + NUM_PROMPTS * template
    assert generated == result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # the streamed text, re-tokenized by the client, is as long as what we generated
    assert result["total_output_tokens_retokenized"] == pytest.approx(generated, rel=0.1)


def _template_tokens(tok) -> int:
    """Tokens the chat template adds around one user message."""
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False)) - len(tok.encode("x", add_special_tokens=False))
