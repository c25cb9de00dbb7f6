"""Log-probabilities in the OpenAI API's two shapes, whole or chunk by chunk as a stream goes.

* Chat (`choices[].logprobs.content`): an entry per token with its text, its log-probability, its
  exact UTF-8 `bytes` and its alternatives. A token may hold part of a character (byte-level BPE
  splits 世 into two tokens): its text then shows U+FFFD, and its bytes are the token's own, so a
  client that joins the bytes gets the text back.
* Completions (`choices[].logprobs`, the legacy shape): parallel lists `tokens`, `token_logprobs`,
  `top_logprobs` (a dict per position, keyed by token text) and `text_offset` (where each token's
  text starts, in characters from the prompt's start, echoed or not, as OpenAI counts). A token that is not whole UTF-8 is named `bytes:\\xe4\\xb8`,
  as OpenAI names it, so two partial tokens never share a key. With `echo` the prompt's tokens come
  first, the first with a null log-probability.

`LogprobCursor` remembers how many of a request's tokens it has rendered: a streamed chunk carries
the tokens produced since the previous one."""

from __future__ import annotations

import asyncio
import codecs


async def token_bytes_ready(tok) -> None:
    """Build the tokenizer's byte table off the event loop (the first time it costs ~0.5 s)."""
    await asyncio.to_thread(tok.token_bytes_table)


def legacy_name(tok, token_id: int) -> str:
    raw = tok.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_entry(tok, token_id: int, logprob: float | None, top) -> dict:
    def entry(raw: bytes, value) -> dict:
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": value, "bytes": list(raw)}

    return {**entry(tok.token_bytes(token_id), logprob),
            "top_logprobs": [entry(tok.token_bytes(i), v) for i, v in (top or [])]}


class LogprobCursor:
    """One choice's log-probabilities, rendered from where the last call stopped.

    `skipped`: token ids whose text the choice's text leaves out (special tokens, unless the
    request keeps them): they take no room in `text_offset`."""

    def __init__(self, tok, n_top: int, skipped: set[int] = frozenset(), offset: int = 0):
        self.tok, self.n_top, self.skipped = tok, n_top, skipped
        self.done_tokens = 0  # output tokens rendered so far
        self.prompt_done = False
        self.offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _fresh(self, state) -> tuple[list[int], list, list]:
        ids = state.output_ids[self.done_tokens:]
        lps = state.output_logprobs[self.done_tokens:self.done_tokens + len(ids)]
        tops = state.output_top_logprobs[self.done_tokens:self.done_tokens + len(ids)] if self.n_top else []
        self.done_tokens += len(ids)
        return ids, lps, tops

    def chat(self, state) -> list[dict]:
        """Entries of the tokens produced since the last call (all of them on the first)."""
        ids, lps, tops = self._fresh(state)
        return [chat_entry(self.tok, t, lp, tops[k] if tops else None) for k, (t, lp) in enumerate(zip(ids, lps))]

    def completion(self, state, with_prompt: bool = False) -> dict:
        """The legacy object of the tokens since the last call; with `with_prompt`, the prompt's tokens
        (and their log-probabilities, once the server has sent them) come first, once."""
        tokens, logprobs, tops, offsets = [], [], [], []
        if with_prompt and not self.prompt_done and state.prompt_logprobs is not None:
            self.prompt_done = True
            prompt_tops = state.prompt_top_logprobs or []
            for k, t in enumerate(state.prompt_ids):
                top = prompt_tops[k] if k < len(prompt_tops) else None
                self._add(t, state.prompt_logprobs[k] if k < len(state.prompt_logprobs) else None,
                          top if k else None, tokens, logprobs, tops, offsets)
        ids, lps, new_tops = self._fresh(state)
        for k, (t, lp) in enumerate(zip(ids, lps)):
            self._add(t, lp, new_tops[k] if new_tops else None, tokens, logprobs, tops, offsets)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops if self.n_top else None,
                "text_offset": offsets}

    def _add(self, token_id, logprob, top, tokens, logprobs, tops, offsets) -> None:
        tokens.append(legacy_name(self.tok, token_id))
        logprobs.append(logprob)
        tops.append(None if top is None else {legacy_name(self.tok, i): v for i, v in top})
        offsets.append(self.offset)
        if token_id not in self.skipped:  # a partial character takes no room until its last byte
            self.offset += len(self._utf8.decode(self.tok.token_bytes(token_id)))


def skipped_ids(tok, skip_special_tokens: bool) -> set[int]:
    return set(tok.hf.all_special_ids) if skip_special_tokens else set()
