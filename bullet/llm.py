"""The offline API: `bullet.LLM(model_path).generate(prompts, sampling_params)` in one process, with
continuous batching (requests join and leave the batch between steps), like nano-vllm's `LLM`.

It runs the same loop core as the chunked baseline's server worker (`UnifiedCore`, hybrid batches
with chunked prefill) on the same model executor, with an in-process page allocator and no peer.
`prefix_cache=True` keeps finished requests' full KV pages in the prefix (radix) cache, as the
server does by default (off here by default: a script's prompts rarely share prefixes)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from bullet.cache.prefix_cache import PrefixCache
from bullet.loops.base import LoopEnv
from bullet.loops.clock import MonotonicClock
from bullet.loops.timeline import Timeline
from bullet.loops.unified import UnifiedCore
from bullet.partition.unpartitioned import NoPartitionBackend
from bullet.policies.hybrid import HybridScheduler
from bullet.shm.page_allocator import LocalPageAllocator
from bullet.types.finish import FinishChecker, trim_stop_string
from bullet.types.request import Request
from bullet.types.roles import Role
from bullet.types.validation import RequestError, validate_prompt
from bullet.types.worker_state import WorkerState
from bullet.workers.executor import ModelExecutor
from engines.device import quantization_for, resolve_device, resolve_dtype, resolve_kv_dtype
from engines.grammar import GrammarError, Grammars, check, tokenizer_info
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
    finish_reason: dict  # SGLang's shape: {"type": "stop" | "length" | "abort", ...}
    prompt_logprobs: list[float | None] | None = None
    output_logprobs: list[float | None] | None = None
    output_top_logprobs: list | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class _NoPeer:
    """The state buffer of a process without a peer: publishes go nowhere, the peer is idle."""

    def publish(self, role: str, state: WorkerState) -> None:
        pass

    def read(self, role: str) -> WorkerState:
        return WorkerState()


class _Collect:
    """Outputs stay on the requests, which `generate` reads when they finish."""

    def handed_off(self, req: Request) -> None:
        raise RuntimeError("the offline engine has no decode worker")

    def tokens(self, reqs) -> None:
        pass

    def finished(self, req: Request) -> None:
        pass

    def recompute(self, req: Request) -> None:
        raise RuntimeError("the offline engine has no decode worker")


class OfflineEngine:
    """Continuous batching in this process: the unified loop core on a model runner, with its own
    page allocator over the runner's KV pool. `LLM` is this plus weights and a tokenizer."""

    def __init__(self, runner: ModelRunner, finish: FinishChecker, chunked_prefill_size: int = 8192,
                 max_running_requests: int = 64, prefix_cache: bool = False, grammars: Grammars | None = None):
        kv = runner.kv
        self.grammars = grammars  # None: no tokenizer, so no constrained decoding
        self.runner, self.vocab_size = runner, runner.model.config.vocab_size
        self.allocator = LocalPageAllocator(kv.num_pages, kv.page_size)
        self.cache = PrefixCache(self.allocator) if prefix_cache else None
        self.scheduler = HybridScheduler(self.allocator, chunked_prefill_size, max_running_requests, cache=self.cache)
        env = LoopEnv(role=Role.UNIFIED, clock=MonotonicClock(), state=_NoPeer(), allocator=self.allocator,
                      partition=NoPartitionBackend("prefill", total_units=torch.get_num_threads()),
                      timeline=Timeline(None, Role.UNIFIED.value), executor=ModelExecutor(runner, finish, grammars=grammars),
                      outbox=_Collect())
        self.core = UnifiedCore(env, self.scheduler)
        self._rids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        """Queue one tokenized request (raises RequestError if it can never run)."""
        validate_prompt(prompt_ids, params, self.vocab_size, self.runner.max_context,
                        self.allocator.total_pages * self.allocator.page_size)
        if params.constraint is not None:
            kind, text = params.constraint
            if self.grammars is None:
                raise RequestError(f"{kind}: constrained decoding needs a tokenizer (dummy weights carry none)")
            try:
                check(kind, text)
            except GrammarError as exc:
                raise RequestError(f"{kind}: invalid {kind.replace('_', ' ')}: {exc}") from None
            self.grammars.prefetch(params.constraint)
        req = Request(rid=rid if rid is not None else f"req-{next(self._rids)}", prompt_ids=list(prompt_ids),
                      params=params)
        self.core.add(req)
        return req

    def abort(self, req: Request, message: str = "aborted") -> None:
        self.core.abort(req.uid, message)

    def has_work(self) -> bool:
        return not self.core.idle

    def step(self) -> None:
        """One hybrid batch (nothing when no request is waiting or running)."""
        self.core.iterate()


