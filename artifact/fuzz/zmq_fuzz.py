"""Raw messages to the server's local sockets: the prefill and decode workers' and the frontend's
bound PULL sockets in the runtime directory /server_info names (`prefill-<n>.sock`,
`decode-<n>.sock`, `frontend.sock`), pushed to by anyone who can open them — which the 0700
directory limits to the server's own user, who is also who runs this driver.

Payloads: random bytes, text, pickles (one of which would create a canary directory if anything
unpickled it — the old wire format's hole), JSON of the wrong shape, deep nesting, lone surrogates,
out-of-range numbers, multipart frames, a message over the size limit, and well-formed messages with
bogus contents (unknown ids, token ids outside the vocabulary, page ids outside the pool). A correct
server logs and drops what it cannot use; nothing may run code, kill a loop or leave a worker
restarting. After every batch the driver asks for a real generation to prove the loops still run."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import zmq

from artifact.fuzz.http_driver import RECOVERY_S, Findings
from artifact.fuzz.probes import liveness, server_info, wait_alive


class Canary:
    """Unpickling this creates a directory: proof that a receiver ran code from the wire."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


@dataclass
class ZmqStats:
    sent: Counter = field(default_factory=Counter)  # socket -> messages delivered to it
    undeliverable: Counter = field(default_factory=Counter)
    categories: Counter = field(default_factory=Counter)
    findings: Findings = field(default_factory=Findings)
    probes: list = field(default_factory=list)
    restarts: list = field(default_factory=list)
    canary_path: str = ""
    code_executed: bool = False
    stopped_early: str | None = None
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return {"sent": dict(self.sent), "total_sent": sum(self.sent.values()),
                "undeliverable": dict(self.undeliverable), "categories": dict(self.categories),
                "code_executed": self.code_executed, "canary_path": self.canary_path, "stopped_early": self.stopped_early,
                "failures": self.findings.as_dict(), "probes": self.probes, "worker_restarts": self.restarts,
                "wall_s": round(self.wall_s, 1)}


class Payloads:
    def __init__(self, rng: random.Random, canary: str, vocab_size: int, pages: int):
        self.rng, self.canary, self.vocab, self.pages = rng, canary, vocab_size, pages
        self.uid = 10**12  # far above the frontend's own ids, which count from 1

    def _params(self) -> dict:
        return {"max_new_tokens": self.rng.randint(1, 4), "temperature": 0.0}

    def bogus(self, socket_name: str) -> bytes:
        """Well-formed messages that mean nothing: what a confused (not malicious) peer would send."""
        r, now = self.rng, time.monotonic()
        self.uid += 1
        ids = [r.randrange(1, self.vocab) for _ in range(r.randint(1, 16))]
        if r.random() < 0.3:
            ids[r.randrange(len(ids))] = r.choice([-1, self.vocab, self.vocab + 1000, 2**31])
        if socket_name.startswith("frontend"):
            msg = {"kind": "outputs", "outputs": [{"uid": r.choice([self.uid, r.randint(1, 50)]), "start": r.randint(0, 5),
                                                   "token_ids": ids[:3], "finish_reason": None}]}
        elif socket_name.startswith("decode") and r.random() < 0.7:
            pages = [r.choice([r.randrange(self.pages), self.pages + r.randint(0, 100), -1])
                     for _ in range(r.randint(1, 4))]
            msg = {"kind": "handoff", "rid": f"fuzz-{self.uid}", "uid": self.uid, "prompt_ids": ids,
                   "output_ids": ids[:1], "page_table": pages, "params": self._params(), "arrival": now,
                   "first_token_time": now}
        elif r.random() < 0.3:
            msg = {"kind": "abort", "uid": r.choice([self.uid, r.randint(1, 50)])}
        else:
            msg = {"kind": "generate", "rid": f"fuzz-{self.uid}", "uid": self.uid, "input_ids": ids,
                   "params": self._params(), "arrival": now}
        return json.dumps(msg).encode()

    def malformed_json(self) -> bytes:
        r = self.rng
        choices = [b"{}", b"[]", b"null", b"1", b'"x"', b'{"kind": "generate"}', b'{"kind": "nope", "uid": 1}',
                   b'{"kind": "abort", "uid": "x"}', b'{"kind": "abort", "uid": 1' + b"0" * 400 + b"}",
                   b'{"kind": "abort", "uid": 1, "extra": true}', b'{"kind": "abort", "uid": NaN}',
                   b'{"kind": "generate", "rid": "\\ud800", "uid": 5, "input_ids": [1], "params": {}, "arrival": 0}',
                   b'{"kind": "generate", "rid": "r", "uid": 5, "input_ids": [1], '
                   b'"params": {"top_k": 18446744073709551616}, "arrival": 0}',
                   b'{"kind": "generate", "rid": "r", "uid": -5, "input_ids": [1], "params": {}, "arrival": 1e999}',
                   b'{"kind": "outputs", "outputs": [{"uid": 1, "start": -1}]}',
                   b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
                   b'{"kind": "abort", "uid": 1}' * 3, b'\xff\xfe{"kind": "abort"}']
        return r.choice(choices)

    def pickled(self) -> bytes:
        r = self.rng
        obj = r.choice([Canary(self.canary), {"kind": "abort", "uid": 1}, ["generate", 1, [1, 2, 3]],
                        Canary(self.canary), (1, 2.0, "three", b"four", None)])
        return pickle.dumps(obj, protocol=r.randint(0, pickle.HIGHEST_PROTOCOL))

    def garbage(self) -> bytes:
        r = self.rng
        size = r.choice([0, 1, 7, 64, 1024, 65536])
        if r.random() < 0.5:
            return r.randbytes(size)
        return "".join(r.choice("{}[]\":,abc123 \\\u00e9\u4e2d") for _ in range(size)).encode("utf-8", "surrogatepass")

    MIX = [("bogus", 0.3), ("malformed_json", 0.25), ("pickled", 0.15), ("garbage", 0.25), ("multipart", 0.05)]

    def next(self, socket_name: str) -> tuple[str, list[bytes]]:
        names, weights = zip(*self.MIX)
        kind = self.rng.choices(names, weights)[0]
        if kind == "multipart":
            return kind, [self.garbage() or b"x", self.malformed_json(), self.bogus(socket_name)]
        if kind == "bogus":
            return kind, [self.bogus(socket_name)]
        return kind, [getattr(self, kind)()]


