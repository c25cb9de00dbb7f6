"""When a request stops: stop token ids, EOS (unless ignore_eos), stop strings, max_new_tokens,
the model's context. Reasons use SGLang's shapes: {"type": "stop", "matched": id | str},
{"type": "length", "length": n}, {"type": "abort", "message": ...}."""

from __future__ import annotations

from bullet.request import Request
from engines.tokenizer import Tokenizer


class FinishChecker:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], max_context: int):
        self.tokenizer, self.eos, self.max_context = tokenizer, set(eos_token_ids), max_context

    def banned_ids(self, req: Request) -> tuple[int, ...]:
        """Tokens that may not be sampled yet (min_new_tokens not reached)."""
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            return ()
        return tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos))

    def check(self, req: Request) -> dict | None:
        p, n = req.params, len(req.output_ids)
        if n == 0:
            return {"type": "length", "length": 0} if p.max_new_tokens == 0 else None
        last = req.output_ids[-1]
        if n >= p.min_new_tokens:
            if last in p.stop_token_ids or (not p.ignore_eos and last in self.eos):
                return {"type": "stop", "matched": last}
            matched = self._stop_string(req)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if req.seq_len >= self.max_context:
            return {"type": "length", "length": n}
        return None

    def _stop_string(self, req: Request) -> str | None:
        stops = req.params.stop
        if not stops or self.tokenizer is None:
            return None
        # A stop string can only complete inside the text of the last few tokens: decode a tail
        # window long enough for the longest stop string (a token is at least one character).
        window = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(req.output_ids[-window:], req.params.skip_special_tokens)
        last_piece = self.tokenizer.decode(req.output_ids[-1:], req.params.skip_special_tokens)
        for s in stops:
            pos = tail.rfind(s)
            # only a match that the newest token completed (earlier ones were already checked)
            if pos != -1 and pos + len(s) > len(tail) - len(last_piece):
                return s
        return None


def trim_stop_string(text: str, reason: dict | None) -> str:
    """The output text ends before a matched stop string."""
    if reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
        pos = text.find(reason["matched"])
        if pos != -1:
            return text[:pos]
    return text
