"""Open-loop load on a server's streamed `/generate`, with token ids (no tokenizer on either side).

  python -m artifact.loadgen --url http://127.0.0.1:30000 --rate 8 --num 64 --vocab 128000 \
      [--prompt-tokens 128 2048] [--output-tokens 128] [--seed 1] [--deadline 60] [--output FILE]

Requests arrive as a Poisson process (exponential gaps at `rate`), whatever the server's pace; each
prompt is random token ids of a length drawn uniformly from `--prompt-tokens`, asks for exactly
`--output-tokens` (ignore_eos, greedy). The prompts and arrival times follow from the seed alone, so
every system of a comparison gets the same ones. Per request it records the prompt length, the tokens
received, when it was sent (offset from the first), TTFT, the gaps between tokens (a gap spanning k
tokens counts as k gaps of 1/k each, as `sglang.bench_serving` counts them), and whether it finished.

A request finishes when its stream ends with `[DONE]` after all the tokens it asked for; an error
event, an HTTP error, a stream cut short or one that ends with no token at all is a failure with its
reason. At `--deadline` seconds after the first send, what is still running is cancelled and counted
as failed: a saturated server cannot stretch a point past its budget.

The output file has `sglang.bench_serving --output-details`'s shape (one JSON line: its summary keys,
then input_lens, output_lens, ttfts, itls, generated_texts, errors), so `artifact.bench_client.
read_bench_file` reads it; `arrivals` is added."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from artifact.bench_client import RequestRecord
from artifact.scoring import attainment
from bullet.types.slo import SLO


@dataclass
class Record:
    input_len: int
    arrival_s: float
    output_len: int = 0
    ttft: float = 0.0  # 0.0 when no token came (bench_serving's convention)
    itl: list[float] = field(default_factory=list)
    ok: bool = False
    error: str = ""
    sent_s: float | None = None  # when it was really sent, from the point's start (None: never sent)

    @property
    def tpot(self) -> float | None:
        return sum(self.itl) / len(self.itl) if self.itl else None


def workload(num: int, rate: float, seed: int, vocab: int, prompt_tokens: tuple[int, int]) -> tuple[list[list[int]], list[float]]:
    """`num` random token-id prompts and their Poisson arrival offsets (the first at 0), from `seed`
    alone. Drawn request by request, so a shorter run's requests are the first of a longer one's."""
    if rate <= 0 or num <= 0:
        raise ValueError("a point needs a positive rate and at least one request")
    lo, hi = prompt_tokens
    if not 1 <= lo <= hi or vocab <= 101:
        raise ValueError(f"bad prompt lengths {prompt_tokens} or vocabulary {vocab}")
    rng = random.Random(seed)
    prompts, arrivals, t = [], [], 0.0
    for _ in range(num):
        prompts.append([rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))])
        arrivals.append(t)
        t += rng.expovariate(rate)
    return prompts, arrivals


def _body(ids: list[int], output_tokens: int) -> dict:
    return {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_tokens, "temperature": 0.0, "ignore_eos": True}}


async def _request(session, url: str, ids: list[int], output_tokens: int, rec: Record) -> None:
    sent = last = time.perf_counter()
    done = False
    try:
        async with session.post(url + "/generate", json=_body(ids, output_tokens)) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error = f"error event: {json.dumps(event['error'])[:200]}"
                    return
                count = int(event.get("meta_info", {}).get("completion_tokens", rec.output_len))
                if count <= rec.output_len:
                    continue
                now = time.perf_counter()
                if rec.output_len == 0:
                    rec.ttft = now - sent
                else:
                    gap = (now - last) / (count - rec.output_len)
                    rec.itl.extend([gap] * (count - rec.output_len))
                last, rec.output_len = now, count
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 — any transport failure is this request's failure, recorded
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    if not done:
        rec.error = "stream ended without [DONE]"
    elif rec.output_len == 0:
        rec.error = "stream ended with [DONE] but no token"
    elif rec.output_len < output_tokens:
        rec.error = f"{rec.output_len} of {output_tokens} tokens"
    else:
        rec.ok = True


async def run_point(url: str, prompts: list[list[int]], arrivals: list[float], output_tokens: int,
                    deadline_s: float, stop_early=None) -> tuple[list[Record], float]:
    """Send every prompt at its arrival offset; returns the records and the point's duration (first
    send to last finish, or to the deadline when requests were still running). `stop_early(records,
    seconds)`, asked about 4 times a second, may end the point before its deadline (what is still
    running is cancelled and counted as failed, as at the deadline)."""
    import aiohttp  # deferred: the load generator alone needs it

    records = [Record(len(ids), at) for ids, at in zip(prompts, arrivals)]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def launch(ids, rec):
            await asyncio.sleep(max(0.0, t0 + rec.arrival_s - time.perf_counter()))
            rec.sent_s = time.perf_counter() - t0
            await _request(session, url, ids, output_tokens, rec)

        tasks = [asyncio.create_task(launch(ids, rec)) for ids, rec in zip(prompts, records)]
        pending, early = set(tasks), False
        while pending:
            left = t0 + deadline_s - time.perf_counter()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(left, 0.25) if stop_early else left)
            if pending and stop_early is not None and stop_early(records, time.perf_counter() - t0):
                early = True
                break
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    why = (f"unfinished when the point stopped early ({duration:.0f} s)" if early
           else f"unfinished at the point's deadline ({deadline_s:.0f} s)")
    for rec in records:
        if not rec.ok and not rec.error:
            rec.error = why
    return records, duration


async def warmup(url: str, vocab: int, timeout_s: float = 60.0) -> Record:
    """One short request: does this server answer token ids with tokens?"""
    prompts, arrivals = workload(1, 1.0, 0, vocab, (16, 16))
    records, _ = await run_point(url, prompts, arrivals, 4, timeout_s)
    return records[0]


def _pct(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def summary(records: list[Record], duration: float, slo: SLO) -> dict:
    """What one point measured: throughput, TTFT/TPOT percentiles, the P99 gap between tokens, SLO
    attainment (a failed request misses)."""
    done = [r for r in records if r.ok]
    tpots = [r.tpot for r in done if r.tpot is not None]
    bench = [RequestRecord(r.input_len, r.output_len, r.ttft, r.tpot, r.ok) for r in records]
    errors = sorted({r.error for r in records if r.error})
    return {"requests": len(records), "completed": len(done), "duration_s": duration,
            "req_per_s": len(done) / duration if duration > 0 else 0.0,
            "output_tok_per_s": sum(r.output_len for r in done) / duration if duration > 0 else 0.0,
            "ttft_p50_s": _pct([r.ttft for r in done], 50), "ttft_p90_s": _pct([r.ttft for r in done], 90),
            "tpot_p50_s": _pct(tpots, 50), "tpot_p90_s": _pct(tpots, 90),
            "itl_p99_s": _pct([g for r in done for g in r.itl], 99),
            "attainment": attainment(bench, slo), "slo": slo.describe(), "errors": errors[:5]}


def bench_details(records: list[Record], duration: float, rate: float, label: str) -> dict:
    """The point in `sglang.bench_serving --output-details`'s JSON shape (its summary keys, in ms)."""
    done = [r for r in records if r.ok]
    ttfts = [r.ttft for r in done] or [0.0]
    gaps = [g for r in done for g in r.itl] or [0.0]
    tpots = [r.tpot for r in done if r.tpot is not None] or [0.0]
    e2e = [r.ttft + sum(r.itl) for r in done] or [0.0]
    out_tokens = sum(r.output_len for r in done)
    ms = 1e3
    return {
        "backend": label, "dataset_name": "random-ids", "request_rate": rate, "max_concurrency": None,
        "duration": duration, "completed": len(done), "total_input_tokens": sum(r.input_len for r in done),
        "total_output_tokens": out_tokens, "request_throughput": len(done) / duration if duration else 0.0,
        "input_throughput": sum(r.input_len for r in done) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "mean_e2e_latency_ms": float(np.mean(e2e)) * ms, "median_e2e_latency_ms": float(np.median(e2e)) * ms,
        "mean_ttft_ms": float(np.mean(ttfts)) * ms, "median_ttft_ms": float(np.median(ttfts)) * ms,
        "p99_ttft_ms": float(np.percentile(ttfts, 99)) * ms,
        "mean_tpot_ms": float(np.mean(tpots)) * ms, "median_tpot_ms": float(np.median(tpots)) * ms,
        "p99_tpot_ms": float(np.percentile(tpots, 99)) * ms,
        "mean_itl_ms": float(np.mean(gaps)) * ms, "median_itl_ms": float(np.median(gaps)) * ms,
        "p95_itl_ms": float(np.percentile(gaps, 95)) * ms, "p99_itl_ms": float(np.percentile(gaps, 99)) * ms,
        "max_itl_ms": float(np.max(gaps)) * ms,
        "input_lens": [r.input_len for r in records], "output_lens": [r.output_len if r.ok else 0 for r in records],
        "ttfts": [r.ttft for r in records], "itls": [r.itl for r in records],
        "generated_texts": ["" for _ in records], "errors": [r.error for r in records],
        "arrivals": [r.arrival_s for r in records],
    }


def write_bench_file(path: Path, details: dict) -> None:
    """Append the point as one line, as bench_serving appends to its --output-file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(details) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--rate", type=float, required=True, help="requests per second (Poisson arrivals)")
    ap.add_argument("--num", type=int, required=True, help="requests")
    ap.add_argument("--vocab", type=int, required=True, help="token ids are drawn from [100, vocab)")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(128, 2048), metavar=("MIN", "MAX"))
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds after the first send to stop waiting")
    ap.add_argument("--ttft-slo", default="3ms/token")
    ap.add_argument("--tpot-slo", default="50ms")
    ap.add_argument("--label", default="bullet")
    ap.add_argument("--output", type=Path, default=None, help="append the bench_serving-shaped details here")
    args = ap.parse_args(argv)
    prompts, arrivals = workload(args.num, args.rate, args.seed, args.vocab, tuple(args.prompt_tokens))
    records, duration = asyncio.run(run_point(args.url.rstrip("/"), prompts, arrivals, args.output_tokens, args.deadline))
    if args.output:
        write_bench_file(args.output, bench_details(records, duration, args.rate, args.label))
    print(json.dumps(summary(records, duration, SLO.parse(args.ttft_slo, args.tpot_slo))))
    return 0 if any(r.ok for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
