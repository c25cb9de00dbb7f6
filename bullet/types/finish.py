"""Why a request stopped, and the rules that decide it: stop token ids, EOS (unless ignore_eos),
stop strings, max_new_tokens, the model's context.

Reasons are typed (`Stop`, `Length`, `Abort`) everywhere inside the server and on the wire between
its processes; `to_json()` gives SGLang's shapes ({"type": "stop", "matched": id | str},
{"type": "length", "length": n}, {"type": "abort", "message": ...}) at the HTTP edge."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from bullet.types.request import Request


class _Reason(BaseModel):
    model_config = ConfigDict(frozen=True)

    def to_json(self) -> dict:
        return self.model_dump()


class Stop(_Reason):
    type: Literal["stop"] = "stop"
    matched: int | str  # the stop token id or stop string that ended the output


class Length(_Reason):
    type: Literal["length"] = "length"
    length: int  # output tokens when the budget (or the model's context) ran out


class Abort(_Reason):
    type: Literal["abort"] = "abort"
    message: str  # why: the client left, the KV cache is full, a worker died, ...


FinishReason = Annotated[Union[Stop, Length, Abort], Field(discriminator="type")]


class TextDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class FinishChecker:
    def __init__(self, tokenizer: TextDecoder | None, eos_token_ids: set[int], max_context: int):
        self.tokenizer, self.eos, self.max_context = tokenizer, set(eos_token_ids), max_context

    def banned_ids(self, req: "Request") -> tuple[int, ...]:
        """Tokens that may not be sampled yet (min_new_tokens not reached)."""
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            return ()
        return tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos))

    def check(self, req: "Request") -> Stop | Length | None:
        # runs for every token of every request: each field is read once
        p, output = req.params, req.output_ids
        n = len(output)
        if n == 0:
            return Length(length=0) if p.max_new_tokens == 0 else None
        last = output[-1]
        if n >= p.min_new_tokens:
            if last in p.stop_token_ids or (not p.ignore_eos and last in self.eos):
                return Stop(matched=last)
            if p.stop:
                matched = self._stop_string(req)
                if matched is not None:
                    return Stop(matched=matched)
        if n >= p.max_new_tokens:
            return Length(length=p.max_new_tokens)
        if len(req.prompt_ids) + n >= self.max_context:  # req.seq_len
            return Length(length=n)
        return None

    def quiet_until(self, req: "Request", token: int) -> int:
        """How many output tokens `req` can hold before `check` may end it, if every token it samples
        is `token`: with fewer, `check` returns None (`token` matches no stop token or EOS that could
        end it yet, and every length limit is further). A caller that knows its tokens (the
        simulator) checks only from there on. Stop strings are judged on text: 1 (check every token).
        The request's params and prompt must not change meanwhile (they do not, while it runs)."""
        p = req.params
        if p.stop and self.tokenizer is not None:
            return 1
        limit = min(p.max_new_tokens, self.max_context - len(req.prompt_ids))
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            limit = min(limit, p.min_new_tokens)
        return max(1, limit)

    def _stop_string(self, req: "Request") -> str | None:
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


def trim_stop_string(text: str, reason: Stop | Length | Abort | None) -> str:
    """The output text ends before a matched stop string."""
    if isinstance(reason, Stop) and isinstance(reason.matched, str):
        pos = text.find(reason.matched)
        if pos != -1:
            return text[:pos]
    return text
