"""`bullet generate`: offline generation in this process (no server), for a quick look at a model."""

from __future__ import annotations

import argparse
import sys
import time

NAME = "generate"
HELP = "generate text offline with the embedded default model (or --model-path), no server"
DESCRIPTION = ("Loads the model in this process and generates for each prompt with continuous batching. "
               "Use `bullet launch` to serve over HTTP.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompts (default: read one per line from stdin)")
    p.add_argument("--model-path", default=None, help="a .gguf file, an HF directory, or a config for --load-format dummy")
    p.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from bullet.llm import LLM  # deferred: `bullet --help` lists commands without loading torch
    from engines.sampling_params import SamplingParams, validation_message  # deferred: as above
    from engines.weights import ModelLoadError  # deferred: as above

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("bullet generate: no prompt given", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValidationError as exc:
        print(f"bullet generate: {validation_message(exc)}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    print("[bullet] loading model …", file=sys.stderr, flush=True)
    try:
        llm = LLM(args.model_path, load_format=args.load_format, tokenizer_path=args.tokenizer_path,
                  dtype=args.dtype, device=args.device)
    except (ModelLoadError, ValueError) as exc:
        print(f"bullet generate: {exc}", file=sys.stderr)
        return 1
    print(f"[bullet] loaded {llm.config.name} ({llm.dtype}) in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    t1 = time.monotonic()
    try:
        outputs = llm.generate(prompts, params)
    except ValueError as exc:
        print(f"bullet generate: {exc}", file=sys.stderr)
        return 1
    tokens = sum(len(o.output_ids) for o in outputs)
    for prompt, out in zip(args.prompts or prompts, outputs):
        print(f"--- {prompt!r}\n{out.text}")
    print(f"[bullet] {tokens} tokens in {time.monotonic() - t1:.1f}s", file=sys.stderr)
    return 0
