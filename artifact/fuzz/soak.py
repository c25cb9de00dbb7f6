"""The soak: good requests at a steady rate the server can carry, for minutes, through every
generation endpoint (native and OpenAI, streaming and not), so that slow leaks and rare hangs show:
what was sent, completed, failed (by status and by reason), lost (no answer within the timeout),
latency percentiles, and a progress line a minute."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from artifact.fuzz.http_cases import WORDS
from artifact.fuzz.http_driver import Findings


@dataclass
class SoakStats:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0  # no answer within the timeout: the request hung
    statuses: Counter = field(default_factory=Counter)
    endpoints: Counter = field(default_factory=Counter)
    latencies: list = field(default_factory=list)
    output_tokens: int = 0
    findings: Findings = field(default_factory=Findings)
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        lat = np.array(self.latencies) if self.latencies else np.array([np.nan])
        return {"sent": self.sent, "completed": self.completed, "failed": self.failed, "lost": self.lost,
                "status_4xx": sum(n for s, n in self.statuses.items() if 400 <= s < 500),
                "status_5xx": sum(n for s, n in self.statuses.items() if s >= 500),
                "statuses": dict(sorted(self.statuses.items())), "endpoints": dict(self.endpoints),
                "latency_p50_s": float(np.nanpercentile(lat, 50)), "latency_p90_s": float(np.nanpercentile(lat, 90)),
                "latency_max_s": float(np.nanmax(lat)), "output_tokens": self.output_tokens,
                "failures": self.findings.as_dict(), "wall_s": round(self.wall_s, 1)}


def soak_request(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict, bool]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 160)))
    n = rng.randint(max(1, max_tokens // 4), max_tokens)
    stream = rng.random() < 0.4
    kind = rng.random()
    if kind < 0.5:
        return "/generate", {"text": prompt, "stream": stream,
                             "sampling_params": {"max_new_tokens": n, "temperature": rng.choice([0, 0.8])}}, stream
    if kind < 0.75:
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n, "stream": stream}, stream
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": n, "stream": stream}, stream


def reports_an_error(text: bytes, stream: bool) -> bool:
    """Whether a 200 answer carries an error: a stream's error event (`data: {"error": ...}`, what the
    server sends when a generation fails after its headers went out), or a body whose top level is an
    error. Read as JSON, not searched as bytes: a model that writes the word "error" streams a delta
    `{"content": "error"}`, which is a completed request (a 10-minute soak met it once)."""
    if not stream:
        try:
            return "error" in json.loads(text)
        except (ValueError, TypeError):
            return True  # a 200 that is not JSON is not a completed generation
    for line in text.splitlines():
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            return True
        if isinstance(event, dict) and "error" in event:
            return True
    return False


def _tokens(path: str, body: dict, text: bytes, stream: bool) -> int:
    """Output tokens the server reports; for streams, the events received (a lower bound)."""
    if stream:
        return max(0, text.count(b"data:") - 1)
    try:
        data = json.loads(text)
        if path == "/generate":
            return int(data["meta_info"]["completion_tokens"])
        return int(data["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 0


async def one(session: aiohttp.ClientSession, url: str, path: str, body: dict, stream: bool, stats: SoakStats,
              timeout: float) -> None:
    t0 = time.monotonic()
    stats.endpoints[path + (" stream" if stream else "")] += 1
    try:
        async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.read()
            stats.statuses[resp.status] += 1
            if resp.status == 200 and (not stream or text.rstrip().endswith(b"data: [DONE]")) \
                    and not reports_an_error(text, stream):
                stats.completed += 1
                stats.latencies.append(time.monotonic() - t0)
                stats.output_tokens += _tokens(path, body, text, stream)
                return
            stats.failed += 1
            stats.findings.add(f"{path} -> {resp.status}", text[-300:].decode(errors="replace"))
    except asyncio.TimeoutError:
        stats.lost += 1
        stats.findings.add("no answer within the timeout", f"{path} after {timeout:g} s")
    except (aiohttp.ClientError, OSError) as exc:
        stats.failed += 1
        stats.findings.add(f"connection: {type(exc).__name__}", str(exc)[:300])


async def soak(url: str, model: str, minutes: float, rate: float, seed: int, max_tokens: int = 48,
               timeout: float = 300.0, progress=None) -> SoakStats:
    """Poisson arrivals at `rate` req/s for `minutes`, then wait for every request to end."""
    stats = SoakStats()
    rng = random.Random(seed)
    t0 = time.monotonic()
    end = t0 + minutes * 60
    next_report = t0 + 60
    tasks = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        at = t0
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            path, body, stream = soak_request(rng, model, max_tokens)
            task = asyncio.create_task(one(session, url, path, body, stream, stats, timeout))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            stats.sent += 1
            if progress and time.monotonic() >= next_report:
                progress(stats, time.monotonic() - t0, len(tasks))
                next_report += 60
        if tasks:
            await asyncio.gather(*tasks)
    stats.wall_s = time.monotonic() - t0
    return stats
