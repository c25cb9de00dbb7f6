"""Multi-turn conversations on the simulator, closed loop: turn k arrives `think_s` after turn k-1
finished, its prompt the earlier turn's prompt and answer (the same token ids, so the prefix cache
finds them) plus the new user message. Everything else is a plain `Simulation`."""

from __future__ import annotations

from typing import Sequence

from bullet.sim.config import SimConfig
from bullet.sim.simulator import Simulation
from bullet.types.request import Request
from bullet.workloads.multiturn import Conversation


class ConversationSimulation(Simulation):
    def __init__(self, config: SimConfig, conversations: Sequence[Conversation], think_s: float = 1.0):
        rows, self._turn = [], []  # one row per turn; (conversation, turn) of each
        for c, conv in enumerate(conversations):
            context = 0
            for k, turn in enumerate(conv.turns):
                context += turn.user_tokens
                rows.append((conv.start, context, turn.answer_tokens))  # arrival fixed later for k > 0
                self._turn.append((c, k))
                context += turn.answer_tokens
        self.conversations, self.think_s = list(conversations), think_s
        super().__init__(config, rows)
        # Simulation sorts its rows by arrival: map them back (stable: a conversation's turns stay in order)
        order = sorted(range(len(rows)), key=lambda i: rows[i])
        self._turn = [self._turn[i] for i in order]
        self._index = {ct: i for i, ct in enumerate(self._turn)}
        self._last: dict[int, Request] = {}  # each conversation's latest finished turn
        finished = self.log.finished

        def on_finish(req: Request) -> None:
            finished(req)
            self._next_turn(req)

        self.log.finished = on_finish

    def _schedule_arrivals(self) -> None:
        for i, (c, k) in enumerate(self._turn):
            if k == 0:
                self.loop.at(self.conversations[c].start, self._arrive, i)

    def _next_turn(self, req: Request) -> None:
        c, k = self._turn[int(req.rid[1:])]
        self._last[c] = req
        nxt = self._index.get((c, k + 1))
        if nxt is not None:
            self.loop.at(self.clock.now() + self.think_s, self._arrive_turn, nxt)

    def _arrive_turn(self, index: int) -> None:
        _, prompt, output = self.requests[index]
        self.requests[index] = (self.clock.now(), prompt, output)
        self._arrive(index)

    def _prompt_ids(self, index: int, length: int) -> list[int]:
        c, k = self._turn[index]
        if k == 0:
            return [index + 1] * length
        prev = self._last[c]
        history = prev.prompt_ids + prev.output_ids
        return history + [index + 1] * (length - len(history))
