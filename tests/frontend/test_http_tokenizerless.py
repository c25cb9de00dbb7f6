"""A model served without a tokenizer — dummy weights with no `--tokenizer-path`, the natural way to
benchmark a model whose weights are not on the machine — answers token ids with token ids, as SGLang
does with `skip_tokenizer_init` (`output_ids`, no `text`), streaming too; a request that needs a
tokenizer gets a 400 that says so, never a 500 or an empty stream."""

from __future__ import annotations

import pytest

from tests.frontend.helpers import post_stream, wait_idle
from tests.server_utils import ServerProcess

PROMPT = [1, 504, 3458, 314, 260, 1214]  # any ids below the vocabulary size
NO_TOKENIZER = "this server has no tokenizer"


@pytest.fixture(scope="module")
def bare():
    # a small pool and a fixed split (no estimator profile to measure): the quickest server to start
    with ServerProcess("--load-format", "dummy", "--model-path", "smollm2-135m", "--max-total-tokens", "1024",
                       "--policy", "static") as srv:
        yield srv


def generate(n: int, **extra) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0},
            **extra}


def test_generate_answers_ids_without_text(bare):
    status, body = bare.post("/generate", generate(6))
    assert status == 200, body
    assert "text" not in body  # SGLang's skip_tokenizer_init shape
    assert len(body["output_ids"]) == 6 and body["meta_info"]["completion_tokens"] == 6
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert body["meta_info"]["prompt_tokens"] == len(PROMPT)
    status, again = bare.post("/generate", generate(6))
    assert again["output_ids"] == body["output_ids"]  # greedy: the same ids
    status, batch = bare.post("/generate", {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert status == 200 and [len(b["output_ids"]) for b in batch] == [2, 2]


def test_generate_streams_cumulative_ids_and_ends_with_done(bare):
    status, kind, events = post_stream(bare.url, "/generate", generate(5, stream=True))
    assert status == 200 and kind.startswith("text/event-stream")
    assert events[-1] == "[DONE]" and len(events) >= 2
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), chunks
    assert all("text" not in c for c in chunks)
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [len(c["output_ids"]) for c in chunks]
    final = chunks[-1]
    assert len(final["output_ids"]) == 5 and final["meta_info"]["finish_reason"]["type"] == "length"
    for before, after in zip(chunks, chunks[1:]):  # cumulative, as in SGLang
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]


def test_logprobs_come_back_with_ids_and_no_token_text(bare):
    status, body = bare.post("/generate", generate(3, return_logprob=True, logprob_start_len=0))
    assert status == 200, body
    out = body["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in out] == body["output_ids"] and all(text is None for _, _, text in out)
    assert len(body["meta_info"]["input_token_logprobs"]) == len(PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_requests_that_need_a_tokenizer_get_a_400_naming_why(bare, stream):
    cases = [
        ("/generate", {"text": "Hello", "stream": stream}, "input_ids"),
        ("/generate", {**generate(4), "stream": stream, "sampling_params": {"stop": ["\n"]}}, "stop_token_ids"),
        ("/generate", {**generate(4), "stream": stream, "return_logprob": True, "return_text_in_logprobs": True},
         "return_text_in_logprobs"),
        ("/v1/completions", {"prompt": "Hello", "stream": stream}, "token ids"),
        ("/v1/completions", {"prompt": PROMPT, "stream": stream, "stop": "x"}, "stop_token_ids"),
        ("/v1/completions", {"prompt": PROMPT, "stream": stream, "echo": True}, "echo"),
        ("/v1/completions", {"prompt": PROMPT, "stream": stream, "logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": stream}, "/generate"),
        ("/generate", {**generate(4), "stream": stream, "sampling_params": {"regex": "[0-9]+"}}, "regex"),
        ("/v1/completions", {"prompt": PROMPT, "stream": stream, "response_format": {"type": "json_object"}},
         "response_format"),
    ]
    for path, body, hint in cases:
        status, answer = bare.post(path, body)
        assert status == 400, (path, body, answer)  # before any stream starts: a plain JSON error
        message = answer["message"] if path.startswith("/v1/") else answer["error"]["message"]
        assert message.startswith(NO_TOKENIZER) and hint in message, message
    wait_idle(bare)  # nothing was submitted


def test_completions_take_a_token_prompt(bare):
    status, body = bare.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})
    assert status == 200, body
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == len(PROMPT)
    status, _, events = post_stream(bare.url, "/v1/completions", {"prompt": [PROMPT, PROMPT[:2]], "max_tokens": 3,
                                                                  "ignore_eos": True, "stream": True,
                                                                  "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1]), events
    finished = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finished) == [0, 1]
    assert events[-2]["usage"]["completion_tokens"] == 6


def test_health_generate_works_without_a_tokenizer(bare):
    assert bare.get("/health_generate") == (200, {"status": "ok"})
    assert bare.get("/model_info")[1]["tokenizer_path"] is None
