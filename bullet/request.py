"""One request's state, shared by every engine (offline, chunked baseline, prefill and decode
workers): its tokens, how many have K/V in the pool, its pages, its outputs and timestamps.

The next tokens to compute are always `all_ids[num_cached:]` and the logits of the last one give
the next output token — one rule for a fresh prompt, a prefill chunk, a decode step and a
recomputation after preemption."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from engines.sampling_params import SamplingParams

_uids = itertools.count(1)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    uid: int = field(default_factory=lambda: next(_uids))  # integer owner id for the page allocator
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    status: Status = Status.WAITING
    finish_reason: dict | None = None
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None

    def step_generator(self) -> torch.Generator | None:
        """A seeded request draws token k from a generator derived from (seed, k): the output is
        the same whichever worker samples it and whatever else is in the batch."""
        if self.params.seed is None:
            return None
        return torch.Generator().manual_seed((self.params.seed * 0x9E3779B97F4A7C15 + len(self.output_ids)) % 2**63)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_uncomputed(self) -> int:
        return self.seq_len - self.num_cached

    @property
    def in_prompt(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: dict) -> None:
        self.status, self.finish_reason, self.finish_time = Status.FINISHED, reason, time.monotonic()

    def reset_for_recompute(self) -> None:
        """After preemption: its pages are gone, everything is recomputed on re-admission."""
        self.page_table, self.num_cached, self.status = [], 0, Status.WAITING
