"""POST /generate per the SGLang contract: single and batch, stream and not (cumulative text,
output_ids and completion_tokens; `index` in batch streams; `[DONE]`), max_new_tokens 0, stop
strings, input_ids, and logprob triples from logprob_start_len."""

from __future__ import annotations

import pytest

from tests.frontend.helpers import post_stream

PROMPT = "The capital of France is"
OTHER = "A short poem about the sea:"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def generate(server, body: dict) -> dict:
    status, out = server.post("/generate", body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def greedy(server) -> dict:
    return generate(server, {"text": PROMPT, "sampling_params": GREEDY})


def test_single_returns_the_completion_only(server, hf_tokenizer, greedy):
    meta = greedy["meta_info"]
    assert meta["prompt_tokens"] == len(hf_tokenizer.encode(PROMPT))
    assert 1 <= meta["completion_tokens"] == len(greedy["output_ids"]) <= 8
    assert greedy["text"] == hf_tokenizer.decode(greedy["output_ids"], skip_special_tokens=True)
    assert not greedy["text"].startswith(PROMPT)
    assert meta["finish_reason"]["type"] in ("length", "stop")
    # the prompt may be in the prefix cache already (the server is shared by the HTTP tests): never all of it
    assert meta["e2e_latency"] > 0 and 0 <= meta["cached_tokens"] < meta["prompt_tokens"] and meta["id"]


def test_ignore_eos_runs_to_the_length_limit(server):
    out = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 5, "ignore_eos": True}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 5


def test_input_ids_give_the_same_greedy_output_as_text(server, hf_tokenizer, greedy):
    out = generate(server, {"input_ids": hf_tokenizer.encode(PROMPT), "sampling_params": GREEDY})
    assert out["output_ids"] == greedy["output_ids"] and out["text"] == greedy["text"]


def test_stop_string_ends_the_text_before_the_match(server, greedy):
    full = greedy["text"]
    stop = full.strip()[1:3]  # a string the greedy output is known to contain, after its first character
    assert stop and stop in full
    out = generate(server, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": [stop]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.find(stop)]


def test_batch_returns_an_array_in_input_order(server, hf_tokenizer):
    out = generate(server, {"text": [PROMPT, OTHER], "sampling_params": GREEDY})
    assert isinstance(out, list) and len(out) == 2
    for item, prompt in zip(out, [PROMPT, OTHER]):
        assert item["meta_info"]["prompt_tokens"] == len(hf_tokenizer.encode(prompt))
        assert item["meta_info"]["completion_tokens"] == len(item["output_ids"]) >= 1
    assert out[0]["meta_info"]["id"] != out[1]["meta_info"]["id"]


def test_per_item_sampling_params_apply_to_their_item(server):
    out = generate(server, {"text": [PROMPT, OTHER], "sampling_params": [
        {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}]})
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 4]


def _check_cumulative(events: list[dict]) -> None:
    text, ids, count = "", [], 0
    for k, ev in enumerate(events):
        meta = ev["meta_info"]
        assert ev["text"].startswith(text) and ev["output_ids"][: len(ids)] == ids
        assert meta["completion_tokens"] == len(ev["output_ids"]) >= count
        assert (meta["finish_reason"] is None) == (k < len(events) - 1)
        text, ids, count = ev["text"], ev["output_ids"], meta["completion_tokens"]


def test_stream_is_cumulative_and_ends_with_done(server, greedy):
    status, ctype, events = post_stream(server.url, "/generate",
                                        {"text": PROMPT, "sampling_params": GREEDY, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    body = events[:-1]
    assert len(body) >= 2, "a multi-token generation must stream more than one event"
    _check_cumulative(body)
    last = body[-1]
    assert last["text"] == greedy["text"] and last["output_ids"] == greedy["output_ids"]
    assert "e2e_latency" in last["meta_info"] and "index" not in last


def test_batch_stream_tags_events_with_index(server):
    _, _, events = post_stream(server.url, "/generate", {
        "text": [PROMPT, OTHER], "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
    assert events[-1] == "[DONE]"
    by_index: dict[int, list] = {}
    for ev in events[:-1]:
        by_index.setdefault(ev["index"], []).append(ev)
    assert sorted(by_index) == [0, 1]
    for evs in by_index.values():
        _check_cumulative(evs)
        assert evs[-1]["meta_info"]["completion_tokens"] == 4


def test_max_new_tokens_zero_scores_the_prompt_only(server, hf_tokenizer):
    out = generate(server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert out["text"] == "" and out["output_ids"] == []
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(hf_tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 0}


def _logprobs(server, start: int, with_text: bool, max_new: int = 3) -> dict:
    return generate(server, {"text": PROMPT, "return_logprob": True, "logprob_start_len": start,
                             "return_text_in_logprobs": with_text, "top_logprobs_num": 2,
                             "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}})


def test_logprobs_are_triples_from_logprob_start_len(server, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    full = _logprobs(server, 0, with_text=True)["meta_info"]
    inputs = full["input_token_logprobs"]
    assert [e[1] for e in inputs] == ids
    assert inputs[0][0] is None  # the first token has nothing before it
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in inputs[1:])
    assert [e[2] for e in inputs] == [hf_tokenizer.decode([t]) for t in ids]

    later = _logprobs(server, 2, with_text=False)
    meta = later["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[2:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx([e[0] for e in inputs[2:]], abs=1e-4)
    assert all(e[2] is None for e in meta["input_token_logprobs"] + meta["output_token_logprobs"])

    outputs = meta["output_token_logprobs"]
    assert [e[1] for e in outputs] == later["output_ids"] and len(outputs) == 3
    # greedy: each generated token is the most likely one, so it heads its top-logprobs list
    for (lp, tok, _), top in zip(outputs, meta["output_top_logprobs"]):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp) and top[0][0] >= top[1][0]


def test_default_logprob_start_len_returns_output_logprobs_only(server):
    out = generate(server, {"text": PROMPT, "return_logprob": True,
                            "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]


def test_unknown_fields_are_ignored(server):
    out = generate(server, {"text": PROMPT, "lora_path": None, "return_routed_experts": False, "session_id": "s",
                            "custom_logit_processor": None, "sampling_params": {
                                "max_new_tokens": 1, "no_stop_trim": False, "spaces_between_special_tokens": True}})
    assert out["meta_info"]["completion_tokens"] == 1
