"""Replays multi-turn conversations against a served endpoint (SGLang's native /generate, streamed):
one thread per conversation, closed loop — turn k is sent `think_s` after turn k-1's answer has
arrived, its prompt the token ids of everything said so far plus the next user message. Records each
turn's TTFT, end-to-end latency and the server's `cached_tokens`."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable, Sequence

from bullet.workloads.multiturn import Conversation


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft: float
    latency: float
    ok: bool


def stream_generate(url: str, body: dict, timeout: float) -> tuple[float, dict | None]:
    """(seconds to the first event, the last event) of a streamed /generate."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0, first, last = time.monotonic(), None, None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.monotonic() - t0
            last = json.loads(line[6:])
    return (first if first is not None else time.monotonic() - t0), last


def replay(url: str, conversations: Sequence[Conversation], encode: Callable[[str], list[int]],
           think_s: float = 1.0, filler: int = 1000, timeout: float = 600.0) -> list[TurnRecord]:
    """Every turn of every conversation; a user message is cut (or padded with id `filler + c` in
    conversation c) to its turn's `user_tokens`, and each answer is exactly `answer_tokens` long
    (ignore_eos)."""
    records: list[TurnRecord] = []
    lock = threading.Lock()
    t_start = time.monotonic()

    def run(c: int, conv: Conversation) -> None:
        time.sleep(max(0.0, conv.start - (time.monotonic() - t_start)))
        history: list[int] = []
        for k, (turn, text) in enumerate(zip(conv.turns, conv.texts)):
            user = (encode(text) if text else [])[:turn.user_tokens]
            user += [filler + c] * (turn.user_tokens - len(user))  # each conversation its own filler
            prompt = history + user
            body = {"input_ids": prompt, "stream": True, "sampling_params": {
                "temperature": 0, "max_new_tokens": turn.answer_tokens, "ignore_eos": True}}
            t0 = time.monotonic()
            try:
                ttft, last = stream_generate(url, body, timeout)
                meta, output = last["meta_info"], last["output_ids"]
                rec = TurnRecord(c, k, len(prompt), meta.get("cached_tokens", 0), len(output), ttft,
                                 time.monotonic() - t0, True)
            except Exception:  # a failed turn ends its conversation (the next would have no answer to build on)
                with lock:
                    records.append(TurnRecord(c, k, len(prompt), 0, 0, 0.0, time.monotonic() - t0, False))
                return
            with lock:
                records.append(rec)
            history = prompt + output
            time.sleep(think_s)

    threads = [threading.Thread(target=run, args=(c, conv), daemon=True) for c, conv in enumerate(conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(records, key=lambda r: (r.conversation, r.turn))
