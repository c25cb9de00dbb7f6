"""SGLang 0.5.2's own frontend against the server: @sgl.function programs with sgl.gen (max_tokens,
stop, regex, json_schema), sgl.select (max_new_tokens 0, then input_token_logprobs from logprob_start_len with
return_text_in_logprobs) and run_batch. The choice select makes must be the one our own /generate
logprobs rank highest under the frontend's length-normalised score."""

from __future__ import annotations

import json
import re

import pytest

sgl = pytest.importorskip("sglang")

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Who wrote Hamlet?"]
CHOICES = [" fruit", " vegetable", " rock"]


@pytest.fixture(scope="module")
def backend(server):
    endpoint = sgl.RuntimeEndpoint(server.url)
    sgl.set_default_backend(endpoint)
    yield endpoint
    sgl.set_default_backend(None)


@sgl.function
def answer(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=24, stop="\n", temperature=0)


YES_NO = r" (yes|no)\."


@sgl.function
def yes_or_no(s, question):
    s += "Q: " + question + " Answer yes or no.\nA:"
    s += sgl.gen("answer", max_tokens=8, regex=YES_NO, temperature=0)


CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                        "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["name", "population"], "additionalProperties": False}


@sgl.function
def city_as_json(s, city):
    s += "Describe " + city + " as JSON with its name and population.\n"
    s += sgl.gen("city", max_tokens=64, json_schema=json.dumps(CITY), temperature=0)


@sgl.function
def classify(s, thing):
    s += "Is " + thing + " a fruit, a vegetable or a rock? Answer: it is a"
    s += sgl.select("kind", choices=CHOICES)


@sgl.function
def two_steps(s, topic):
    s += "Write one sentence about " + topic + ":"
    s += sgl.gen("sentence", max_tokens=12, temperature=0)
    s += "\nIs that sentence true? Answer:"
    s += sgl.select("verdict", choices=[" yes", " no"])


def test_gen_respects_max_tokens_and_stop(backend):
    state = answer.run(question=QUESTIONS[0])
    text, meta = state["answer"], state.get_meta_info("answer")
    assert text.strip() and "\n" not in text
    assert 1 <= meta["completion_tokens"] <= 24
    reason = meta["finish_reason"]
    assert reason["type"] in ("stop", "length")
    if reason["type"] == "stop":  # the stop string, or an end-of-sequence token id
        assert reason["matched"] == "\n" or isinstance(reason["matched"], int)


def test_gen_text_is_what_generate_returns(backend, server):
    state = answer.run(question=QUESTIONS[1])
    prompt = "Q: " + QUESTIONS[1] + "\nA:"
    status, out = server.post("/generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": 24, "stop": ["\n"], "temperature": 0}})
    assert status == 200 and state["answer"] == out["text"]


def test_gen_with_a_regex_follows_it(backend):
    state = yes_or_no.run(question=QUESTIONS[0])
    assert re.fullmatch(YES_NO, state["answer"]), state["answer"]
    assert state.get_meta_info("answer")["finish_reason"]["type"] == "stop"


def test_gen_with_a_json_schema_produces_an_object_that_validates(backend):
    jsonschema = pytest.importorskip("jsonschema")
    for city in ("Paris", "Tokyo"):
        state = city_as_json.run(city=city)
        meta = state.get_meta_info("city")
        assert meta["finish_reason"]["type"] == "stop", (meta, state["city"])  # the grammar ended it, not the cap
        jsonschema.validate(json.loads(state["city"]), CITY)


def _normalized(server, prefix: str, choice: str) -> float:
    """The frontend's score for one choice, computed from /generate's logprobs of the whole prompt
    (logprob_start_len 0, not the frontend's own start): the mean logprob of the tokens from two
    before the end of the prefix, without the first of them when the prefix ends with its text
    (the frontend's token-healing correction)."""
    _, head = server.post("/generate", {"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    start = max(head["meta_info"]["prompt_tokens"] - 2, 0)
    status, out = server.post("/generate", {
        "text": prefix + choice, "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
    assert status == 200
    entries = out["meta_info"]["input_token_logprobs"][start:]
    if prefix.endswith(entries[0][2]):
        entries = entries[1:]
    values = [lp for lp, _, _ in entries if lp]
    return sum(values) / len(values)


@pytest.mark.parametrize("thing", ["an apple", "a carrot", "a piece of granite"])
def test_select_picks_the_choice_our_logprobs_rank_highest(backend, server, thing):
    state = classify.run(thing=thing)
    picked = state["kind"]
    assert picked in CHOICES
    prefix = "Is " + thing + " a fruit, a vegetable or a rock? Answer: it is a"
    ours = [_normalized(server, prefix, c) for c in CHOICES]
    theirs = state.get_meta_info("kind")["normalized_prompt_logprobs"]
    assert theirs == pytest.approx(ours, abs=2e-3)
    assert picked == CHOICES[max(range(len(CHOICES)), key=ours.__getitem__)]


def test_run_batch_runs_every_program(backend):
    states = answer.run_batch([{"question": q} for q in QUESTIONS], num_threads=3)
    assert len(states) == len(QUESTIONS)
    for st in states:
        assert st["answer"].strip() and "\n" not in st["answer"]


def test_gen_then_select_in_one_program(backend):
    states = two_steps.run_batch([{"topic": "the moon"}, {"topic": "water"}])
    for st in states:
        assert st["sentence"].strip()
        assert st["verdict"] in (" yes", " no")
