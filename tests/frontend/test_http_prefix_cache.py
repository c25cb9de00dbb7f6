"""The prefix cache served end to end: a conversation's second turn reports `cached_tokens` (native
and OpenAI), prefills faster, and answers exactly what a cold engine answers — through the two
workers (prefill owns the cache, decode hands finished pages back) and through the unified worker
of `chunked:<budget>`; /flush_cache empties it when nothing runs and refuses while something does;
`--disable-radix-cache` turns it off; /metrics exports the hit rate."""

from __future__ import annotations

import threading
import time

import pytest

from tests.frontend.helpers import metric, wait_idle
from tests.launcher.test_two_process_runtime import TEXT
from tests.server_utils import ServerProcess, pages_accounted, wait_for

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def offline():
    import bullet

    return bullet.LLM(dtype="float32", max_total_tokens=8192)


@pytest.fixture(scope="module", params=["bullet", "chunked:256"])
def warm(request, fp32_srm_profile):
    profile = ("--estimator-profile", fp32_srm_profile) if request.param == "bullet" else ()
    with ServerProcess("--dtype", "float32", "--max-total-tokens", "8192", "--policy", request.param, *profile) as srv:
        yield srv


def generate(server, ids, params=GREEDY):
    status, body = server.post("/generate", {"input_ids": ids, "sampling_params": params})
    assert status == 200, body
    return body


def flushed(server) -> None:
    """The server with an empty prefix cache (the tests of this module run in any order)."""
    wait_idle(server)
    status, body = server.post("/flush_cache", {})
    assert status == 200, body
    wait_for(lambda: server.state()["kv_pages_cached"] == 0, 10, "the cache to empty")


def test_second_turn_is_cached_and_matches_a_cold_engine(warm, offline):
    flushed(warm)  # turn 1 must meet a cold cache (another test may have served the same text)
    ids = offline.encode(TEXT * 3)
    turn1 = ids[:150]  # ends mid-page: its last 6 tokens are recomputed
    first = generate(warm, turn1)
    assert first["meta_info"]["cached_tokens"] == 0
    turn2 = turn1 + first["output_ids"] + ids[400:437]
    second = generate(warm, turn2)
    cached = second["meta_info"]["cached_tokens"]
    assert 144 <= cached <= len(turn1) + len(first["output_ids"]) and cached % 16 == 0
    cold = offline.generate([turn2], GREEDY)[0]
    assert second["output_ids"] == cold.output_ids
    assert first["output_ids"] == offline.generate([turn1], GREEDY)[0].output_ids
    assert pages_accounted(wait_idle(warm))


def test_a_cached_prefix_prefills_faster(warm, offline):
    ids = offline.encode(TEXT * 3)
    assert len(ids) > 700
    long = ids[:700]
    one = {"temperature": 0, "max_new_tokens": 1}
    cold = generate(warm, long + [42] * 9, one)["meta_info"]
    hot = generate(warm, long + [43] * 9, one)["meta_info"]
    assert cold["cached_tokens"] < 700 <= hot["cached_tokens"] + 16
    assert hot["e2e_latency"] < 0.6 * cold["e2e_latency"], (hot["e2e_latency"], cold["e2e_latency"])


def test_openai_usage_reports_cached_tokens(warm):
    system = ("You are a careful assistant who answers questions about the history of computing. " * 8).strip()
    body = {"model": "default", "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Who was Babbage?"}]}
    status, first = warm.post("/v1/chat/completions", body)
    assert status == 200, first
    body["messages"][-1]["content"] = "Who was Ada Lovelace?"
    status, second = warm.post("/v1/chat/completions", body)
    assert status == 200, second
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 64
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_multi_turn_replay_reuses_each_conversation_history(warm):
    from bullet.workloads.multiturn import synthetic_conversations
    from bullet.workloads.multiturn_client import replay

    convs = synthetic_conversations(2, rate=5.0, turns=3, user_tokens=40, answer_tokens=8, seed=4)
    records = replay(warm.url, convs, encode=lambda text: [], think_s=0.1)
    assert len(records) == 6 and all(r.ok for r in records)
    for r in records:
        assert r.prompt_tokens == 40 * (r.turn + 1) + 8 * r.turn and r.output_tokens == 8
        if r.turn:  # the history is the previous turn's prompt and answer (its last token has no K/V yet)
            assert r.cached_tokens == (r.prompt_tokens - 40 - 1) // 16 * 16


