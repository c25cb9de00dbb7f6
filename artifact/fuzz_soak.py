"""Fuzz, then soak, a Bullet server; report what broke (not timed in CI: the tests run a tiny count).

  python -m artifact.fuzz_soak [--requests 10000] [--zmq-messages 3000] [--soak-minutes 10]
                               [--soak-rate 0.5] [--url URL] [--out DIR] [-- <bullet launch flags>]

Phases: (1) >= 10,000 generated HTTP requests, good and bad, to every endpoint (artifact/fuzz/
http_cases.py), a liveness probe every 500; (2) raw messages — garbage, pickles with a canary, JSON
of the wrong shape, bogus well-formed messages — to each of the server's local sockets
(artifact/fuzz/zmq_fuzz.py); (3) a soak of good requests at a rate the server can carry. Reported:
sent/completed/failed, 4xx/5xx, lost requests, worker restarts, RSS and PSS of every server process at
the start, before the soak and at the end, KV pages free at the end, and — for a server this driver
started (default: `bullet launch --policy bullet`, or the flags after `--`) — what it left in /dev/shm
and /tmp after SIGTERM. Writes <out>/results.json and results.md; never raises on what it finds. Exit code: 0 when the verdict is clean, 1 when it is not, 2 when the
driver could not run (e.g. the server did not start)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import sys
import time
from pathlib import Path

import aiohttp

from artifact.fuzz.http_cases import CaseGenerator
from artifact.fuzz.http_driver import fuzz_http
from artifact.fuzz.probes import leftovers, liveness, memory, pool_summary, server_info, wait_alive, wait_idle
from artifact.fuzz.report import markdown, verdict
from artifact.fuzz.soak import soak
from artifact.fuzz.zmq_fuzz import fuzz_sockets
from artifact.server import BulletServer

DEFAULT_LAUNCH = ["--policy", "bullet", "--log-level", "warning"]
LEFTOVER_GRACE_S = 5.0  # how long a stopped server's processes, segments and sockets may take to go
RESULTS = Path(__file__).resolve().parent / "results" / "fuzz_soak"


def parse(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    launch = DEFAULT_LAUNCH
    if "--" in argv:
        launch, argv = argv[argv.index("--") + 1:], argv[: argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="fuzz a running server instead of starting one")
    ap.add_argument("--requests", type=int, default=10_000, help="HTTP fuzz cases")
    ap.add_argument("--zmq-messages", type=int, default=3_000, help="raw messages to the local sockets (0: none)")
    ap.add_argument("--zmq-oversized-mb", type=float, default=65.0, help="one message over the 64 MiB limit per socket (0: none)")
    ap.add_argument("--soak-minutes", type=float, default=10.0)
    ap.add_argument("--soak-rate", type=float, default=0.5, help="req/s of the soak: a load the server can carry")
    ap.add_argument("--soak-max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8, help="HTTP fuzz requests in flight")
    ap.add_argument("--probe-every", type=int, default=500)
    ap.add_argument("--max-body-mb", type=float, default=16.0, help="largest oversized body the fuzz sends")
    ap.add_argument("--vocab-size", type=int, default=49152, help="the served model's vocabulary (SmolLM2: 49152)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="results directory name (default: the UTC time)")
    ap.add_argument("--out", type=Path, default=None, help=f"default: {RESULTS.relative_to(RESULTS.parents[2])}/<name>")
    args = ap.parse_args(argv)
    args.launch = launch
    args.name = args.name or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    args.out = args.out or RESULTS / args.name
    return args


def say(text: str) -> None:
    print(f"[fuzz-soak] {text}", flush=True)


async def snapshot(session, url: str, root_pid: int | None) -> dict:
    info = await server_info(session, url)
    return {"pool": pool_summary(info), "memory": memory(root_pid, (info or {}).get("worker_pids") or {}),
            "t_utc": time.strftime("%H:%M:%S", time.gmtime())}


async def phases(args, url: str, root_pid: int | None, result: dict, save, dead) -> None:
    """The three phases in turn; a server that has stopped (`dead()`) ends the run with what was found."""
    async with aiohttp.ClientSession() as session:
        result["start"] = await snapshot(session, url, root_pid)
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        result["model"] = model
    save()
    if args.requests:
        say(f"HTTP fuzz: {args.requests} requests, {args.concurrency} at a time")
        gen = CaseGenerator(random.Random(args.seed), model, args.vocab_size, args.max_body_mb)
        http = await fuzz_http(url, gen, args.requests, args.concurrency, args.probe_every,
                               progress=lambda i, n, s: say(f"  {i}/{n} sent; statuses {dict(sorted(s.statuses.items()))}; "
                                                            f"failures {dict(s.findings.counts)}"))
        result["http"] = http.as_dict()
        save()
    if dead():
        return
    if args.zmq_messages:
        async with aiohttp.ClientSession() as session:  # each phase meets a working server
            result["before_zmq_alive_after_s"] = await wait_alive(session, url, 300)
        say(f"local sockets: {args.zmq_messages} raw messages")
        z = await fuzz_sockets(url, args.zmq_messages, args.seed, args.vocab_size, oversized_mb=args.zmq_oversized_mb,
                               progress=lambda i, n, s: say(f"  {i}/{n} messages; failures {dict(s.findings.counts)}")
                               if i % 500 == 0 or i == n else None)
        result["zmq"] = z.as_dict()
        save()
    if dead():
        return
    async with aiohttp.ClientSession() as session:
        info = await wait_idle(session, url, 120)
        result["after_fuzz"] = {"pool": pool_summary(info), "liveness": await liveness(session, url)}
        # the soak measures a steady server: if the fuzz left it restarting (already reported), wait
        result["after_fuzz"]["alive_after_s"] = await wait_alive(session, url, 300)
        result["soak_start"] = await snapshot(session, url, root_pid)
    save()
    if dead():
        return
    if args.soak_minutes > 0:
        say(f"soak: {args.soak_minutes:g} minutes at {args.soak_rate:g} req/s")
        s = await soak(url, model, args.soak_minutes, args.soak_rate, args.seed, args.soak_max_tokens,
                       progress=lambda st, t, open_: say(f"  {t / 60:.0f} min: sent {st.sent}, completed {st.completed}, "
                                                         f"failed {st.failed}, lost {st.lost}, in flight {open_}"))
        result["soak"] = s.as_dict()
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, url, 300)
        result["end"] = await snapshot(session, url, root_pid)
        result["end"]["liveness"] = await liveness(session, url)


def settled_leftovers(instance_id: str | None, runtime_dir: str | None, pids: list[int],
                      grace_s: float = LEFTOVER_GRACE_S) -> dict:
    """`leftovers` once nothing is left, or as they stand after `grace_s`: a worker told to stop may
    take a moment longer than its launcher (a fixed 1 s pause was both the usual cost and, on a slow
    machine, short of that moment)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = leftovers(instance_id, runtime_dir, pids)
        if not (found["shm_segments"] or found["runtime_dir_left"] or found["processes_left"]) \
                or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # stopped with SIGTERM: still stop the server and write the report
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m artifact.fuzz_soak " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    result = {"name": args.name, "command": command, "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"}
    t0 = time.monotonic()

    def save() -> None:
        result["wall_s"] = time.monotonic() - t0
        result["verdict"] = verdict(result)
        (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        (args.out / "results.md").write_text(markdown(result))

    server = None
    try:
        if args.url:
            url, root_pid = args.url.rstrip("/"), None
        else:
            result["server"] = "bullet launch " + " ".join(args.launch)
            say(f"starting {result['server']}")
            server = BulletServer(*args.launch, log_path=str(args.out / "server.log")).start()
            url, root_pid = server.url, server.proc.pid
        dead = (lambda: server.proc.poll() is not None) if server else (lambda: False)
        asyncio.run(phases(args, url, root_pid, result, save, dead))
    except KeyboardInterrupt:
        result["interrupted"] = True
    except Exception as exc:  # a dead server or a broken phase is a finding, written down with the rest
        result["server_died" if server and server.proc.poll() is not None else "error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if server is not None:
            info = server.info or {}
            pids = [server.proc.pid, *((result.get("end") or result.get("start") or {}).get("pool", {})
                                       .get("worker_pids") or {}).values()]
            if server.proc.poll() is not None:
                result["server_died"] = result.get("server_died") or f"exited with {server.proc.returncode}"
            result["exit_code"] = server.terminate()
            result["after_stop"] = settled_leftovers(info.get("instance_id"), info.get("runtime_dir"), pids)
            result["server_log_tail"] = server.tail(30)
        save()
    say(f"verdict: {json.dumps(result['verdict'])}")
    say(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    if result.get("error") or "start" not in result:
        return 2
    return 0 if clean(result["verdict"]) else 1


def clean(v: dict) -> bool:
    """Every count zero and every flag false (a value the run could not measure does not count)."""
    return not any(x for x in v.values() if x is not None)


if __name__ == "__main__":
    sys.exit(main())