def sockets_of(info: dict | None) -> dict[str, str]:
    """{socket file name: ipc endpoint} of the server's current incarnation (files of workers that
    have been restarted may still be in the directory: nobody listens on them)."""
    directory = (info or {}).get("runtime_dir")
    if not directory:
        return {}
    incarnation = info.get("incarnation")
    paths = sorted(Path(directory).glob("*.sock"))
    current = [p for p in paths if incarnation is None or p.stem.endswith(f"-{incarnation}") or "-" not in p.stem]
    return {p.name: f"ipc://{p}" for p in current}


def push(ctx: zmq.Context, endpoint: str, frames: list[bytes], timeout_ms: int = 2000) -> bool:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: a dead endpoint is "undeliverable"
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        return True
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=1000)  # let a sent message leave before the socket goes (0 would drop it)


async def fuzz_sockets(url: str, count: int, seed: int, vocab_size: int, batch: int = 100,
                       oversized_mb: float = 65.0, progress=None) -> ZmqStats:
    stats = ZmqStats()
    rng = random.Random(seed)
    canary = Path(f"/tmp/bullet-fuzz-canary-{os.getpid()}-{rng.randrange(10**9)}")
    stats.canary_path = str(canary)
    recent: deque = deque(maxlen=30)
    t0 = time.monotonic()
    ctx = zmq.Context()
    try:
        async with aiohttp.ClientSession() as session:
            info = await server_info(session, url)
            if not sockets_of(info):
                stats.findings.add("no sockets found", f"/server_info runtime_dir: {(info or {}).get('runtime_dir')}")
                return stats
            restarts = info.get("worker_restarts", 0)
            payloads = Payloads(rng, str(canary), vocab_size, info.get("kv_pages_total") or 1024)
            oversize = bytes(int(oversized_mb * 2**20)) if oversized_mb > 0 else b""
            sent = 0
            while sent < count:
                targets = sockets_of(info)
                for _ in range(min(batch, count - sent)):
                    name = rng.choice(list(targets))
                    kind, frames = payloads.next(name)
                    if oversize and stats.categories["oversized"] < len(targets) and rng.random() < 0.01:
                        kind, frames = "oversized", [oversize]
                    ok = await asyncio.to_thread(push, ctx, targets[name], frames)
                    role = name.split("-")[0].removesuffix(".sock")
                    (stats.sent if ok else stats.undeliverable)[role] += 1
                    stats.categories[kind] += 1
                    recent.append(f"{name}: {kind} {frames[0][:60]!r}")
                    sent += 1
                    if not ok:  # its worker is gone (restarting): wait for the next incarnation's sockets
                        await wait_alive(session, url, RECOVERY_S)
                        info = await server_info(session, url) or info
                        targets = sockets_of(info) or targets
                await asyncio.sleep(0.2)  # let the receivers drain before asking whether they are alive
                probe = await liveness(session, url)
                probe["after_message"] = sent
                stats.probes.append(probe)
                info = await server_info(session, url) or info
                if info.get("worker_restarts", 0) != restarts:
                    restarts = info.get("worker_restarts", 0)
                    stats.restarts.append({"after_message": sent, "restarts": restarts,
                                           "failures": info.get("failures", [])[-3:], "recent": list(recent)[-10:]})
                    stats.findings.add("worker restarted", f"after message {sent}: {info.get('failures', [])[-1:]}")
                if not probe["alive"]:
                    stats.findings.add("liveness probe failed", f"after message {sent}: {probe}; recent {list(recent)[-5:]}")
                    # the next batch should meet a working server again (a restart re-creates the sockets)
                    probe["recovered_after_s"] = await wait_alive(session, url, RECOVERY_S)
                    if probe["recovered_after_s"] is None:
                        stats.stopped_early = f"the server did not recover within {RECOVERY_S:g} s (after message {sent})"
                        break
                    info = await server_info(session, url) or info
                if progress:
                    progress(sent, count, stats)
    finally:
        ctx.term()
        stats.code_executed = canary.exists()
        if stats.code_executed:
            stats.findings.add("CODE EXECUTED from a socket message", f"{canary} was created by an unpickled message")
            canary.rmdir()
        stats.wall_s = time.monotonic() - t0
    return stats
