"""Batched token selection: penalties, logit bias, banned tokens, then the grammar's allowed tokens
(a packed bitmask per constrained row: `engines.grammar`), greedy rows in one argmax, sampled rows
through temperature → top-k → top-p → min-p, each row with its own generator when it has a seed.
Log-probabilities are reported from the raw distribution (before temperature and truncation).

Where a row's banned tokens (end-of-sequence before min_new_tokens) would leave the grammar nothing
to choose from, the grammar wins: the bans are lifted for that row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.grammar import apply_bitmask
from engines.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] | None = None  # for penalties
    banned_ids: tuple[int, ...] = ()  # e.g. EOS/stop ids before min_new_tokens
    # the tokens a grammar allows next: int32 words, bit t % 32 of word t // 32 set for token t (None: any)
    allowed: torch.Tensor | None = None


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
    logits = _apply_allowed(_apply_penalties(logits, rows), logits, rows)
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


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow], bans: bool = True) -> torch.Tensor:
    """Penalties, logit bias and (with `bans`) banned tokens, on a copy when there are any."""
    if not any(r.params.has_penalties and r.output_ids or r.banned_ids or r.params.logit_bias for r in rows):
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
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < logits.shape[-1]]
            if ids:
                bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
                logits[i, ids] += bias
        if bans and r.banned_ids:
            logits[i, list(r.banned_ids)] = float("-inf")
    return _finite_top(logits)


def unpack_bitmask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 → [rows, vocab] bool: token t is allowed when bit t % 32 of word t // 32 is set."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] < vocab:  # a mask narrower than the logits allows none of the extra tokens
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
    return bits[:, :vocab]


def _apply_allowed(logits: torch.Tensor, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Only the tokens each constrained row's grammar allows keep their logits. In place on the rows
    (a copy of `raw` first): with every row constrained (the usual batch of a structured-output
    workload) the mask runs over the whole tensor, else over a gathered copy of those rows; at batch
    16 over SmolLM2's 49k tokens, gathering rows by a list and writing them back cost more than the
    mask itself."""
    idx = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not idx:
        return logits
    if logits is raw:
        logits = logits.clone()
    packed = torch.stack([rows[i].allowed for i in idx])
    index = None if len(idx) == logits.shape[0] else torch.tensor(idx, device=logits.device)
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        if index is None:
            apply_bitmask(logits, packed)
        else:
            logits.index_copy_(0, index, apply_bitmask(logits.index_select(0, index), packed))
    else:
        allowed = unpack_bitmask(packed.to(logits.device), logits.shape[-1])
        if index is None:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
    # bans left the grammar nothing (a banned token holds the lowest finite value, not -inf:
    # `_finite_top`): the grammar wins over them. Only a row with bans can be left so.
    banned = [j for j, i in enumerate(idx) if rows[i].banned_ids]
    if banned:
        rows_banned = torch.tensor([idx[j] for j in banned], device=logits.device)
        dead = (logits.index_select(0, rows_banned).max(dim=-1).values <= torch.finfo(logits.dtype).min).tolist()
        for j, d in zip(banned, dead):
            if d:
                i = idx[j]
                row = _apply_penalties(raw[i:i + 1], [rows[i]], bans=False)[0]
                keep = unpack_bitmask(packed[j:j + 1].to(logits.device), logits.shape[-1])[0]
                logits[i] = row.masked_fill(~keep, float("-inf"))
    return logits


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
