"""The documented 503: when the shared KV pool cannot hold every running sequence, the decode worker
drops one request. A streaming client then gets `data: {"error": {...}}` followed by
`data: [DONE]`; a non-streaming one an HTTP 503 with a JSON error. The other request finishes, and
every page comes back. (Runs on the `secured` server: its pool holds 512 tokens.)"""

from __future__ import annotations

import concurrent.futures as cf

from tests.http.helpers import AUTH, SMALL_POOL_TOKENS, post_stream, wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 tokens
MAX_NEW = 150  # two of these (~350 tokens each) cannot both fit in the pool
PARAMS = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}


def _in_parallel(*calls):
    with cf.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_pool_is_too_small_for_two(secured):
    prompt_tokens = secured.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})[1]
    assert 2 * (prompt_tokens["meta_info"]["prompt_tokens"] + MAX_NEW) > SMALL_POOL_TOKENS


def test_stream_reports_the_drop_as_an_error_event_then_done(secured):
    results = _in_parallel(*[
        lambda i=i: post_stream(secured.url, "/generate", {"text": PROMPT + str(i), "stream": True,
                                                           "sampling_params": PARAMS}, headers=AUTH)
        for i in range(2)])
    outcomes = []
    for status, _, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        last = events[-2]
        outcomes.append("error" if "error" in last else last["meta_info"]["completion_tokens"])
        if "error" in last:
            assert last["error"]["code"] == 503 and "KV cache" in last["error"]["message"]
    assert sorted(outcomes, key=str) == sorted([MAX_NEW, "error"], key=str), outcomes
    wait_idle(secured)


def test_non_stream_reports_the_drop_as_503(secured):
    body = {"model": "default", "max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}
    results = _in_parallel(*[lambda i=i: secured.post("/v1/completions", {**body, "prompt": PROMPT + str(i)})
                             for i in range(2)])
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 503], results
    for status, out in results:
        if status == 503:
            assert out["object"] == "error" and "KV cache" in out["message"] and out["code"] == "unavailable"
        else:
            assert out["usage"]["completion_tokens"] == MAX_NEW
    state = wait_idle(secured)
    assert state["worker_restarts"] == 0
