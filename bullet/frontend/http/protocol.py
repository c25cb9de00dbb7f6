"""Request bodies. The fields we use are type-checked strictly (no "5" for 5, no "yes" for true: a
client that sends those has a bug worth reporting). Every field SGLang's and OpenAI's clients know
is classified in `bullet.frontend.http.fields`: those we do not implement are refused by name when
they ask for something (at their unset values — null, as SGLang's clients send them — they are
accepted); fields no API defines (a client's own, such as session_id) are accepted and dropped."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

import pydantic_core
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bullet.frontend.http.errors import APIError
from bullet.frontend.http.fields import refuse
from bullet.frontend.http.offload import sized
from engines.sampling_params import MAX_COUNT

# Every integer a client sends is bounded here, at the edge, whatever the field means: 2**63 is a
# 400 naming the field, never a number that reaches a worker (the specific checks come after).
Int = Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    registry: ClassVar[str | None] = None  # its table in bullet.frontend.http.fields


class GenerateBody(Body):
    registry: ClassVar[str | None] = "generate"
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[Int, list[Int]] = -1
    top_logprobs_num: Union[Int, list[Int]] = 0
    return_text_in_logprobs: bool = False
    rid: Union[str, list[str], None] = None
    priority: Int | None = None  # higher first, with --enable-priority-scheduling (null: 0)


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
    priority: Int | None = None  # higher first, with --enable-priority-scheduling (null: 0)


class CompletionBody(OpenAISampling):
    registry: ClassVar[str | None] = "completion"
    prompt: Union[str, list[str], list[int], list[list[int]]]
    best_of: Int | None = None  # samples to draw; the n with the highest cumulative logprob are returned
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False


# the roles a chat template is given; OpenAI's `developer` (its newer name for system instructions) is
# given as `system`; the deprecated `function` role is refused (its replies go in `tool` messages)
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}


class ChatMessage(Body):
    registry: ClassVar[str | None] = "message"
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    name: str | None = None


class ChatBody(OpenAISampling):
    registry: ClassVar[str | None] = "chat"
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None


def check_priority(body: Body, enabled: bool) -> None:
    """A priority other than the default (null or 0) needs --enable-priority-scheduling (off by
    default, as in SGLang): without it every request is served in arrival order, so it is refused
    by name rather than ignored."""
    if not enabled and getattr(body, "priority", None) not in (None, 0):
        raise APIError("priority: requests are served in arrival order; start the server with "
                       "--enable-priority-scheduling to serve higher priorities first (or send null or 0)",
                       param="priority")


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


def check_message(message: dict, k: int) -> None:
    """messages[k]: its refused fields and its role, before validation (which then names only types)."""
    refuse(message, "message", f"messages[{k}].", param="messages")
    role = message.get("role")
    if isinstance(role, str) and role in ROLE_ALIASES:
        message["role"] = ROLE_ALIASES[role]
    elif isinstance(role, str) and role not in CHAT_ROLES:
        hint = "; the deprecated function role: reply in a tool message with tool_call_id" if role == "function" else ""
        raise APIError(f"messages[{k}].role: {role!r} is not one of {', '.join(CHAT_ROLES)} or developer{hint}",
                       param="messages")


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's body, parsed and validated (in a thread when it is large)."""
    raw = await request.body()
    body = await sized(len(raw), parse_body, raw, model)
    check_priority(body, request.app.state.runtime.args.enable_priority_scheduling)
    return body


def parse_body(raw: bytes, model: type[Body]) -> Body:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    if model.registry is not None:
        refuse(data, model.registry)
    if model is ChatBody and isinstance(data.get("messages"), list):
        for k, message in enumerate(data["messages"]):
            if isinstance(message, dict):
                check_message(message, k)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "union", "constrained-")))
            parts.append(f"{loc or 'body'}: {err['msg']}")
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        raise APIError("invalid request: " + "; ".join(parts), param=str(first[0]) if first else None) from exc
    return body
