"""The offline API: `bullet.LLM(model_path).generate(prompts, sampling_params)` in one process, with
continuous batching (requests join and leave the batch between steps), like nano-vllm's `LLM`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bullet.engine import Engine
from bullet.finish import FinishChecker, trim_stop_string
from bullet.page_allocator import LocalPageAllocator
from bullet.schedulers.hybrid import HybridScheduler
from engines.device import resolve_device, resolve_dtype
from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.runner import ModelRunner
from engines.sampling_params import SamplingParams
from engines.tokenizer import load_tokenizer
from engines.weights import load_weights


@dataclass
class GenerateOutput:
    text: str
    output_ids: list[int]
    prompt_ids: list[int]
    finish_reason: dict
    prompt_logprobs: list[float | None] | None = None
    output_logprobs: list[float | None] | None = None
    output_top_logprobs: list | None = None


class LLM:
    def __init__(self, model_path: str | None = None, *, load_format: str = "auto", dtype: str = "auto",
                 device: str = "cpu", tokenizer_path: str | None = None, page_size: int = 16,
                 max_total_tokens: int = 32768, chunked_prefill_size: int = 8192, max_running_requests: int = 64,
                 num_threads: int | None = None, seed: int = 0):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if num_threads:
            torch.set_num_threads(num_threads)
        weights = load_weights(model_path, load_format, self.dtype, seed=seed)
        self.config = weights.config
        self.tokenizer = (load_tokenizer(weights.source, weights.load_format, tokenizer_path)
                          if weights.load_format != "dummy" or tokenizer_path else None)
        model = build_model(weights.config, {k: v.to(self.device) for k, v in weights.state.items()}, self.device)
        pages = KVPool.pages_for_tokens(max_total_tokens, page_size)
        kv = KVPool(weights.config, pages, page_size, self.dtype, self.device)
        self.runner = ModelRunner(model, kv, self.device)
        eos = set(weights.config.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        finish = FinishChecker(self.tokenizer, eos, weights.config.max_position_embeddings)
        self.allocator = LocalPageAllocator(pages, page_size)
        self.scheduler = HybridScheduler(self.allocator, chunked_prefill_size, max_running_requests)
        self.engine = Engine(self.runner, self.scheduler, finish)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | dict | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerateOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        params = [p if isinstance(p, SamplingParams) else SamplingParams(**(p or {})) for p in params]
        encoded = [self.encode(p) for p in prompts]
        reqs = []
        try:
            for ids, p in zip(encoded, params):
                reqs.append(self.engine.add_request(ids, p))
        except Exception:
            for r in reqs:
                self.engine.abort(r.rid)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        while any(not r.finished for r in reqs):
            progressed = self.engine.step()
            if bar is not None:
                bar.update(sum(1 for r in progressed if r.finished))
        if bar is not None:
            bar.close()
        return [self._output(r) for r in reqs]

    def _output(self, req) -> GenerateOutput:
        text = ""
        if self.tokenizer is not None:
            text = trim_stop_string(self.tokenizer.decode(req.output_ids, req.params.skip_special_tokens), req.finish_reason)
        lp = req.params.logprobs or req.params.top_logprobs_num
        return GenerateOutput(
            text=text, output_ids=list(req.output_ids), prompt_ids=list(req.prompt_ids), finish_reason=req.finish_reason,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs else None,
            output_logprobs=req.output_logprobs if lp else None,
            output_top_logprobs=req.output_top_logprobs if req.params.top_logprobs_num else None,
        )
