"""Batched token selection: penalties, greedy rows in one argmax, sampled rows through
temperature → top-k → top-p → min-p, each row with its own generator when it has a seed.
Log-probabilities are reported from the raw distribution (before temperature and truncation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] | None = None  # for penalties
    banned_ids: tuple[int, ...] = ()  # e.g. EOS/stop ids before min_new_tokens


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """logits: [B, V] float32, one row per entry of `rows`."""
    b = len(rows)
    want_lp = [r.params.logprobs or r.params.top_logprobs_num > 0 for r in rows]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    logits = _apply_penalties(logits, rows)
    chosen = torch.empty(b, dtype=torch.long, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        chosen[greedy] = logits[greedy].argmax(dim=-1)
    if sampled:
        chosen[sampled] = _sample_rows(logits[sampled], [rows[i] for i in sampled])
    token_ids = chosen.tolist()
    logprobs: list[float | None] = [None] * b
    tops: list[list[tuple[int, float]] | None] = [None] * b
    if raw_lp is not None:
        picked = raw_lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        for i, r in enumerate(rows):
            if want_lp[i]:
                logprobs[i] = picked[i]
            if r.params.top_logprobs_num:
                vals, ids = raw_lp[i].topk(r.params.top_logprobs_num)
                tops[i] = list(zip(ids.tolist(), vals.tolist()))
    return SampleResult(token_ids, logprobs, tops)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    if not any(r.params.has_penalties and r.output_ids or r.banned_ids for r in rows):
        return logits
    logits = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        if p.has_penalties and r.output_ids:
            ids, counts = torch.tensor(r.output_ids, device=logits.device).unique(return_counts=True)
            row = logits[i]
            if p.repetition_penalty != 1.0:
                vals = row[ids]
                row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
        if r.banned_ids:
            logits[i, list(r.banned_ids)] = float("-inf")
    return _finite_top(logits)


def _finite_top(x: torch.Tensor) -> torch.Tensor:
    """+inf (an overflowing division) becomes the largest finite value, so softmax stays a distribution."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)


def _sample_rows(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
    sorted_logits, order = _finite_top(logits / temps).sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=dev).unsqueeze(1)
    remove = ranks >= top_k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev).unsqueeze(1)
    remove |= (probs.cumsum(dim=-1) - probs) > top_p  # keep the smallest prefix whose mass reaches top_p
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev).unsqueeze(1)
    remove |= probs < min_p * probs[:, :1]
    remove[:, 0] = False  # the most likely token always survives
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    picks = [torch.multinomial(probs[j], 1, generator=r.generator) for j, r in enumerate(rows)]
    return order.gather(1, torch.cat(picks).unsqueeze(1)).squeeze(1)
