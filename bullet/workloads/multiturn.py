"""Multi-turn conversations replayed from ShareGPT: turn k's prompt is the conversation so far
(every earlier user message and answer) plus the next user message, sent once turn k-1's answer
has arrived and the user has "thought" for `think_s` seconds. Conversations start as a Poisson
process at `rate` per second. The workload where a prefix cache pays most — and where chunked
prefill re-reads a long cached context with every chunk (MuxWise §2.3.2).

`Conversation.turns` holds lengths in tokens (the simulator: `bullet.sim.conversations`); `texts`
the user messages themselves, for a served replay (`bullet.workloads.multiturn_client`)."""

from __future__ import annotations

import random
from typing import Callable, NamedTuple

from bullet.workloads.sharegpt import load_sharegpt_conversations
from bullet.workloads.traces import CHARS_PER_TOKEN


class Turn(NamedTuple):
    user_tokens: int
    answer_tokens: int


class Conversation(NamedTuple):
    start: float  # seconds from the start of the run
    turns: list[Turn]
    texts: list[str]  # the user message of each turn


def _count(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def sharegpt_conversations(num: int, rate: float, seed: int = 0, min_turns: int = 2, max_turns: int = 6,
                           max_user: int = 512, max_answer: int = 256, max_context: int = 4096,
                           count: Callable[[str], int] = _count) -> list[Conversation]:
    """`num` conversations of ShareGPT with at least `min_turns` user turns (at most `max_turns` are
    kept): each user message is cut to `max_user` tokens, each answer to `max_answer`, and a
    conversation ends before its context would pass `max_context`. `count` measures a text in
    tokens (default: 4 characters a token; pass a tokenizer's for a served run)."""
    if num < 1 or rate <= 0:
        raise ValueError("num and rate must be positive")
    rng = random.Random(seed)
    pool = load_sharegpt_conversations(limit=num * 20, min_turns=2 * min_turns)
    rng.shuffle(pool)
    out, t = [], 0.0
    for record in pool:
        turns, texts, context = [], [], 0
        pairs = [(a, b) for a, b in zip(record[0::2], record[1::2]) if a.get("from") == "human"]
        for human, gpt in pairs[:max_turns]:
            user, answer = min(max_user, count(human["value"])), min(max_answer, count(gpt["value"]))
            if user < 4 or answer < 4 or context + user + answer > max_context:
                break
            turns.append(Turn(user, answer))
            texts.append(human["value"])
            context += user + answer
        if len(turns) < min_turns:
            continue
        t += rng.expovariate(rate)
        out.append(Conversation(t, turns, texts))
        if len(out) == num:
            break
    if len(out) < num:
        raise ValueError(f"only {len(out)} ShareGPT conversations have {min_turns} turns within the limits")
    return out


def synthetic_conversations(num: int, rate: float, turns: int = 4, user_tokens: int = 200, answer_tokens: int = 100,
                            seed: int = 0) -> list[Conversation]:
    """Conversations of fixed shape (no dataset needed): for tests and quick simulations."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(Conversation(t, [Turn(user_tokens, answer_tokens)] * turns, [""] * turns))
    return out
