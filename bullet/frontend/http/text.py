"""Output text as clients see it: incrementally detokenized, never showing a stop string (text that
could still turn into one is held back until it can't), trimmed at the match when one completes."""

from __future__ import annotations

from bullet.types.finish import FinishReason, trim_stop_string
from engines.detokenizer import IncrementalDetokenizer
from engines.tokenizer import Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer | None, stop: list[str], skip_special_tokens: bool = True):
        # without a tokenizer (dummy weights) a request has token ids and no text: nothing to assemble
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.consumed = 0  # output tokens fed so far
        self.visible = ""  # text released to the client (only ever grows)

    def update(self, output_ids: list[int], finish_reason: FinishReason | None) -> str:
        """Feed the cumulative output ids; returns the newly visible text."""
        if self.detok is None:
            return ""
        if len(output_ids) > self.consumed:
            self.detok.push(output_ids[self.consumed :])
            self.consumed = len(output_ids)
        if finish_reason is not None:
            self.detok.flush()
            text = trim_stop_string(self.detok.text, finish_reason)
        else:
            text = self.detok.text
            if self.stop:
                text = text[: max(len(self.visible), len(text) - self.holdback)]
                for s in self.stop:  # a stop string fully present is about to end the request
                    pos = text.find(s, max(0, len(self.visible) - len(s)))
                    if pos != -1:
                        text = text[:pos]
        if not text.startswith(self.visible) or len(text) <= len(self.visible):
            return ""
        delta = text[len(self.visible) :]
        self.visible = text
        return delta
