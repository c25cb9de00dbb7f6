"""Log-probabilities through the `openai` client, as evaluation harnesses read them: streamed chunks
carry the log-probabilities of their tokens (chat and completions), `echo` returns the prompt's tokens
with theirs (the first null; `max_tokens` 0 scores a prompt alone), and a token that holds part of a
character is given by its own bytes — in chat its `bytes`, in the legacy shape a `bytes:\\x..` name
that never collides with another token's in `top_logprobs`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bullet.frontend.http.openai_logprobs import LogprobCursor, chat_entry, legacy_name
from engines.tokenizer import Tokenizer

QUESTION = "Name a color."
PROMPT = "The capital of France is"
WIDE = "東京 and 世界 😀"  # characters that byte-level BPE splits over several tokens


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    return Tokenizer(hf_tokenizer, None)


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4)
                                    for x, y in zip(a, b))


def test_streamed_chat_chunks_carry_every_tokens_logprobs(openai_client):
    kw = dict(model="default", messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=2)
    whole = openai_client.chat.completions.create(**kw)
    chunks = [c for c in openai_client.chat.completions.create(stream=True, **kw) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert len(expected) == whole.usage.completion_tokens
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert _close([e.logprob for e in streamed], [e.logprob for e in expected])
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    # each chunk's entries are its own tokens': a chunk with text has some, none is repeated
    assert all(c.choices[0].logprobs for c in chunks if c.choices[0].delta.content)
    assert bytes(b for e in streamed for b in e.bytes).decode() == whole.choices[0].message.content


def test_streamed_completion_chunks_carry_every_tokens_logprobs(openai_client):
    kw = dict(model="default", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    whole = openai_client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in openai_client.completions.create(stream=True, **kw) if c.choices]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    logprobs = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    # offsets count from the prompt's start, as OpenAI's do: the first output token sits at its end
    assert offsets[0] == len(PROMPT)
    assert [(PROMPT + whole.text)[o:o + len(t)] for o, t in zip(offsets, tokens)] == tokens
    assert _close(logprobs, whole.logprobs.token_logprobs)
    assert "".join(c.text for c in chunks) == whole.text


def test_echo_scores_the_prompt_as_generate_does(openai_client, server):
    """lm-eval's loglikelihood request: echo, max_tokens 0, logprobs 1."""
    out = openai_client.completions.create(model="default", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True,
                                    temperature=0).choices[0]
    lp = out.logprobs
    native = server.post("/generate", {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0,
                                       "return_text_in_logprobs": True,
                                       "sampling_params": {"max_new_tokens": 0}})[1]["meta_info"]
    inputs = native["input_token_logprobs"]
    assert out.text == PROMPT
    assert lp.tokens == [text for _, _, text in inputs]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert _close(lp.token_logprobs, [v for v, _, _ in inputs])
    assert [out.text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    # with a continuation, the prompt's entries come first and the output's follow
    more = openai_client.completions.create(model="default", prompt=PROMPT, max_tokens=3, logprobs=1, echo=True,
                                     temperature=0).choices[0]
    assert more.logprobs.tokens[:len(lp.tokens)] == lp.tokens and len(more.logprobs.tokens) == len(lp.tokens) + 3
    assert [more.text[o:o + len(t)] for o, t in zip(more.logprobs.text_offset, more.logprobs.tokens)] \
        == more.logprobs.tokens
    # streamed, the same entries: the prompt's with the first chunk, each output token's once
    chunks = [c.choices[0] for c in openai_client.completions.create(
        model="default", prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, temperature=0, stream=True) if c.choices]
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == more.logprobs.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == more.logprobs.text_offset


def test_echo_of_split_characters_names_partial_tokens_by_their_bytes(openai_client, tok):
    out = openai_client.completions.create(model="default", prompt=WIDE, max_tokens=0, logprobs=1, echo=True).choices[0]
    ids = tok.encode(WIDE)
    assert out.logprobs.tokens == [legacy_name(tok, t) for t in ids]
    partial = [t for t in out.logprobs.tokens if t.startswith("bytes:")]
    assert partial, out.logprobs.tokens  # the test needs characters split over tokens
    raw = b"".join(bytes(int(h, 16) for h in t[len("bytes:\\x"):].split("\\x")) if t.startswith("bytes:")
                   else t.encode() for t in out.logprobs.tokens)
    assert raw.decode() == WIDE
    for offset, token in zip(out.logprobs.text_offset, out.logprobs.tokens):  # whole tokens sit at their offset
        assert token.startswith("bytes:") or out.text[offset:].startswith(token)


def test_a_chat_entry_gives_a_partial_characters_own_bytes(tok):
    ids = tok.encode("世界")
    entries = [chat_entry(tok, t, -1.0, [(t, -1.0)]) for t in ids]
    assert len(ids) > 2 and any(e["token"] == "\ufffd" for e in entries)
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "世界"
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in entries)


