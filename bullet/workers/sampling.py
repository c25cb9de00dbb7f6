"""What a model executor does with a step's logits: record prompt log-probabilities, sample the
next token of each request, append it, stamp the first token, and decide whether the request is
done. Shared by every loop through `ModelExecutor`, so a request behaves the same in all of them."""

from __future__ import annotations

import time

import torch

from bullet.types.finish import FinishChecker
from bullet.types.request import Request
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


def sample_next(logits: torch.Tensor, reqs: list[Request], finish: FinishChecker) -> None:
    """logits[i] are the next-token logits of reqs[i]. Appends one token to each and finishes the
    requests the finish rules end (the loop core releases their pages)."""
    rows = [SampleRow(r.params, step_generator(r, logits.device), r.output_ids, finish.banned_ids(r)) for r in reqs]
    result = sample(logits, rows)
    now = time.monotonic()
    for k, req in enumerate(reqs):
        req.output_ids.append(result.token_ids[k])
        if req.params.logprobs or req.params.top_logprobs_num:
            req.output_logprobs.append(result.logprobs[k])
            req.output_top_logprobs.append(result.top_logprobs[k])
        if req.first_token_time is None:
            req.first_token_time = now
        reason = finish.check(req)
        if reason is not None:
            req.finish(reason, now)
