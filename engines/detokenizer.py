"""Incremental detokenization for streaming: emit only text that can no longer change.

A byte-level BPE token may end in the middle of a UTF-8 character, and SentencePiece decoding of a
lone token can drop a leading space; decoding a short window that starts a few tokens back and
holding text back while it ends in U+FFFD avoids both."""

from __future__ import annotations

from engines.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded again for context
        self.read_offset = 0  # tokens up to here have been emitted
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the newly stable text (possibly empty)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        now = decode(self.ids[self.prefix_offset :], self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            delta = now[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (incomplete characters included)."""
        full = self.tokenizer.decode(self.ids, self.skip)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
