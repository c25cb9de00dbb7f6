"""Typed messages between the frontend and the workers. Only metadata travels (token ids, page ids,
lengths, sampling params) — never tensor data: K/V stay in the shared pool.

    frontend --GenerateRequest/Abort--> prefill --Handoff--> decode
    frontend --Abort--> decode
    prefill, decode --OutputBatch--> frontend

Messages are pydantic models (validated where they are built) sent with pickle, the fastest
serialization for Python objects between our own processes."""

from __future__ import annotations

import pickle

from pydantic import BaseModel, ConfigDict

from engines.sampling_params import SamplingParams


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)


class GenerateRequest(Message):
    rid: str
    uid: int  # page-owner id, unique within the server instance
    input_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() at the frontend (CLOCK_MONOTONIC is system-wide on Linux)


class Abort(Message):
    rid: str
    uid: int
    message: str = "aborted by the client"


class Handoff(Message):
    """A prefilled request moving to decode: its pages already hold the prompt's K/V."""

    rid: str
    uid: int
    prompt_ids: list[int]
    output_ids: list[int]  # the first token, sampled by prefill
    page_table: list[int]
    params: SamplingParams
    arrival: float
    first_token_time: float
    output_logprobs: list[float | None] = []
    output_top_logprobs: list = []


class RequestOutput(Message):
    """New output of one request. `start` is the index of token_ids[0] among its output tokens, so
    the frontend can merge updates that arrive from two workers in any order."""

    rid: str
    start: int = 0
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    top_logprobs: list = []
    prompt_logprobs: list[float | None] | None = None
    prompt_tokens: int = 0
    finish_reason: dict | None = None
    worker: str = ""


class OutputBatch(Message):
    outputs: list[RequestOutput]


class Shutdown(Message):
    reason: str = ""


def encode(msg: Message) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    msg = pickle.loads(data)
    if not isinstance(msg, Message):
        raise TypeError(f"unexpected message type {type(msg).__name__}")
    return msg
