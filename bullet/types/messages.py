"""Typed messages between the frontend and the workers, and their wire format.

    frontend --GenerateRequest/AbortRequest/FlushCache--> prefill --Handoff--> decode
    frontend --AbortRequest--> decode --Recompute--> prefill (its KV was dropped for memory)
    decode --Release/Evict--> prefill (the prefix cache's owner: pages of a finished request to keep,
                                       pages decode needs freed)
    prefill, decode --OutputBatch--> frontend

Only metadata travels (token ids, page ids, lengths, sampling params) — never tensor data: K/V stay
in the shared pool. On the wire a message is JSON validated by pydantic against this closed set of
types (the `kind` field picks the type): bytes from a socket can at worst fail validation, never
run code, so `decode` raises `MalformedMessage` and the receiving loop logs and drops it."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from bullet.types.finish import FinishReason
from engines.sampling_params import SamplingParams

MAX_MESSAGE_BYTES = 64 << 20  # far above any real message (a 128k-token prompt is ~1 MB of JSON)


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GenerateRequest(Message):
    kind: Literal["generate"] = "generate"
    rid: str  # the client's id, reported back
    uid: int = Field(ge=1)  # the server's id: unique within the instance, owns the request's pages
    input_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() at the frontend (CLOCK_MONOTONIC is system-wide on Linux)
    priority: int = Field(0, ge=-(1 << 30), le=1 << 30)  # higher is prefilled first (Request.priority)


class AbortRequest(Message):
    kind: Literal["abort"] = "abort"
    uid: int  # aborts are addressed by the server's id: a client may reuse its rid
    message: str = "aborted by the client"


class Handoff(Message):
    """A prefilled request moving to decode: its pages already hold the prompt's K/V."""

    kind: Literal["handoff"] = "handoff"
    rid: str
    uid: int = Field(ge=1)
    prompt_ids: list[int]
    output_ids: list[int]  # the first token, sampled by prefill
    page_table: list[int]
    params: SamplingParams
    arrival: float
    first_token_time: float
    output_logprobs: list[float | None] = []
    output_top_logprobs: list[list[tuple[int, float]] | None] = []
    priority: int = Field(0, ge=-(1 << 30), le=1 << 30)  # kept should decode hand it back (Recompute)
    shared_pages: int = Field(0, ge=0)  # the first pages of page_table are the prefix cache's: never freed by decode


class Release(Message):
    """Decode is done with a request's pages (finished or aborted): the prefix cache keeps the full
    pages of the tokens whose K/V they hold, frees the rest, and unpins the request's prefix."""

    kind: Literal["release"] = "release"
    uid: int = Field(ge=1)
    token_ids: list[int]  # the tokens whose K/V are in the pages (prompt and outputs but the last)
    page_table: list[int]
    shared_pages: int = Field(0, ge=0)


class Evict(Message):
    """Decode cannot grow its batch: free this many unreferenced cached pages if there are any."""

    kind: Literal["evict"] = "evict"
    pages: int = Field(ge=1)


class FlushCache(Message):
    """/flush_cache: drop every unreferenced page of the prefix cache."""

    kind: Literal["flush_cache"] = "flush_cache"


class Recompute(Message):
    """A running request whose pages decode gave up when the KV pool ran out: prefill recomputes its
    prompt and the tokens generated so far, samples the next one and hands it to decode again."""

    kind: Literal["recompute"] = "recompute"
    rid: str
    uid: int = Field(ge=1)
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    arrival: float
    first_token_time: float
    output_logprobs: list[float | None] = []
    output_top_logprobs: list[list[tuple[int, float]] | None] = []
    reported: int = Field(0, ge=0)  # output tokens the frontend already has
    priority: int = Field(0, ge=-(1 << 30), le=1 << 30)


class RequestOutput(BaseModel):
    """New output of one request. `start` is the index of token_ids[0] among its output tokens, so
    the frontend can merge updates that arrive from two workers in any order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uid: int
    start: int = Field(0, ge=0)
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    top_logprobs: list[list[tuple[int, float]] | None] = []
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # (token id, logprob) per position
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (from the worker that prefilled it)
    finish_reason: FinishReason | None = None
    worker: str = ""


class OutputBatch(Message):
    kind: Literal["outputs"] = "outputs"
    outputs: list[RequestOutput]


AnyMessage = Annotated[Union[GenerateRequest, AbortRequest, Handoff, Recompute, OutputBatch, Release, Evict, FlushCache],
                      Field(discriminator="kind")]
_ADAPTER: TypeAdapter = TypeAdapter(AnyMessage)


class MalformedMessage(ValueError):
    """Bytes that are not one of our messages (the text says what was wrong, briefly)."""


def encode(msg: Message) -> bytes:
    return msg.model_dump_json().encode()


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise MalformedMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _ADAPTER.validate_json(data)
    except ValidationError as exc:
        raise MalformedMessage(f"{exc.error_count()} error(s): {exc.errors()[0]['msg'][:200]}") from None
