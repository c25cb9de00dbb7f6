"""The int8 model's attention on the CPU: prompts through the C kernel against SDPA, and its decode rows
against another build of the kernel.

  python -m artifact.benchmarks.bench_cpu_attention [--threads 1 2] [--prompts 128 512 2048]
                                                    [--batches 1 8 32] [--rounds 5] [--against PATH]

The model is the embedded SmolLM2 as `--dtype auto` serves it on a CPU (int8 W8A8, float32 attention
over a float32 pool), through the engine's runner (`ModelRunner.forward`, a worker's step). Sides, timed
in the same rounds (alternating; medians):

* `kernel` — this tree: every row of a prompt attends in the C kernel (`engines.model.cpu_attention`,
  `attends_prompts`), each as a decode row at its place;
* `sdpa` — this tree with prompts through torch's SDPA instead (`attends_prompts = False`), as the
  engine did before: SDPA's blocks follow the prompt's length;
* `against` (with `--against PATH`) — another build of the C kernel (a source tree built with
  `python setup.py build_ext --inplace`, e.g. a `git worktree` of an older commit, or its
  engines/_cpu_attention*.so), prompts through SDPA as such a build's engine sent them.

Steps: prefill of one fresh prompt of each `--prompts` length; one decode step at each `--batches` size
over contexts spread evenly from 0.25x to 1.75x of `--context` tokens (KV pages shuffled). On one thread
the clock is the thread's CPU time; on several, wall time.

Beside the times, for each prompt and side, whether the prompt's logits are the same when it is
prefilled in two chunks (cut at half its length plus 3, off a page boundary, as a prefix cache hit or a
chunked prefill cuts it) and the largest difference of the logits if not: the int8 model rounds its
activations to 8 bits per token, so a different order of attention's sums can round one the other way
and the difference grows through the layers. Writes <results>/cpu_attention.json and .md (results dir:
BULLET_RESULTS_DIR or artifact/results)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from artifact.benchmarks.common import kernel_build, load_kernel_build
from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.runner import ModelRunner, SeqChunk
from engines.weights import load_weights

PAGE_SIZE = 16


class OlderAttention:
    """An older build of `engines._cpu_attention`, whose `decode` took no `every_row` argument (it
    attended decode rows only): the side that runs it sends prompts to SDPA, as its engine did."""

    def __init__(self, module):
        self.module = module

    def decode(self, *args):
        *rest, every_row = args
        if every_row:
            raise RuntimeError("this build of the attention kernel attends decode rows only")
        try:
            return self.module.decode(*args)
        except TypeError:  # no `every_row` parameter
            return self.module.decode(*rest)

    def __getattr__(self, name):
        return getattr(self.module, name)


class Bench:
    def __init__(self, args):
        w = load_weights(None, "auto", torch.float32, quantization="w8a8_int8")
        longest = max(args.prompts, default=1)
        pages = -(-max(args.batches, default=1) * (2 * args.context + 64) // PAGE_SIZE) + -(-longest // PAGE_SIZE) + 8
        self.runner = ModelRunner(build_model(w.config, w.state), KVPool(w.config, pages, PAGE_SIZE, torch.float32))
        if getattr(self.runner.kernels, "name", None) != "cpu":
            raise SystemExit("the int8 model does not page through the CPU attention kernel here (engines._cpu_attention "
                             "not built, or no vector code for this CPU)")
        self.perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).tolist()
        self.context = args.context

    def contexts(self, b: int) -> list[int]:
        return [self.context] if b == 1 else [int(self.context * (0.25 + 1.5 * i / (b - 1))) for i in range(b)]

    def decode_chunks(self, b: int) -> list[SeqChunk]:
        chunks, k = [], 0
        for i, n in enumerate(self.contexts(b)):
            pages = -(-(n + 1) // PAGE_SIZE)
            chunks.append(SeqChunk([100 + i], n, self.perm[k : k + pages]))
            k += pages
        return chunks

    def prompt(self, n: int) -> tuple[list[int], list[int]]:
        ids = torch.randint(200, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        pages = -(-n // PAGE_SIZE)
        return ids, self.perm[len(self.perm) - pages :]  # the pool's last pages: decode uses the first

    def run(self, step: str, arg: int) -> float:
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
        if step == "decode":
            chunks = self.decode_chunks(arg)
            self.runner.forward(chunks)  # the rows' contexts in the pool (their values do not matter)
        else:
            ids, table = self.prompt(arg)
            chunks = [SeqChunk(ids, 0, table)]
        t = clock()
        self.runner.forward(chunks)
        return clock() - t

    def cut_difference(self, n: int) -> float:
        """max |logits of the prompt prefilled whole - in two chunks|"""
        ids, table = self.prompt(n)
        whole = self.runner.forward([SeqChunk(ids, 0, table)]).last_logits[0]
        cut = n // 2 + 3
        self.runner.forward([SeqChunk(ids[:cut], 0, table, "none")])
        return float((self.runner.forward([SeqChunk(ids[cut:], cut, table)]).last_logits[0] - whole).abs().max())


@contextlib.contextmanager
def side(bench: Bench, name: str, older):
    kernels = bench.runner.kernels
    kernels.attends_prompts = name == "kernel"  # the instance's own: the class keeps the engine's default
    try:
        with kernel_build(OlderAttention(older), "cpu_attention") if name == "against" else contextlib.nullcontext():
            yield
    finally:
        del kernels.attends_prompts


def measure(bench: Bench, args, older) -> list[dict]:
    names = ["kernel", "sdpa"] + (["against"] if older is not None else [])
    steps = [("prefill", n) for n in args.prompts] + [("decode", b) for b in args.batches]
    rows = []
    for step, arg in steps:
        samples: dict[str, list[float]] = {n: [] for n in names}
        for name in names:
            with side(bench, name, older):
                bench.run(step, arg)  # warm-up
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                with side(bench, name, older):
                    samples[name].append(bench.run(step, arg))
        ms = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
        row = {"threads": torch.get_num_threads(), "step": f"{step}_{arg}", **{f"{n}_ms": v for n, v in ms.items()},
               "sdpa_over_kernel": ms["sdpa"] / ms["kernel"],
               "samples_ms": {n: [s * 1e3 for s in v] for n, v in samples.items()}}
        if older is not None:
            row["against_over_kernel"] = ms["against"] / ms["kernel"]
        if step == "prefill":
            for name in ("kernel", "sdpa"):
                with side(bench, name, older):
                    row[f"{name}_cut_difference"] = bench.cut_difference(arg)
        rows.append(row)
        print(f"[bench_cpu_attention] {row['threads']}t {row['step']}: "
              + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items())
              + (f"; logits cut vs whole: kernel {row['kernel_cut_difference']:.3g}, sdpa {row['sdpa_cut_difference']:.3g}"
                 if step == "prefill" else ""), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    against = rows and all("against_ms" in r for r in rows)
    head = "| threads | step | kernel ms | SDPA prompts ms | SDPA / kernel |"
    head += " other build ms | other / kernel |" if against else ""
    head += " logits, cut vs whole: kernel | SDPA |"
    lines = [head, "|---" * (7 + 2 * bool(against)) + "|"]
    for r in rows:
        cut = (f" {r['kernel_cut_difference']:.3g} | {r['sdpa_cut_difference']:.3g} |" if "kernel_cut_difference" in r
               else " | |")
        lines.append(f"| {r['threads']} | {r['step']} | {r['kernel_ms']:.1f} | {r['sdpa_ms']:.1f} | "
                     f"{r['sdpa_over_kernel']:.2f} |"
                     + (f" {r['against_ms']:.1f} | {r['against_over_kernel']:.2f} |" if against else "") + cut)
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", nargs="+", type=int, default=[1], help="torch thread counts, each measured")
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 512, 2048], help="prefill prompt lengths")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=300, help="the decode rows' mean context (tokens)")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per side and step (medians reported)")
    ap.add_argument("--against", metavar="PATH",
                    help="also time another build of the attention kernel: a source tree built with `python setup.py "
                         "build_ext --inplace` (e.g. a `git worktree` of an older commit), or its "
                         "engines/_cpu_attention*.so")
    ap.add_argument("--name", default="cpu_attention", help="results file stem")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    from artifact.benchmarks.bench_llamacpp import cpu_flags  # deferred: the artifact's helpers, not the engine's
    from artifact.benchmarks.common import RESULTS, print_table, write_results

    older = load_kernel_build(args.against, "_cpu_attention") if args.against else None
    bench = Bench(args)
    rows: list[dict] = []
    kept = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            rows += measure(bench, args, older)
    finally:
        torch.set_num_threads(kept)
    path = write_results(args.name, {"cpu_flags": cpu_flags(), "torch": torch.__version__, "args": vars(args),
                                     "results": rows})
    (RESULTS / f"{args.name}.md").write_text(markdown(rows))
    print_table(rows, ["threads", "step", "kernel_ms", "sdpa_ms", "sdpa_over_kernel"]
                + (["against_ms", "against_over_kernel"] if older is not None else [])
                + ["kernel_cut_difference", "sdpa_cut_difference"],
                title=f"int8 attention on the CPU: prompts through the kernel or SDPA ({path})")
    return rows


if __name__ == "__main__":
    main()
