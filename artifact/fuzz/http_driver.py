"""Send generated HTTP cases to a server, a few at a time, and classify what came back.

Outcomes per case: the status class (2xx/4xx/5xx), or `timeout`, `conn-error`, `closed` (the server
hung up, acceptable for an oversized body or a protocol violation), `no-answer` (a raw request the
server is still waiting on, e.g. a body shorter than its Content-Length), `abandoned` (the client
walked away on purpose), `abandoned-long` (a valid request that sets no length limit — a mutation
mangled its name — ran past the client's timeout: not a failure; a hang would leave it in flight at
the end), `unsent` (the HTTP client refused to send it). Failures — reported with examples, never raised — are any 5xx, a timeout or
a dropped connection on a well-formed request, a good request refused, a stream that does not end
with [DONE] or an error event, and a liveness probe (health + one real generation) that fails."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from artifact.fuzz.http_cases import OK, REJECT, Case, CaseGenerator
from artifact.fuzz.probes import liveness, server_info, wait_alive

EXAMPLES = 5
RECOVERY_S = 180.0  # how long a failed server may take to come back before a phase gives up


@dataclass
class Findings:
    """Counts and a few examples per kind of finding."""

    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, kind: str, example: str) -> None:
        self.counts[kind] += 1
        shown = self.examples.setdefault(kind, [])
        if len(shown) < EXAMPLES:
            shown.append(example)

    def as_dict(self) -> dict:
        return {k: {"count": n, "examples": self.examples.get(k, [])} for k, n in self.counts.most_common()}


@dataclass
class HttpStats:
    sent: int = 0
    outcomes: dict = field(default_factory=dict)  # category -> Counter of outcomes
    statuses: Counter = field(default_factory=Counter)
    findings: Findings = field(default_factory=Findings)  # failures
    lenient: Findings = field(default_factory=Findings)  # bad input accepted with a 2xx
    probes: list = field(default_factory=list)
    restarts: list = field(default_factory=list)
    stopped_early: str | None = None
    wall_s: float = 0.0

    def record(self, case: Case, outcome: str) -> None:
        self.outcomes.setdefault(case.category, Counter())[outcome] += 1

    def as_dict(self) -> dict:
        return {"sent": self.sent, "wall_s": round(self.wall_s, 1), "stopped_early": self.stopped_early,
                "statuses": dict(sorted(self.statuses.items())),
                "outcomes": {c: dict(n) for c, n in sorted(self.outcomes.items())},
                "failures": self.findings.as_dict(), "lenient": self.lenient.as_dict(),
                "probes": self.probes, "worker_restarts": self.restarts}


def status_class(status: int) -> str:
    return f"{status // 100}xx"


async def send_raw(url: str, raw: bytes, close_early: bool, timeout: float) -> tuple[str, int | None, bytes]:
    """(outcome, status, what came back) of bytes written straight to the server's socket."""
    parts = urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), 10)
    try:
        writer.write(raw)
        await writer.drain()
        if close_early:
            return "abandoned", None, b""
        try:
            head = await asyncio.wait_for(reader.read(65536), timeout)
        except asyncio.TimeoutError:
            return "no-answer", None, b""
        fields = head.split(b" ", 2)
        status = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
        return (status_class(status) if status else "closed"), status, head
    except (ConnectionError, OSError):
        return "closed", None, b""
    finally:
        writer.close()


