"""Constrained decoding on the real server (the shared `server`: the default `bullet` policy, prefill
and decode in two processes, so every constrained request's first token comes from the prefill
worker and the rest from the decode worker): regex output that fully matches for greedy and sampled
requests, with n > 1, streaming, stop strings, the prefix cache and abort; JSON-schema output that
parses and has the schema's keys and types; OpenAI's response_format through the real `openai`
client; `max_new_tokens` reached mid-grammar ends with `length`; a bad grammar is a 400 naming the
field with xgrammar's message and the server stays healthy; logit_bias changes the output."""

from __future__ import annotations

import json
import re

import pytest

from tests.frontend.helpers import open_raw_request, post_stream, read_events, wait_idle
from tests.server_utils import wait_pages_accounted

ANSWER = r" (yes|no), [0-9]{1,3}\."
QUESTION = ("You answer every question briefly: yes or no, then a number between one and nine hundred. "
            "Question: is the sky blue on a clear summer day?")  # over two KV pages: the prefix cache keeps it
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def generate(server, text: str, **params) -> dict | list:
    status, out = server.post("/generate", {"text": text, "sampling_params": params})
    assert status == 200, out
    return out


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age"}, person  # strict: only the schema's properties
    assert isinstance(person["name"], str) and type(person["age"]) is int, person


def test_regex_output_matches_for_greedy_and_sampled_requests(server):
    greedy = generate(server, QUESTION, regex=ANSWER, max_new_tokens=24, temperature=0)
    wait_pages_accounted(server)  # its pages have reached the prefix cache
    # sampled, n = 2: the prefix cache serves their prompt; the grammar holds all the same
    sampled = generate(server, QUESTION, regex=ANSWER, max_new_tokens=24, temperature=1.0, n=2, seed=11)
    assert all(out["meta_info"]["cached_tokens"] > 0 for out in sampled)
    for out in [greedy, *sampled]:
        assert re.fullmatch(ANSWER, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]  # ended where the grammar may


def test_json_schema_output_parses_and_follows_the_schema(server):
    out = generate(server, "Give me a person as JSON:", json_schema=json.dumps(PERSON), max_new_tokens=48,
                   temperature=0)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    check_person(out["text"])


def test_max_new_tokens_mid_grammar_ends_with_length(server):
    out = generate(server, "Give me a person as JSON:", json_schema=PERSON, max_new_tokens=3, temperature=0)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert out["text"].lstrip().startswith("{")  # the object has begun, and was cut short


def test_streaming_n_samples_with_a_regex_and_a_stop_string(server):
    status, _, events = post_stream(server.url, "/generate", {"text": QUESTION, "stream": True, "sampling_params": {
        "regex": ANSWER, "max_new_tokens": 24, "temperature": 0.7, "seed": 5, "n": 2}})
    assert status == 200 and events[-1] == "[DONE]"
    final = {}
    for e in events[:-1]:  # SGLang's stream: each event carries the sample's text so far
        final[e.get("index", 0)] = e
    assert sorted(final) == [0, 1]
    for e in final.values():
        assert re.fullmatch(ANSWER, e["text"]), e["text"]
    # a stop string inside the grammar's language ends the output there, as without a grammar
    out = generate(server, QUESTION, regex=ANSWER, stop=[","], max_new_tokens=24, temperature=0)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}
    assert re.fullmatch(r" (yes|no)", out["text"]), out["text"]
    # and /abort_request ends a constrained stream as any other
    sock = open_raw_request(server, "/generate", {"text": QUESTION, "stream": True, "rid": "shaped", "sampling_params": {
        "regex": "[a-z ]{300}", "max_new_tokens": 300, "temperature": 0}})
    try:
        read_events(sock, 1)
        assert server.post("/abort_request", {"rid": "shaped"}) == (200, {"aborted": ["shaped"]})
    finally:
        sock.close()
    wait_idle(server)


def test_openai_response_format_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        assert chat.choices[0].finish_reason == "stop"
        check_person(chat.choices[0].message.content)
        # /v1/completions (the client has no response_format there: sent as extra fields): SGLang's regex
        # extension, and json_object (any JSON object)
        done = client.completions.create(model="default", prompt=QUESTION, max_tokens=24, temperature=0,
                                         extra_body={"regex": ANSWER})
        assert re.fullmatch(ANSWER, done.choices[0].text), done.choices[0].text
        obj = client.completions.create(model="default", prompt="A JSON object with one key:", max_tokens=6,
                                        temperature=0, extra_body={"response_format": {"type": "json_object"}})
        choice = obj.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.lstrip().startswith("{")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "bad", "schema": {"type": "object", "properties": {
                                                   "a": {"$ref": "#/nowhere"}}}}})
        assert "response_format" in str(err.value) and "nowhere" in str(err.value)


def test_a_bad_grammar_is_a_400_naming_the_field_and_the_server_stays_healthy(server):
    pids = server.worker_pids()
    for params, words in [({"regex": "(yes|no"}, ["sampling_params.regex", "parenthesis"]),
                          ({"json_schema": '{"type": "object", "properties": {"a": {"type": "foo"}}}'},
                           ["sampling_params.json_schema", "foo"]),
                          ({"ebnf": 'root ::= "a" rest'}, ["sampling_params.ebnf", "rest"])]:
        status, err = server.post("/generate", {"text": QUESTION, "sampling_params": params})
        assert status == 400, err
        assert all(w in err["error"]["message"] for w in words), err
    assert server.get("/health")[0] == 200
    state = server.state()
    assert state["worker_pids"] == pids and state["worker_restarts"] == 0
    out = generate(server, QUESTION, ebnf='root ::= " yes" | " no"', max_new_tokens=8, temperature=0)
    assert out["text"] in (" yes", " no")


def test_logit_bias_changes_the_output(server):
    first = generate(server, QUESTION, max_new_tokens=1, temperature=0)["output_ids"][0]
    status, out = server.post("/v1/completions", {"prompt": QUESTION, "max_tokens": 1, "temperature": 0,
                                                  "logit_bias": {str(first): -100}})
    assert status == 200, out
    banned = generate(server, QUESTION, max_new_tokens=1, temperature=0, logit_bias={str(first): -100})
    assert banned["output_ids"][0] != first