def test_the_cursor_renders_each_token_once_and_offsets_skip_special_tokens(tok):
    ids = tok.encode("Hi 世界")
    special = tok.hf.all_special_ids[0]
    state = SimpleNamespace(prompt_ids=[], prompt_logprobs=None, prompt_top_logprobs=None, output_ids=[],
                            output_logprobs=[], output_top_logprobs=[])
    cursor = LogprobCursor(tok, 0, {special}, offset=5)
    parts = []
    for t in [*ids, special]:  # one token per update, as a stream delivers them
        state.output_ids.append(t)
        state.output_logprobs.append(-0.5)
        state.output_top_logprobs.append(None)
        parts.append(cursor.completion(state))
    assert [len(p["tokens"]) for p in parts] == [1] * (len(ids) + 1)
    assert parts[-1]["top_logprobs"] is None  # none asked for
    offsets = [p["text_offset"][0] for p in parts]
    assert offsets[0] == 5 and offsets[-1] == 5 + len("Hi 世界")  # the special token adds no text
    assert cursor.completion(state)["tokens"] == []


def test_a_vocabulary_xgrammar_cannot_read_falls_back_to_decoded_text(hf_tokenizer, monkeypatch):
    import xgrammar

    def unreadable(*args, **kwargs):
        raise ValueError("unknown vocabulary type")

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", unreadable)
    tok = Tokenizer(hf_tokenizer, None)
    ids = tok.encode("Hello world")
    assert [tok.token_bytes(t) for t in ids] == [tok.id_to_text(t).encode() for t in ids]
    assert chat_entry(tok, ids[0], -1.0, None)["bytes"] == list(b"Hello")


def test_lm_evals_loglikelihood_request_reads_the_continuations_logprobs(openai_client, server, tok):
    """What lm-eval's `local-completions` model sends for a loglikelihood request (context and
    continuation as one list of token ids, echo, max_tokens 1, logprobs 1) and how it reads the answer:
    the continuation's log-probability is the sum of `token_logprobs[ctxlen:-1]`, and it is greedy when
    each of those tokens is the top of its `top_logprobs`. (Before echo returned the prompt's entries,
    that sum was over nothing: 0.0 and "greedy" for every continuation.)"""
    for context, continuation in ((PROMPT, " Paris"), (PROMPT, " London"), ("東京は日本の", "首都です")):
        ctx, full = tok.encode(context), tok.encode(context + continuation)
        choice = openai_client.completions.create(model="default", prompt=full, max_tokens=1, echo=True, logprobs=1,
                                                  temperature=0, seed=1234).choices[0]
        lp, n = choice.logprobs, len(ctx)
        loglikelihood = sum(lp.token_logprobs[n:-1])
        greedy = all(max(top, key=top.get) == token for token, top in zip(lp.tokens[n:-1], lp.top_logprobs[n:-1]))
        native = server.post("/generate", {"input_ids": full, "return_logprob": True, "logprob_start_len": 0,
                                           "sampling_params": {"max_new_tokens": 0}})[1]["meta_info"]
        expected = sum(v for v, _, _ in native["input_token_logprobs"][n:])
        assert loglikelihood == pytest.approx(expected, abs=1e-3) and loglikelihood < 0
        assert greedy == (continuation == " Paris"), (continuation, lp.tokens[n:-1], lp.top_logprobs[n:-1])


def test_a_streamed_echo_without_logprobs_has_none(openai_client):
    chunks = [c.choices[0] for c in openai_client.completions.create(
        model="default", prompt=PROMPT, max_tokens=3, echo=True, temperature=0, stream=True) if c.choices]
    assert "".join(c.text for c in chunks).startswith(PROMPT) and all(c.logprobs is None for c in chunks)