async def run_case(session: aiohttp.ClientSession, url: str, case: Case, stats: HttpStats, timeout: float) -> None:
    t0 = time.monotonic()
    status, text = None, b""
    try:
        if case.action == "raw":
            outcome, status, text = await send_raw(url, case.raw, case.note == "half-body-then-close", 10.0)
        else:
            limit = {"client-timeout": 0.3}.get(case.action, timeout)
            async with session.request(case.method, url + case.path, data=case.body, headers=case.headers,
                                       timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                status = resp.status
                if case.action == "stream-abort" and status == 200:
                    await asyncio.wait_for(resp.content.readany(), 10)
                    resp.close()  # walk away mid-stream
                    outcome = "abandoned"
                else:
                    text = await resp.read()
                    outcome = status_class(status)
    except asyncio.TimeoutError:
        if case.action in ("client-timeout", "stream-abort"):
            outcome = "abandoned"
        elif unbounded_generation(case):  # e.g. a mutated "max_tokens" key: the server's default applies
            outcome = "abandoned-long"
        else:
            outcome = "timeout"
    except (aiohttp.ClientError, ConnectionError, OSError) as exc:
        outcome = "closed" if case.category in ("oversized", "protocol") else "conn-error"
        text = f"{type(exc).__name__}: {exc}".encode()
    except Exception as exc:  # the client could not even send it (e.g. a URL it refuses): not the server's fault
        outcome = "unsent"
        text = f"{type(exc).__name__}: {exc}".encode()
    stats.record(case, outcome)
    if status:
        stats.statuses[status] += 1
    example = f"{case.describe()} -> {status or outcome} {text[:200]!r} ({time.monotonic() - t0:.1f} s)"
    if outcome in ("5xx", "timeout", "conn-error"):
        stats.findings.add(outcome, example)
    elif case.expect == OK and outcome == "4xx":
        stats.findings.add("good request refused", example)
    elif case.expect == REJECT and outcome == "2xx":
        stats.lenient.add(f"{case.category}/{case.note}", example)
    if b"root:x:0:0" in text:  # a path that escaped the API and served a file
        stats.findings.add("file disclosed", example)
    if case.expect == OK and outcome == "2xx" and b"data:" in text[:6] and not _stream_ended(text):
        stats.findings.add("stream not terminated", example)


def unbounded_generation(case: Case) -> bool:
    """A valid generation request that sets no length limit (a mutation mangled the field's name):
    the server then generates up to its default (for chat, the rest of the context: thousands of
    tokens on a CPU), so the client giving up on it says nothing about the server. Whether it hung
    instead shows at the end: requests still in flight, pages not returned."""
    try:
        body = json.loads(case.body or b"")
    except (ValueError, TypeError, RecursionError):  # e.g. a body nested thousands deep
        return False
    if not isinstance(body, dict) or case.path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
        return False
    params = body.get("sampling_params") if case.path == "/generate" else body
    if not isinstance(params, dict):
        return case.path == "/generate" and "sampling_params" not in body
    return not any(isinstance(params.get(k), int) for k in ("max_new_tokens", "max_tokens", "max_completion_tokens"))


def _stream_ended(text: bytes) -> bool:
    tail = text.rstrip()[-300:]
    return tail.endswith(b"data: [DONE]") or b'"error"' in tail


async def check(session: aiohttp.ClientSession, url: str, stats: HttpStats, index: int, recent: deque,
                last_restarts: list) -> bool:
    """A liveness probe; notes worker restarts since the last one with the cases sent just before.
    False when the server failed it and did not recover within RECOVERY_S."""
    probe = await liveness(session, url)
    probe["after_case"] = index
    stats.probes.append(probe)
    info = await server_info(session, url)
    if info is not None and info.get("worker_restarts", 0) != last_restarts[0]:
        stats.restarts.append({"after_case": index, "restarts": info.get("worker_restarts"),
                               "failures": info.get("failures", [])[-3:], "recent_cases": list(recent)[-10:]})
        last_restarts[0] = info.get("worker_restarts", 0)
    if not probe["alive"]:
        stats.findings.add("liveness probe failed", f"after case {index}: {probe}; recent: {list(recent)[-5:]}")
        # a supervised server restarts a dead or hung worker: give it the time to, then go on fuzzing
        probe["recovered_after_s"] = await wait_alive(session, url, RECOVERY_S)
        return probe["recovered_after_s"] is not None
    return True


async def fuzz_http(url: str, generator: CaseGenerator, count: int, concurrency: int = 8, probe_every: int = 500,
                    timeout: float = 120.0, progress=None) -> HttpStats:
    stats = HttpStats()
    recent: deque = deque(maxlen=50)
    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(limit=concurrency + 2, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        info = await server_info(session, url)
        last_restarts = [info.get("worker_restarts", 0) if info else 0]
        queue: asyncio.Queue = asyncio.Queue(maxsize=concurrency * 2)

        async def worker():
            while (case := await queue.get()) is not None:
                try:  # a bug of the driver's own is a finding, never a worker gone (queue.join would hang)
                    await run_case(session, url, case, stats, timeout)
                except Exception as exc:
                    stats.findings.add("driver error", f"{case.describe()}: {type(exc).__name__}: {exc}")
                finally:
                    queue.task_done()
            queue.task_done()

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        for index in range(1, count + 1):
            case = generator.next()
            recent.append(case.describe(80))
            await queue.put(case)
            stats.sent += 1
            if index % probe_every == 0 or index == count:
                await queue.join()  # probe a quiet server: what it answers now is its own state
                alive = await check(session, url, stats, index, recent, last_restarts)
                if progress:
                    progress(index, count, stats)
                if not alive:
                    stats.stopped_early = (f"the server failed a liveness probe after case {index} and did not "
                                           f"recover within {RECOVERY_S:g} s")
                    break
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
    stats.wall_s = time.monotonic() - t0
    return stats
