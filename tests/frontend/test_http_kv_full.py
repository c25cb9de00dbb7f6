"""When the shared KV pool cannot hold every running sequence, no admitted request is lost: decode
hands the newest back to prefill, which recomputes its prompt and the tokens it already has when
memory frees up, and it rejoins the batch. Both clients get every token — the same greedy text as
when each runs alone — and every page comes back. (Runs on the `secured` server: its pool holds
512 tokens.)"""

from __future__ import annotations

import concurrent.futures as cf
import re

from tests.frontend.helpers import AUTH, SMALL_POOL_TOKENS, post_stream, wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 tokens
MAX_NEW = 100  # two of these (~300 tokens each) cannot both fit in the pool
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


def handed_back_at(log: str, rid: str) -> list[int]:
    """The lengths (prompt + tokens so far) at which decode handed request `rid` back to prefill."""
    return [int(n) for n in re.findall(rf"request {re.escape(rid)} \((\d+) tokens\) goes back to prefill", log)]


def test_streams_that_do_not_fit_together_both_finish_with_their_solo_output(secured):
    """Every token arrives, once, in order: a request that ran through matches its solo run token for
    token; one that went back to prefill matches it up to where it was handed back. After that point it
    goes on from a recomputed KV — a prefill of many tokens and a decode of one round differently, so on
    some CPUs a near-tie later flips, as in any engine that recomputes; the count still holds."""
    solo = [secured.post("/generate", {"text": prompt(i), "sampling_params": PARAMS})[1]["output_ids"]
            for i in range(2)]
    results = _in_parallel(*[
        lambda i=i: post_stream(secured.url, "/generate", {"text": prompt(i), "stream": True,
                                                           "sampling_params": PARAMS}, headers=AUTH)
        for i in range(2)])
    log, handed_back = secured.tail(200_000), 0
    for i, (status, _, events) in enumerate(results):
        assert status == 200 and events[-1] == "[DONE]"
        last = events[-2]
        assert "error" not in last, last
        meta = last["meta_info"]
        assert meta["completion_tokens"] == MAX_NEW and len(last["output_ids"]) == MAX_NEW
        lengths = handed_back_at(log, meta["id"])
        kept = min(lengths) - meta["prompt_tokens"] if lengths else MAX_NEW
        assert 0 < kept <= MAX_NEW, (lengths, meta)
        assert last["output_ids"][:kept] == solo[i][:kept], (i, lengths)
        handed_back += bool(lengths)
    assert handed_back >= 1, "the pool was meant to run out: no request went back to prefill"
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
