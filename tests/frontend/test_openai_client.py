"""The official `openai` Python client against /v1: completions and chat, stream and not; `usage`
equals the server's own token counts (the /metrics counters and the tokenizer); a usage chunk only
with stream_options.include_usage; unknown model -> NotFoundError."""

from __future__ import annotations

import pytest

from tests.frontend.helpers import token_counters

openai = pytest.importorskip("openai")

PROMPT = "List three colors of the rainbow:"
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat_prompt_tokens(hf_tokenizer, question: str) -> int:
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=False)
    return len(hf_tokenizer.encode(text, add_special_tokens=False))


def _measured(server, call):
    """(result, prompt tokens, generated tokens) as the server counted them while `call` ran."""
    before = token_counters(server)
    result = call()
    after = token_counters(server)
    return result, after[0] - before[0], after[1] - before[1]


def test_completion_usage_equals_our_counts(client, server, model, hf_tokenizer):
    out, prompt, generated = _measured(server, lambda: client.completions.create(model=model, prompt=PROMPT, **GREEDY))
    assert out.object == "text_completion" and out.model == model
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == prompt == len(hf_tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == generated >= 1
    assert out.usage.total_tokens == prompt + generated


def test_completion_stream_matches_non_stream(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)  # no usage chunk unless asked
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_stream_usage_chunk_when_asked(client, server, model):
    full = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    chunks, prompt, generated = _measured(server, lambda: list(client.completions.create(
        model=model, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY)))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt, generated)
    assert last.usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_n_and_logprobs(client, server, model):
    out, prompt, generated = _measured(server, lambda: client.completions.create(
        model=model, prompt=PROMPT, n=2, logprobs=2, max_tokens=4, temperature=0.8, seed=1,
        extra_body={"ignore_eos": True}))
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == generated == 8 and out.usage.prompt_tokens == prompt
    for c in out.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 4
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)


def test_chat_usage_equals_our_counts(client, server, model, hf_tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    out, prompt, generated = _measured(server, lambda: client.chat.completions.create(
        model=model, messages=messages, **GREEDY))
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    # the chat template's tokens count as prompt tokens
    assert out.usage.prompt_tokens == prompt == _chat_prompt_tokens(hf_tokenizer, QUESTION)
    assert out.usage.completion_tokens == generated >= 1


def test_chat_stream_matches_non_stream(client, model):
    messages = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_chat_stream_usage_chunk_when_asked(client, server, model):
    messages = [{"role": "user", "content": QUESTION}]
    chunks, prompt, generated = _measured(server, lambda: list(client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True},
        max_completion_tokens=6, temperature=0)))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt, generated, prompt + generated)


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1)
    assert err.value.status_code == 404
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


def test_bad_sampling_value_is_a_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert "temperature" in err.value.body["message"]
