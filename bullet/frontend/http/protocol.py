"""Request bodies. Unknown top-level fields are accepted and ignored (clients send many unused
ones: return_hidden_states, session_id, …); the fields we use are type-checked strictly (no "5" for
5, no "yes" for true: a client that sends those has a bug worth reporting). Fields that would change
the output but are not implemented (lora_path, custom_logit_processor, priority, best_of > n) are
read so that a request asking for them is refused by name (`refuse_unimplemented`); at their
defaults (null, as SGLang's clients send them) they are accepted."""

from __future__ import annotations

from typing import Annotated, Any, Union

import pydantic_core
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bullet.frontend.http.errors import APIError
from bullet.frontend.http.offload import sized
from engines.sampling_params import MAX_COUNT

# Every integer a client sends is bounded here, at the edge, whatever the field means: 2**63 is a
# 400 naming the field, never a number that reaches a worker (the specific checks come after).
Int = Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class GenerateBody(Body):
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[Int, list[Int]] = -1
    top_logprobs_num: Union[Int, list[Int]] = 0
    return_text_in_logprobs: bool = False
    rid: Union[str, list[str], None] = None
    priority: Int | None = None  # null or 0 only: there is no priority scheduling
    lora_path: Any = None  # null only: no LoRA adapters
    custom_logit_processor: Any = None  # null only


class AbortBody(Body):
    """SGLang's /abort_request: one rid (its samples too, for n > 1), or every request."""

    rid: str = ""
    abort_all: bool = False


class StreamOptions(Body):
    include_usage: bool = False


class OpenAISampling(Body):
    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    n: Int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: Int | None = None
    skip_special_tokens: bool | None = None
    response_format: dict | None = None
    # SGLang's extensions: constrained decoding without response_format (at most one constraint)
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Union[str, dict[str, Any], None] = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    rid: str | None = None  # SGLang's extension: the id /abort_request takes (choices share it)
    priority: Int | None = None  # null or 0 only: there is no priority scheduling
    lora_path: Any = None  # null only: no LoRA adapters


class CompletionBody(OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    best_of: Int | None = None  # null or n only: every sample is returned
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    name: str | None = None


class ChatBody(OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None


def refuse_unimplemented(body: Body) -> None:
    """400 naming a top-level field that asks for something this server does not do."""
    if getattr(body, "priority", None) not in (None, 0):
        raise APIError("priority: priority scheduling is not supported by this server (send null or 0)",
                       param="priority")
    lora = getattr(body, "lora_path", None)
    if lora not in (None, "") and not (isinstance(lora, list) and all(x in (None, "") for x in lora)):
        raise APIError("lora_path: LoRA adapters are not supported by this server", param="lora_path")
    if getattr(body, "custom_logit_processor", None) not in (None, ""):
        raise APIError("custom_logit_processor: custom logit processors are not supported by this server",
                       param="custom_logit_processor")
    best_of, n = getattr(body, "best_of", None), getattr(body, "n", 1)
    if best_of is not None and best_of != n:
        raise APIError(f"best_of ({best_of}) must equal n ({n}): choosing the best of several samples is not "
                       "supported by this server", param="best_of")


def parse_json(raw: bytes):
    """JSON → Python, with every way bytes can be bad ending in a 400 that says which: the parser
    (pydantic-core's, native) bounds nesting depth — so no RecursionError — and refuses invalid UTF-8
    and lone UTF-16 surrogate escapes (`"\\ud800"`), which Python's json module lets through as
    strings that no tokenizer or encoder can handle. NaN and Infinity are read as floats, so that the
    field that may not hold them is the one named in the error."""
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=True)
    except ValueError as exc:
        reason = str(exc)
        if "recursion limit" in reason:
            raise APIError(f"the request body is nested too deeply to be a request ({reason})") from None
        if "surrogate" in reason or "hex escape" in reason:
            reason += "; a \\uD800-\\uDFFF escape must be one half of a surrogate pair"
        raise APIError(f"the request body is not valid JSON ({reason})") from None


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's body, parsed and validated (in a thread when it is large)."""
    raw = await request.body()
    return await sized(len(raw), parse_body, raw, model)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union", "constrained-")))
            parts.append(f"{loc or 'body'}: {err['msg']}")
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        raise APIError("invalid request: " + "; ".join(parts), param=str(first[0]) if first else None) from exc
    refuse_unimplemented(body)
    return body
