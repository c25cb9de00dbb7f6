"""Request bodies. Unknown top-level fields are accepted and ignored (clients send many unused
ones: lora_path, return_hidden_states, session_id, …); the fields we use are type-checked strictly
(no "5" for 5, no "yes" for true: a client that sends those has a bug worth reporting)."""

from __future__ import annotations

import json
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bullet.http.errors import APIError


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class GenerateBody(Body):
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    rid: Union[str, list[str], None] = None


class StreamOptions(Body):
    include_usage: bool = False


class OpenAISampling(Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    response_format: dict | None = None


class CompletionBody(OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatBody(OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union")))
            parts.append(f"{loc or 'body'}: {err['msg']}")
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        raise APIError("invalid request: " + "; ".join(parts), param=str(first[0]) if first else None) from exc
