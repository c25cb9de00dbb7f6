"""When the shared KV pool cannot hold every running sequence, no admitted request is lost: decode
hands the newest back to prefill, which recomputes its prompt and the tokens it already has when
memory frees up, and it rejoins the batch. Both clients get every token — the same greedy text as
when each runs alone — and every page comes back. (Runs on the `secured` server: its pool holds
512 tokens.)"""

from __future__ import annotations

import concurrent.futures as cf

from tests.http.helpers import AUTH, SMALL_POOL_TOKENS, post_stream, wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 tokens
MAX_NEW = 150  # two of these (~350 tokens each) cannot both fit in the pool
# the requests' prompts differ from their first token: with a shared prompt the prefix cache would hold
# it once for both, and they would fit


def prompt(i: int) -> str:
    return f"{i}. {PROMPT}"
PARAMS = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}


def _in_parallel(*calls):
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_pool_is_too_small_for_two(secured):
    prompt_tokens = secured.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})[1]
    assert 2 * (prompt_tokens["meta_info"]["prompt_tokens"] + MAX_NEW) > SMALL_POOL_TOKENS


def test_streams_that_do_not_fit_together_both_finish_with_their_solo_output(secured):
    solo = [secured.post("/generate", {"text": prompt(i), "sampling_params": PARAMS})[1]["output_ids"]
            for i in range(2)]
    results = _in_parallel(*[
        lambda i=i: post_stream(secured.url, "/generate", {"text": prompt(i), "stream": True,
                                                           "sampling_params": PARAMS}, headers=AUTH)
        for i in range(2)])
    for i, (status, _, events) in enumerate(results):
        assert status == 200 and events[-1] == "[DONE]"
        last = events[-2]
        assert "error" not in last, last
        assert last["meta_info"]["completion_tokens"] == MAX_NEW and last["output_ids"] == solo[i]
    assert "goes back to prefill to be recomputed" in secured.tail(2000)
    wait_idle(secured)


def test_non_streaming_requests_that_do_not_fit_together_both_finish(secured):
    body = {"model": "default", "max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}
    results = _in_parallel(*[lambda i=i: secured.post("/v1/completions", {**body, "prompt": prompt(i)})
                             for i in range(2)])
    for status, out in results:
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == MAX_NEW
    state = wait_idle(secured)
    assert state["worker_restarts"] == 0


def test_a_request_that_could_never_fit_is_refused_up_front(secured):
    status, out = secured.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 400}})
    assert status == 400 and "could never run" in out["error"]["message"], out