class LLM:
    def __init__(self, model_path: str | None = None, *, load_format: str = "auto", dtype: str = "auto",
                 device: str | torch.device = "cpu", tokenizer_path: str | None = None, page_size: int = 16,
                 max_total_tokens: int = 32768, chunked_prefill_size: int = 8192, max_running_requests: int = 64,
                 num_threads: int | None = None, seed: int = 0, quantization: str = "auto", prefix_cache: bool = False,
                 kv_cache_dtype: str = "auto"):
        self.device = resolve_device(device)  # "cuda" is cuda:0: one device object for every consumer below
        self.dtype = resolve_dtype(dtype, self.device)
        if num_threads:
            torch.set_num_threads(num_threads)
        weights = load_weights(model_path, load_format, self.dtype, seed=seed, device=self.device,
                               quantization=quantization_for(quantization, dtype))
        self.config, self.dtype = weights.config, weights.dtype  # int8 computes in float32 whatever was asked
        self.tokenizer = (load_tokenizer(weights.source, weights.load_format, tokenizer_path)
                          if weights.load_format != "dummy" or tokenizer_path else None)
        model = build_model(weights.config, {k: v.to(self.device) for k, v in weights.state.items()}, self.device)
        pages = KVPool.pages_for_tokens(max_total_tokens, page_size)
        kv = KVPool(weights.config, pages, page_size, resolve_kv_dtype(kv_cache_dtype, self.dtype), self.device)
        self.runner = ModelRunner(model, kv, self.device)
        eos = set(weights.config.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        finish = FinishChecker(self.tokenizer, eos, weights.config.max_position_embeddings)
        grammars = None
        if self.tokenizer is not None:  # compiled against the model's vocabulary, on first use
            hf, vocab = self.tokenizer.hf, weights.config.vocab_size
            grammars = Grammars(lambda: tokenizer_info(hf, vocab, eos))
        self.engine = OfflineEngine(self.runner, finish, chunked_prefill_size, max_running_requests, prefix_cache,
                                    grammars)
        self.allocator = self.engine.allocator

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
                self.engine.abort(r)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm  # optional progress bar: only imported when asked for

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        done = 0
        while done < len(reqs):
            self.engine.step()
            finished = sum(1 for r in reqs if r.finished)
            if bar is not None:
                bar.update(finished - done)
            done = finished
        if bar is not None:
            bar.close()
        return [self._output(r) for r in reqs]

    def _output(self, req: Request) -> GenerateOutput:
        text = ""
        if self.tokenizer is not None:
            text = trim_stop_string(self.tokenizer.decode(req.output_ids, req.params.skip_special_tokens), req.finish_reason)
        lp = req.params.logprobs or req.params.top_logprobs_num
        return GenerateOutput(
            text=text, output_ids=list(req.output_ids), prompt_ids=list(req.prompt_ids),
            finish_reason=req.finish_reason.to_json(),
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs else None,
            output_logprobs=req.output_logprobs if lp else None,
            output_top_logprobs=req.output_top_logprobs if req.params.top_logprobs_num else None,
            cached_tokens=req.cached_tokens,
        )


__all__ = ["LLM", "GenerateOutput", "OfflineEngine", "RequestError"]
