"""SGLang's generated shared-prefix workload (`bench_serving --dataset-name generated-shared-prefix`):
`num_groups` system prompts of `system_prompt_len` tokens, each followed by `prompts_per_group`
questions of `question_len` tokens, answered with `output_len` tokens; all prompts shuffled and sent
as a Poisson process at `rate` requests per second.

For the simulator a request is (arrival, prompt tokens, output tokens, prefix id, prefix tokens) —
what `Simulation` needs to give requests of one group the same leading token ids; for a served run,
`token_ids` builds the prompts themselves (random ids, one system prompt per group)."""

from __future__ import annotations

import random
from typing import NamedTuple


class SharedPrefixRequest(NamedTuple):
    arrival: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: int  # the group: requests of one group begin with the same system prompt
    prefix_tokens: int


def generated_shared_prefix(num_groups: int = 8, prompts_per_group: int = 16, system_prompt_len: int = 2048,
                            question_len: int = 128, output_len: int = 256, rate: float = 4.0,
                            seed: int = 0) -> list[SharedPrefixRequest]:
    if min(num_groups, prompts_per_group, system_prompt_len, question_len, output_len) < 1 or rate <= 0:
        raise ValueError("every size must be positive, and the rate too")
    rng = random.Random(seed)
    groups = [g for g in range(num_groups) for _ in range(prompts_per_group)]
    rng.shuffle(groups)
    t, out = 0.0, []
    for g in groups:
        t += rng.expovariate(rate)
        out.append(SharedPrefixRequest(t, system_prompt_len + question_len, output_len, g, system_prompt_len))
    return out


def token_ids(requests: list[SharedPrefixRequest], vocab_size: int, seed: int = 0,
              reserved: int = 16) -> list[list[int]]:
    """Prompt token ids of each request: its group's system prompt, then its own question (random ids
    above the first `reserved`, which hold a tokenizer's special tokens)."""
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}
    prompts = []
    for r in requests:
        if r.prefix_id not in prefixes:
            prefixes[r.prefix_id] = [rng.randrange(reserved, vocab_size) for _ in range(r.prefix_tokens)]
        own = [rng.randrange(reserved, vocab_size) for _ in range(r.prompt_tokens - r.prefix_tokens)]
        prompts.append(prefixes[r.prefix_id] + own)
    return prompts
