"""What the driver observes of the server between its phases: /server_info (workers, restarts, KV
pages, the runtime directory of its local sockets), the memory of every server process, whether it
still answers a real request, and — after it stops — what it left behind in /dev/shm and /tmp."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp

PROBE_BODY = {"text": "Say hi.", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def read_kib(pid: int, path: str, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (the launcher's workers and anything they started)."""
    by_parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        by_parent.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def memory(root_pid: int | None, worker_pids: dict[str, int]) -> dict:
    """RSS and PSS (MiB) of the launcher, each worker and any other descendant. PSS divides shared
    pages (the weights, the KV pool) among the processes mapping them, so the sum is honest."""
    pids = {}
    if root_pid:
        pids["launcher"] = root_pid
        for child in children(root_pid):
            pids.setdefault(next((r for r, p in worker_pids.items() if p == child), f"child-{child}"), child)
    for role, pid in worker_pids.items():
        pids.setdefault(role, pid)
    out = {}
    for name, pid in pids.items():
        rss = read_kib(pid, "status", "VmRSS")
        if rss is None:
            continue
        pss = read_kib(pid, "smaps_rollup", "Pss")
        out[name] = {"pid": pid, "rss_mib": round(rss / 1024, 1), "pss_mib": round(pss / 1024, 1) if pss else None,
                     "cmd": process_name(pid)}
    return out


async def server_info(session: aiohttp.ClientSession, url: str, timeout: float = 15.0) -> dict | None:
    try:
        async with session.get(url + "/server_info", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return None
            return (await resp.json())["internal_states"][0]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError):
        return None


async def liveness(session: aiohttp.ClientSession, url: str, timeout: float = 60.0) -> dict:
    """/health and one real generation: a server whose receive loop died can still say 200 on
    /health while every generation hangs, so both are asked."""
    out = {"health": None, "generate": None, "generate_s": None, "error": None}
    t0 = time.monotonic()
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=15)) as resp:
            out["health"] = resp.status
        async with session.post(url + "/generate", json=PROBE_BODY, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            out["generate"] = resp.status
            await resp.read()
    except asyncio.TimeoutError:
        out["error"] = f"no answer within {timeout:g} s"
    except aiohttp.ClientConnectorError as exc:  # nothing listens: the frontend itself is gone
        out["error"], out["refused"] = f"{type(exc).__name__}: {exc}", True
    except aiohttp.ClientError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["generate_s"] = round(time.monotonic() - t0, 2)
    out["alive"] = out["health"] == 200 and out["generate"] == 200
    return out


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout: float) -> dict | None:
    """/server_info once no request is in flight (or at the deadline)."""
    deadline = time.monotonic() + timeout
    info = await server_info(session, url)
    while info and info.get("inflight_requests") and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        info = await server_info(session, url)
    return info


async def wait_alive(session: aiohttp.ClientSession, url: str, timeout: float) -> float | None:
    """Seconds until the server passes a liveness probe (after a worker restart, say); None if it
    never does within `timeout`, or at once when nothing listens on its port any more (workers
    restart behind a frontend that stays up; a refused connection means the server has stopped)."""
    t0 = time.monotonic()
    refused = 0
    while time.monotonic() - t0 < timeout:
        probe = await liveness(session, url, timeout=min(60.0, timeout))
        if probe["alive"]:
            return round(time.monotonic() - t0, 1)
        refused = refused + 1 if probe.get("refused") else 0
        if refused >= 2:
            return None
        await asyncio.sleep(2.0)
    return None


def pool_summary(info: dict | None) -> dict:
    if not info:
        return {"kv_pages_free": None, "kv_pages_total": None, "inflight_requests": None}
    return {k: info.get(k) for k in ("kv_pages_free", "kv_pages_evictable", "kv_pages_total", "inflight_requests",
                                     "worker_restarts",
                                     "incarnation", "status")} | {"worker_pids": info.get("worker_pids"),
                                                                  "failures": info.get("failures", [])[-5:]}


def leftovers(instance_id: str | None, runtime_dir: str | None, pids: list[int]) -> dict:
    """After the server stopped: its shared-memory segments, its socket directory, its processes."""
    shm = []
    if instance_id:
        prefix = f"bullet-{instance_id}-"
        try:
            shm = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix) or n.startswith("sem." + prefix))
        except OSError:
            pass
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
    return {"shm_segments": shm, "runtime_dir_left": bool(runtime_dir and Path(runtime_dir).exists()),
            "processes_left": alive}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
