"""What a scheduling policy sees and decides — the seam between policy and the world.

A loop core (`bullet.loops`) builds a *view* each step from its clock, its queue/batch, the peer's
published state and the partition backend, asks the policy for a *decision*, and carries it out —
in a worker process or in the simulator, on wall-clock or virtual time. Policies never touch
sockets, processes, wall-clock time or tensors, and this module imports none of torch, shared
memory or the C extension, so policies and the simulator load in milliseconds."""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

from bullet.types.request import Request
from bullet.types.worker_state import Predictions, WorkerFlags, WorkerState


@dataclass
class InflightPrefill:
    requests: list[Request]
    layers_done: int
    total_layers: int
    started: float
    # tokens each request computes: its prompt, or prompt + outputs when decode handed it back to be
    # recomputed (taken when the batch starts: sampling the first token later lengthens the request)
    lengths: list[int] = field(default_factory=list)
    state: object = None  # the executor's computation in flight (activations between layer groups)
    # tokens of each request already in the pool when the batch starts (a cached prefix): its
    # `lengths` tokens follow them and attend to them
    starts: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.lengths:
            self.lengths = [r.num_uncomputed for r in self.requests]
        if not self.starts:
            self.starts = [r.num_cached for r in self.requests]

    @property
    def remaining_layers(self) -> int:
        return self.total_layers - self.layers_done

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class PrefillView:
    now: float
    queue: Sequence[Request]  # waiting: higher priority first, then in arrival order (types.request.enqueue)
    inflight: InflightPrefill | None
    peer: WorkerState  # the decode worker's last published state
    total_units: int
    current_units: int
    free_pages: int
    page_size: int
    # a batch preempted at a layer boundary (its KV in place) that resumes once `inflight` is done;
    # while one waits, the in-flight batch cannot be preempted in turn
    suspended: InflightPrefill | None = None
    # prompts prefill may still start under --max-running-requests (decoding, handed over, in prefill)
    free_slots: int = 1 << 30


@dataclass
class PrefillDecision:
    admit: list[Request] = field(default_factory=list)  # start a batch with these (none in flight, or `preempt`)
    num_layers: int = 0  # layers to run now (0 = idle this step)
    units: int = 1  # compute share for this step
    predicted_s: float = 0.0  # the policy's estimate of this step, reported for the timeline
    lengths: list[int] = field(default_factory=list)  # tokens of each request in the batch the step runs
    reason: str = ""  # which rule chose the split (timeline, debugging)
    predictions: Predictions = field(default_factory=Predictions)  # for the state buffer
    yield_s: float = 0.0  # > 0: run nothing, publish no units (decode takes them all) for this long
    # with a batch in flight: `admit` runs first, and the in-flight batch waits at its layer boundary
    preempt: bool = False
    # the share prefill chose when it runs on fewer `units` until a decode step ends (0: none)
    claimed_units: int = 0


@dataclass
class DecodeView:
    now: float
    running: Sequence[Request]
    peer: WorkerState  # the prefill worker's last published state
    total_units: int
    current_units: int
    last_step_end: float | None = None  # when this worker's last step ended (its tokens out); None: none yet


@dataclass
class DecodeDecision:
    run: bool = True  # False: pause this step (yield the units to a prefill burst)
    units: int = 1
    predicted_s: float = 0.0
    reason: str = ""
    predictions: Predictions = field(default_factory=Predictions)  # for the state buffer


class PrefillPolicy(ABC):
    name = "prefill"

    @abstractmethod
    def decide(self, view: PrefillView) -> PrefillDecision: ...

    def observe(self, decision: PrefillDecision, seconds: float, view: PrefillView,
                peer_after: WorkerState | None = None) -> None:
        """Feedback: how long the decided step took (`peer_after`: decode's state at its end)."""


class DecodePolicy(ABC):
    name = "decode"

    @abstractmethod
    def decide(self, view: DecodeView) -> DecodeDecision: ...

    def observe(self, decision: DecodeDecision, seconds: float, view: DecodeView,
                peer_after: WorkerState | None = None) -> None:
        """Feedback: how long the decided step took (`peer_after`: prefill's state at its end)."""

    def units_mid_step(self, peer: WorkerState, current_units: int) -> int | None:
        """Between two layers of a running step, with the peer's state as it is now:
        the units to go on with, or None to keep the step's share to its end (the default)."""
        return None


def ran_beside(before: WorkerState, after: WorkerState | None) -> bool:
    """Whether the peer ran a step beside one of ours, from its state when ours was decided (`before`)
    and when ours ended (`after`): it finished a step meanwhile, or it holds units, not paused, at our
    end. The state at the decision alone mislabels both ways: a decode that starts its first batch
    mid-step, a decode that pauses for the prefill step just decided (found in simulation: an online
    correction that learnt co-runs from such labels took prefill alone for twice as slow as it is)."""
    if after is None:
        return before.compute_units > 0 and not before.flags & WorkerFlags.PAUSED
    return after.step != before.step or (after.compute_units > 0 and not after.flags & WorkerFlags.PAUSED)


def beside_size(before: WorkerState, after: WorkerState | None, field: str) -> int:
    """What the peer ran beside one of our steps, for pricing it (`field`: its batch size or its tokens
    in flight, the larger of the two states, at least 1), or 0 where our step ran alone (`ran_beside`)."""
    if not ran_beside(before, after):
        return 0
    return max(1, getattr(before, field), getattr(after, field) if after is not None else 0)


def largest_at_most(units: Sequence[int], limit: int) -> int | None:
    """The largest of the ascending `units` that is at most `limit` (None: none is)."""
    at = bisect.bisect_right(units, limit)
    return units[at - 1] if at else None


def admit_fcfs(queue: Sequence[Request], token_budget: int, free_pages: int, page_size: int,
               reserve_pages: int = 0, max_requests: int = 1 << 30) -> list[Request]:
    """Requests from the head of the queue while their prompts fit the token budget, the free
    pages (minus a reserve for the decode batch to grow into) and `max_requests`. Always admits the
    head alone if it fits in memory, so a prompt larger than the budget is not starved."""
    admitted, tokens, pages = [], 0, free_pages - reserve_pages
    for req in queue:
        n = req.num_uncomputed
        need = -(-n // page_size)
        if len(admitted) >= max_requests or need > pages or (admitted and tokens + n > token_budget):
            break
        admitted.append(req)
        tokens += n
        pages -= need
    return admitted
