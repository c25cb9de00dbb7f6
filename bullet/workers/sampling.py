"""What a model executor does with a step's logits: record prompt log-probabilities, sample the
next token of each request, append it, stamp the first token, and decide whether the request is
done. Shared by every loop through `ModelExecutor`, so a request behaves the same in all of them.

A request with a grammar (`SamplingParams.constraint`) samples only what its grammar allows next. Its
matcher (`Request.grammar`) is this process's: built on the first token this process samples for it
and advanced over the output tokens it already has — the first token the prefill worker sampled,
or everything a request handed back for recomputation had produced — so prefill's first token and
decode's steps follow one grammar state, and nothing but the token ids crosses the process boundary.
A request whose grammar ends (it accepted end-of-sequence) stops there."""

from __future__ import annotations

import time

import torch

from bullet.types.finish import Abort, FinishChecker, Stop
from bullet.types.request import Request
from engines.grammar import GrammarError, Grammars, bitmask_words
from engines.sampler import SampleRow, sample

_SEED_MIX = 0x9E3779B97F4A7C15


def step_generator(req: Request, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded request draws token k from a generator derived from (seed, k): the output is the
    same whichever worker samples it and whatever else is in the batch. The generator lives on the
    logits' device (a CPU generator cannot drive sampling on CUDA)."""
    if req.params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed((req.params.seed * _SEED_MIX + len(req.output_ids)) % 2**63)


def record_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """logits[j] predicts the token at position start + j + 1; only prompt positions are kept. With
    top_logprobs_num, also the most likely tokens at each position (none for the first: nothing
    predicts it)."""
    top = req.params.top_logprobs_num
    if start == 0:
        req.prompt_logprobs = [None]
        req.prompt_top_logprobs = [None] if top else []
    targets = req.all_ids[start + 1 : min(start + 1 + logits.shape[0], len(req.prompt_ids))]
    if targets:
        lp = torch.log_softmax(logits[: len(targets)], dim=-1)
        index = torch.tensor(targets, device=lp.device).unsqueeze(1)
        req.prompt_logprobs.extend(lp.gather(1, index).squeeze(1).tolist())
        if top:
            values, ids = lp.topk(top, dim=-1)
            req.prompt_top_logprobs.extend(list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))


def grammar_masks(reqs: list[Request], grammars: Grammars | None, vocab: int) -> tuple[list, dict[int, str]]:
    """The packed bitmask of each constrained request's allowed next tokens (None for the others),
    and why a constrained request cannot go on, by index (it is ended with that error)."""
    masks: list[torch.Tensor | None] = [None] * len(reqs)
    failed: dict[int, str] = {}
    constrained = [k for k, r in enumerate(reqs) if r.params.constraint is not None]
    if not constrained:
        return masks, failed
    packed = torch.full((len(constrained), bitmask_words(vocab)), -1, dtype=torch.int32)
    for j, k in enumerate(constrained):
        req = reqs[k]
        try:
            if grammars is None:
                raise GrammarError("this server cannot apply grammars (it has no tokenizer)")
            if req.grammar is None or req.grammar.consumed > len(req.output_ids):
                req.grammar = grammars.matcher(req.params.constraint)
            req.grammar.follow(req.output_ids)
            if req.grammar.terminated:
                raise GrammarError("the grammar has already ended")
            req.grammar.fill(packed, j)
            masks[k] = packed[j]
        except Exception as exc:  # a grammar that does not compile, a token it refuses: this request only
            failed[k] = f"constrained decoding failed: {exc}"
    return masks, failed


def sample_next(logits: torch.Tensor, reqs: list[Request], finish: FinishChecker,
                grammars: Grammars | None = None, masks: tuple[list, dict[int, str]] | None = None) -> None:
    """logits[i] are the next-token logits of reqs[i]. Appends one token to each and finishes the
    requests the finish rules end (the loop core releases their pages). `masks`: `grammar_masks` of
    these requests, computed already (while the step's layers ran)."""
    masks, failed = masks if masks is not None else grammar_masks(reqs, grammars, logits.shape[-1])
    if failed:  # they sample nothing: ended with the error (the step's K/V stays accounted as usual)
        keep = [k for k in range(len(reqs)) if k not in failed]
        now = time.monotonic()
        for k, message in failed.items():
            reqs[k].finish(Abort(message=message), now)
        logits, reqs, masks = logits[keep], [reqs[k] for k in keep], [masks[k] for k in keep]
        if not reqs:
            return
    rows = [SampleRow(r.params, step_generator(r, logits.device), r.output_ids, finish.banned_ids(r), masks[k])
            for k, r in enumerate(reqs)]
    result = sample(logits, rows)
    now = time.monotonic()
    for k, req in enumerate(reqs):
        token = result.token_ids[k]
        req.output_ids.append(token)
        if req.params.logprobs or req.params.top_logprobs_num:
            req.output_logprobs.append(result.logprobs[k])
            req.output_top_logprobs.append(result.top_logprobs[k])
        if req.first_token_time is None:
            req.first_token_time = now
        reason = finish.check(req)
        if masks[k] is not None:
            req.grammar.accept(token)  # allowed by its mask, so accepted
            if reason is None and req.grammar.terminated:  # it ended (even with ignore_eos): nothing may follow
                reason = Stop(matched=token)
        if reason is not None:
            req.finish(reason, now)
