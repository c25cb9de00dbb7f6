"""Drive a server with `sglang.bench_serving` (the real client, as a subprocess) and read back
per-request TTFT, inter-token latencies and lengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bullet.sim.metrics import percentile


def point_seed(seed: int, rate_index: int, repeat: int) -> int:
    """bench_serving's seed for one point of a sweep: every rate and repeat samples other prompts (a
    server's prefix cache, ours or llama-server's, would otherwise answer a later rate's prompts from
    an earlier rate's KV), and every system gets the same ones at the same point."""
    return seed + 1000 * rate_index + repeat


@dataclass
class RequestRecord:
    input_len: int
    output_len: int
    ttft: float
    tpot: float | None  # mean inter-token latency; None with a single output token
    ok: bool
    token_gaps: tuple[float, ...] = ()  # every inter-token latency (bench_serving's `itls`)

    @property
    def tbt_p99(self) -> float | None:
        """P99 of this request's gaps between tokens (None with fewer than two tokens)."""
        return percentile(self.token_gaps, 99) if self.token_gaps else None


def run_bench_serving(url: str, tokenizer_dir: str, dataset: Path | None, rate: float, num_prompts: int,
                      out_file: Path, context_len: int, output_len: int | None, seed: int = 1, backend: str = "sglang",
                      timeout: float = 3600, dataset_args: list[str] | None = None,
                      warmup: int = 1) -> tuple[dict, list[RequestRecord]]:
    """One `bench_serving` run: ShareGPT from `dataset` (prompts within `context_len`), or whatever
    `dataset_args` select (e.g. `--dataset-name generated-shared-prefix --gsp-...`)."""
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", url,
           "--tokenizer", tokenizer_dir, "--num-prompts", str(num_prompts), "--request-rate", str(rate),
           "--seed", str(seed), "--output-file", str(out_file), "--output-details", "--disable-tqdm",
           "--warmup-requests", str(warmup)]
    if dataset_args is not None:
        cmd += dataset_args
    else:
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-context-len", str(context_len)]
        if output_len:
            cmd += ["--sharegpt-output-len", str(output_len)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"bench_serving failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_bench_file(out_file)


def read_bench_file(path: Path) -> tuple[dict, list[RequestRecord]]:
    """The last result `bench_serving --output-details` wrote to `path`, and a record per request."""
    result = json.loads(path.read_text().splitlines()[-1])
    records = [RequestRecord(i, o, t, sum(itl) / len(itl) if itl else None, not err and t > 0, tuple(itl))
               for i, o, t, itl, err in zip(result["input_lens"], result["output_lens"], result["ttfts"],
                                            result["itls"], result["errors"])]
    return result, records
