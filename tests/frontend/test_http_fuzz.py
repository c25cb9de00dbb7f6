"""Property-based fuzz of /generate, /v1/completions and /v1/chat/completions: over 500 random
bodies — random JSON, known fields with random types and values, unknown fields — and afterwards
the server is healthy, serves a normal request, has the same two workers, and holds no KV page.

Every response must be a 2xx or a 4xx with a JSON error naming a problem (a 503 only with the
documented "server is unavailable" shape); never another 5xx.

Generations are kept tiny so the run stays short: a *valid* generation budget above 4 tokens is
lowered to 4 before sending, and a body that leaves the budget out gets one (the defaults would
generate up to 128 tokens, or the rest of the context for chat). Invalid budgets (negative,
absurd, wrong type) are sent as drawn."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.frontend.helpers import sse_events, wait_idle

EXAMPLES = 300
MAX_TOKENS_SENT = 4
CONTEXT = 8192
seen: Counter = Counter()  # (path, status) of every request sent

# -- random JSON ---------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 8)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

# -- fields: (values a correct client sends, values a buggy one sends) ---------------------------
words = st.text(max_size=30)
some_words = st.text(min_size=1, max_size=30)
good_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=12)
FIELDS = {
    "max_new_tokens": (st.integers(0, 6), st.integers(-3, -1) | st.sampled_from([10**9, CONTEXT, 2**63, 2.5, "3"])),
    "max_tokens": (st.integers(1, 6), st.integers(-3, 0) | st.sampled_from([10**9, CONTEXT, 2**63, 2.5, "3"])),
    "min_new_tokens": (st.integers(0, 1), st.integers(-3, -1) | st.just(7)),
    "temperature": (st.floats(0, 2) | st.just(0), st.floats(-5, -0.01) | st.just(1e9) | st.just("hot")),
    "top_p": (st.floats(0.05, 1), st.just(0) | st.floats(1.01, 5)),
    "top_k": (st.integers(-1, 50), st.integers(-100, -2)),
    "min_p": (st.floats(0, 0.5), st.floats(-1, -0.01) | st.floats(1.01, 3)),
    "frequency_penalty": (st.floats(-2, 2), st.floats(2.01, 100)),
    "presence_penalty": (st.floats(-2, 2), st.floats(-100, -2.01)),
    "repetition_penalty": (st.floats(0.5, 2), st.floats(-3, 0)),
    "stop": (some_words | st.lists(some_words, max_size=3), st.just("") | st.integers()),
    "stop_token_ids": (st.lists(st.integers(0, 49151), max_size=3), st.lists(st.integers(49152, 10**6), min_size=1)),
    "ignore_eos": (st.booleans(), st.sampled_from(["yes", 1])),
    "seed": (st.integers(0, 2**32), st.integers(-10, -1)),
    "stream": (st.booleans(), st.sampled_from(["true", 0, None])),
    "n": (st.integers(1, 2), st.integers(-1, 0) | st.integers(9, 100)),
}


def pick(name: str, chaos: bool) -> st.SearchStrategy:
    good, bad = FIELDS[name]
    return st.one_of(good, bad, any_json) if chaos else good


def optional_fields(names, chaos: bool, **required) -> st.SearchStrategy:
    return st.fixed_dictionaries(required, optional={n: pick(n, chaos) for n in names})


SAMPLING = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
            "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "seed"]
OPENAI = ["temperature", "top_p", "top_k", "stop", "ignore_eos", "seed", "presence_penalty", "stream", "n"]


@st.composite
def generate_body(draw, chaos: bool):
    if chaos:
        prompt = draw(st.fixed_dictionaries({}, optional={
            "text": st.one_of(words, st.lists(words, max_size=3), any_json),
            "input_ids": st.one_of(st.lists(st.integers(-3, 50000), max_size=6), any_json)}))
    else:
        prompt = draw(st.one_of(st.fixed_dictionaries({"text": some_words | st.lists(some_words, min_size=1, max_size=3)}),
                                st.fixed_dictionaries({"input_ids": good_ids})))
    params = draw(optional_fields(SAMPLING, chaos))
    extra = draw(st.fixed_dictionaries({}, optional={
        "stream": pick("stream", chaos), "return_logprob": st.booleans(), "return_text_in_logprobs": st.booleans(),
        "logprob_start_len": st.integers(-1, 20) if not chaos else any_json,
        "top_logprobs_num": st.integers(0, 5) if not chaos else any_json,
        "lora_path": st.none(), "session_id": any_json}))
    if chaos and draw(st.booleans()):
        params = draw(st.one_of(any_json, st.lists(st.just(params), max_size=3)))
    return {**prompt, "sampling_params": params, **extra}


@st.composite
def completion_body(draw, chaos: bool):
    prompt = draw(st.one_of(some_words, st.lists(some_words, min_size=1, max_size=2), good_ids)
                  if not chaos else st.one_of(words, st.lists(st.integers(-3, 50000), max_size=4), any_json))
    body = draw(optional_fields(OPENAI + ["max_tokens"], chaos,
                                model=st.sampled_from(["SmolLM2-135M-Instruct", "default"]) if not chaos
                                else st.one_of(st.sampled_from(["gpt-17", ""]), any_json)))
    body.update(prompt=prompt, logprobs=draw(st.none() | st.integers(0, 3) if not chaos else any_json),
                echo=draw(st.booleans()))
    return body


@st.composite
def chat_body(draw, chaos: bool):
    role = st.sampled_from(["system", "user", "assistant"])
    content = some_words | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1,
                                    max_size=2)
    message = st.fixed_dictionaries({"role": role, "content": content})
    messages = st.lists(message, min_size=1, max_size=3)
    if chaos:
        messages = st.one_of(messages, st.lists(any_json, max_size=2), any_json)
    body = draw(optional_fields(OPENAI, chaos))
    body["messages"] = draw(messages)
    key = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    body[key] = draw(pick("max_tokens", chaos))
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 3) if not chaos else any_json)
    if chaos and draw(st.booleans()):
        body["stream_options"] = draw(st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), any_json))
    return body


PATHS = ["/generate", "/v1/completions", "/v1/chat/completions"]
BODIES = {"/generate": generate_body, "/v1/completions": completion_body, "/v1/chat/completions": chat_body}
requests = st.one_of(
    # well-formed requests (half of them), so the fuzz exercises generation and not only rejection
    *[st.tuples(st.just(p), BODIES[p](chaos=False)) for p in PATHS for _ in range(2)],
    *[st.tuples(st.just(p), BODIES[p](chaos=True)) for p in PATHS],  # fields of any type and value
    st.tuples(st.sampled_from(PATHS), any_json),  # any JSON at all
    st.tuples(st.sampled_from(PATHS), st.binary(max_size=40)),  # not even JSON
)


# -- keeping generations tiny ------------------------------------------------------------------
def _small(value):
    valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= CONTEXT
    return min(value, MAX_TOKENS_SENT) if valid else value


def cap_generation(path: str, body):
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if path == "/generate":
        params = body.get("sampling_params")
        items = params if isinstance(params, list) else [params]
        capped = []
        for p in items:
            if p is None:
                p = {}
            if isinstance(p, dict):
                p = {**p, "max_new_tokens": _small(p.get("max_new_tokens", MAX_TOKENS_SENT))}
            capped.append(p)
        body["sampling_params"] = capped if isinstance(params, list) else capped[0]
    else:
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body:
                body[key] = _small(body[key])
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS_SENT
    return body


# -- checks ------------------------------------------------------------------------------------
def check_response(path: str, status: int, body, streamed: bool) -> None:
    assert status < 500 or status == 503, f"{status} from {path}: {body}"
    if status >= 400:
        assert isinstance(body, dict), f"{status} with a non-JSON body: {body!r}"
        message = body["error"]["message"] if path == "/generate" else body["message"]
        assert isinstance(message, str) and message
        if status == 503:
            assert "unavailable" in message or "try again" in message or "cache is full" in message, message
        return
    if streamed:
        events = sse_events(body)
        assert events and events[-1] == "[DONE]"
        for ev in events[:-1]:
            assert "error" not in ev, ev
    else:
        assert isinstance(body, (dict, list)), body


@pytest.fixture(scope="module")
def pids_before(server):
    wait_idle(server)
    return server.worker_pids()


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(req=requests)
def test_random_requests_get_a_clean_answer(server, pids_before, req):
    path, body = req
    body = cap_generation(path, body)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, out = server.post(path, raw, timeout=120)
    seen[(path, status)] += 1
    streamed = isinstance(body, dict) and body.get("stream") is True and status == 200
    check_response(path, status, out, streamed)


def test_server_is_unharmed_by_the_fuzz(server, pids_before):
    if not seen:  # run before the fuzz (tests run in any order): fuzz now
        test_random_requests_get_a_clean_answer(server, pids_before)
    total = sum(seen.values())
    print(f"\nfuzz: {total} requests; (path, status) counts: {dict(sorted(seen.items()))}")
    assert total >= EXAMPLES - 20  # hypothesis may stop a few short
    assert sum(n for (_, s), n in seen.items() if s == 200) >= 50, "too few requests were valid to mean much"
    assert server.get("/health") == (200, {"status": "ok"})
    status, out = server.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 3,
                                                                                "ignore_eos": True}})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3
    state = wait_idle(server)
    assert state["worker_pids"] == pids_before and state["worker_restarts"] == 0
