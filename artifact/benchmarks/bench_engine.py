"""Engine throughput next to `transformers` on the same model, dtype and thread count.

  python artifact/benchmarks/bench_engine.py [--dtype float32 bfloat16] [--threads N] [--rounds R]

Prefill tokens/s for one prompt of 128 and 512 tokens; decode tokens/s at batch 1, 8 and 32 with
128-token prompts — ours through the whole engine (scheduler, runner, sampler), transformers as
greedy `model(token, past_key_values=...)` steps, as `generate` runs them. Both models are loaded
first and measured in alternating rounds, so load from elsewhere on this noisy machine hits both
alike; medians are reported. Writes artifact/results/engine.json and prints a table."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import bullet
from artifact.benchmarks.common import print_table, write_results
from engines.device import DTYPES
from engines.runner import SeqChunk
from engines.sampling_params import SamplingParams
from engines.weights.resolve import default_gguf_path

PROMPT_LEN = 128
PREFILL_LENS = (128, 512)
BATCHES = (1, 8, 32)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(200, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Ours:
    def __init__(self, dtype: str, steps: int):
        self.steps = steps
        self.llm = bullet.LLM(dtype=dtype, max_total_tokens=max(BATCHES) * (PROMPT_LEN + 4 * steps + 8) + 1024)

    def prefill(self, n: int) -> float:
        ids, pages = _ids(n, n), list(range(-(-n // self.llm.runner.page_size)))
        t = time.perf_counter()
        self.llm.runner.forward([SeqChunk(ids, 0, pages)])
        return n / (time.perf_counter() - t)

    def decode(self, b: int) -> float:
        eng = self.llm.engine
        params = SamplingParams(temperature=0, max_new_tokens=self.steps + 2, ignore_eos=True)
        for i in range(b):
            eng.add_request(_ids(PROMPT_LEN, i), params)
        eng.step()  # prefill
        eng.step()  # first decode step (warm-up)
        times = []
        while eng.has_work():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        return b / statistics.median(times)


class Reference:
    def __init__(self, dtype: str, steps: int):
        from transformers import AutoModelForCausalLM

        path = default_gguf_path()
        self.steps = steps
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=DTYPES[dtype]).eval()

    @torch.inference_mode()
    def prefill(self, n: int) -> float:
        ids = torch.tensor([_ids(n, n)])
        t = time.perf_counter()
        self.model(ids)
        return n / (time.perf_counter() - t)

    @torch.inference_mode()
    def decode(self, b: int) -> float:
        out = self.model(torch.tensor([_ids(PROMPT_LEN, i) for i in range(b)]), use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for step in range(self.steps + 1):
            t = time.perf_counter()
            out = self.model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            if step:  # the first step warms up
                times.append(time.perf_counter() - t)
        return b / statistics.median(times)


def measure(dtype: str, rounds: int, steps: int) -> dict:
    systems = {"bullet": Ours(dtype, steps), "transformers": Reference(dtype, steps)}
    tasks = [(f"prefill_{n}", "prefill", n) for n in PREFILL_LENS] + [(f"decode_b{b}", "decode", b) for b in BATCHES]
    samples = {name: {key: [] for key, _, _ in tasks} for name in systems}
    for key, method, arg in tasks:
        for sys in systems.values():  # warm-up
            getattr(sys, method)(arg)
        for r in range(rounds):
            order = list(systems.items()) if r % 2 == 0 else list(systems.items())[::-1]
            for name, sys in order:
                samples[name][key].append(getattr(sys, method)(arg))
        print(f"[bench] {dtype} {key}: " + ", ".join(
            f"{n} {statistics.median(samples[n][key]):.1f} tok/s" for n in systems), flush=True)
    return {name: {k: statistics.median(v) for k, v in s.items()} | {"samples": s} for name, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: all cores)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=12)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, raw = [], {}
    for dtype in args.dtype:
        res = measure(dtype, args.rounds, args.decode_steps)
        a, b = res["bullet"], res["transformers"]
        raw[dtype] = res
        for key in [k for k in a if k != "samples"]:
            rows.append({"dtype": dtype, "metric": key + " tok/s", "bullet": a[key], "transformers": b[key],
                         "ratio": a[key] / b[key]})
        raw[dtype]["bullet_b32_over_b1"] = a["decode_b32"] / a["decode_b1"]
        rows.append({"dtype": dtype, "metric": "decode b32 / b1", "bullet": a["decode_b32"] / a["decode_b1"],
                     "transformers": b["decode_b32"] / b["decode_b1"], "ratio": ""})
    path = write_results("engine", {"threads": torch.get_num_threads(), "prompt_len": PROMPT_LEN, "results": raw})
    print_table(rows, ["dtype", "metric", "bullet", "transformers", "ratio"],
                title=f"engine vs transformers, {torch.get_num_threads()} threads ({path})")


if __name__ == "__main__":
    main()
