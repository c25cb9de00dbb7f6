"""A /generate body as the requests it stands for: one per prompt, times `n` samples (SGLang's
parallel sampling), each with its sampling params, rid and log-probability options — every field
checked, with a 400 that names it, before anything is submitted.

Order is SGLang's: prompt-major (prompt 0's samples, then prompt 1's, ...), and a single prompt with
n > 1 answers as a batch (a JSON array, and `index` on stream events)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet.frontend.http.errors import APIError
from bullet.frontend.http.generation import check_batch_size, check_fits, check_text_options, require_tokenizer
from bullet.frontend.http.offload import sized
from bullet.frontend.http.protocol import GenerateBody
from bullet.frontend.http.sampling import build_sampling_params, check_constraint, per_sample, sample_count
from engines.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20


@dataclass
class Item:
    ids: list[int]
    params: SamplingParams
    rid: str | None  # the request's own id (None: the server picks one)
    group: str | None  # the client's rid that the samples of one prompt share (n > 1)
    logprob: bool  # return_logprob
    start: int  # logprob_start_len (-1: no prompt log-probabilities)
    top: int  # top_logprobs_num


def field_for(body: GenerateBody, name: str, i: int, default=None):
    """Field `name` for prompt i: a per-prompt list, or one value for every prompt."""
    value = getattr(body, name)
    if isinstance(value, list):
        if i >= len(value):
            raise APIError(f"{name} is a list of {len(value)} entries, but the batch has more prompts; "
                           "give one entry per prompt", param=name)
        return value[i]
    return value if value is not None else default


def samples_per_prompt(body: GenerateBody) -> int:
    """SGLang reads n from sampling_params (from the first entry of a list, which must all agree)."""
    sp = body.sampling_params
    if isinstance(sp, list):
        counts = {sample_count(p.get("n") if isinstance(p, dict) else None) for p in sp}
        if len(counts) > 1:
            raise APIError("sampling_params.n must be the same for every prompt of a batch", param="n")
        return counts.pop() if counts else 1
    return sample_count(sp.get("n") if isinstance(sp, dict) else None)


async def tokenized_prompts(rt, body: GenerateBody) -> tuple[list[list[int]], bool, str]:
    """(token ids of each prompt, whether the input was a batch, the prompt field's name)."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError("give exactly one of 'text' or 'input_ids' (the prompt)", param="text")
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if batch else [body.text]
        if any(not t for t in texts):
            raise APIError("text is empty", param="text")
        tokenizer = require_tokenizer(rt, "send the prompt as input_ids (token ids) instead of text", "text")
        # a multi-megabyte prompt takes seconds to tokenize: not on the event loop
        prompts = await sized(sum(map(len, texts)), lambda: [tokenizer.encode(t) for t in texts])
        field = "text"
    else:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batch else [body.input_ids]
        field = "input_ids"
    if not prompts:
        raise APIError(f"{field} is an empty list: the batch has no prompt", param=field)
    return prompts, batch, field


async def prepare(rt, body: GenerateBody) -> tuple[list[Item], bool]:
    """The request items, and whether the answer is a batch (a list input, or n > 1)."""
    n = samples_per_prompt(body)
    given = body.text if body.text is not None else body.input_ids
    if isinstance(given, list) and given and isinstance(given[0], (str, list)):
        check_batch_size(rt, len(given) * n, "text" if body.text is not None else "input_ids")
    wants_logprobs = any(body.return_logprob) if isinstance(body.return_logprob, list) else body.return_logprob
    if body.return_text_in_logprobs and wants_logprobs:
        require_tokenizer(rt, "return_text_in_logprobs needs one; leave it false (token ids are returned)",
                          "return_text_in_logprobs")
    prompts, batch, field = await tokenized_prompts(rt, body)
    items = []
    for i, ids in enumerate(prompts):
        want_lp = bool(field_for(body, "return_logprob", i, False))
        start = field_for(body, "logprob_start_len", i, -1)
        top = field_for(body, "top_logprobs_num", i, 0) or 0
        if want_lp and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs_num must lie in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs_num")
        params = build_sampling_params(
            field_for(body, "sampling_params", i, {}), logprobs=want_lp, top_logprobs_num=top if want_lp else 0,
            prompt_logprobs=want_lp and start >= 0)
        check_text_options(rt, params)
        await check_constraint(rt, params)
        await sized(len(ids), check_fits, rt, ids, params, prompt_field=field)
        rid = field_for(body, "rid", i)
        for j, sample in enumerate(per_sample(params, n)):
            own = rid if n == 1 or rid is None else f"{rid}-{j}"
            items.append(Item(ids, sample, own, rid if n > 1 else None, want_lp, start, top))
    return items, batch or n > 1