def test_metrics_export_the_hit_rate(warm):
    ids = list(range(2000, 2100))  # a hit of this test's own, whatever ran before it
    generate(warm, ids)
    assert generate(warm, ids + [9])["meta_info"]["cached_tokens"] > 0
    status, text = warm.get("/metrics")
    assert status == 200
    model = {"model_name": warm.get("/model_info")[1]["served_model_name"]}
    assert 0 < metric(text, "sglang:cache_hit_rate", model) < 1
    assert metric(text, "sglang:cached_tokens_total", model) > 0
    state = warm.state()
    assert metric(text, "bullet:kv_pages_cached") == state["kv_pages_cached"] > 0


def test_the_default_models_answer_does_not_depend_on_what_the_cache_held(server):
    """The default server (the int8 model): one prompt prefilled cold, then again from the cache, then
    after another prompt cached only its first pages — the same tokens and log-probabilities to the
    bit. The int8 model rounds activations to 8 bits per token, so attention whose sums followed the
    chunk's length (SDPA's blocks) moved these log-probabilities by up to ~0.1 with what was cached."""
    prompt = TEXT[:400]

    def run(text):
        status, body = server.post("/generate", {"text": text, "return_logprob": True,
                                                 "sampling_params": {**GREEDY, "max_new_tokens": 8}})
        assert status == 200, body
        return body

    flushed(server)
    cold, full = run(prompt), run(prompt)
    flushed(server)
    run(prompt[:150] + " and then something else entirely.")
    part = run(prompt)
    cached = [b["meta_info"]["cached_tokens"] for b in (cold, full, part)]
    assert cached[0] == 0 and cached[1] > cached[2] > 0, cached
    for body in (full, part):
        assert body["output_ids"] == cold["output_ids"]
        assert body["meta_info"]["output_token_logprobs"] == cold["meta_info"]["output_token_logprobs"]


def test_flush_cache_refuses_while_a_request_runs_then_empties_the_cache(warm):
    # pages of this test's own in the cache, whatever ran before it: a request aborted a few tokens in
    # may leave none (a shuffled CI run had the module's other tests flush everything first)
    generate(warm, list(range(3000, 3100)))
    rid = f"flush-{time.monotonic_ns()}"
    long = {"text": "Tell me a long story.", "rid": rid,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    worker = threading.Thread(target=lambda: warm.post("/generate", long), daemon=True)
    worker.start()
    try:
        wait_for(lambda: warm.state()["inflight_requests"] == 1, 30, "the request to run")
        status, body = warm.post("/flush_cache", {})
        assert status == 400 and "running" in body["message"]
    finally:
        warm.post("/abort_request", {"rid": rid})
        worker.join(30)
    wait_idle(warm)
    assert warm.state()["kv_pages_cached"] > 0
    status, body = warm.post("/flush_cache", {})
    assert status == 200 and body["message"] == "Cache flushed."
    wait_for(lambda: warm.state()["kv_pages_cached"] == 0, 10, "the cache to empty")
    state = warm.state()
    assert state["kv_pages_free"] == state["kv_pages_total"]
    ids = list(range(1000, 1100))
    generate(warm, ids)
    assert generate(warm, ids + [7])["meta_info"]["cached_tokens"] == 96  # it fills again


def test_disable_radix_cache_frees_every_page(offline):
    with ServerProcess("--dtype", "float32", "--max-total-tokens", "8192", "--policy", "static",
                       "--disable-radix-cache") as srv:
        ids = offline.encode(TEXT * 3)[:120]
        generate(srv, ids)
        again = generate(srv, ids + [5, 6])
        assert again["meta_info"]["cached_tokens"] == 0
        assert again["output_ids"] == offline.generate([ids + [5, 6]], GREEDY)[0].output_ids
        state = wait_idle(srv)
        assert state["kv_pages_free"] == state["kv_pages_total"] and state["kv_pages_cached"] == 0
        assert srv.post("/flush_cache", {})[0] == 200
