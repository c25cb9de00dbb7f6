"""Sampling controls and stop conditions, end to end through `bullet.LLM`."""

from __future__ import annotations

import torch

from engines.sampler import SampleRow, sample
from engines.sampling_params import SamplingParams

PROMPT = "Tell me a story about a dragon."


def test_seed_makes_sampling_reproducible_and_independent_of_the_batch(llm32):
    p = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_new_tokens": 16, "ignore_eos": True}
    alone = llm32.generate(PROMPT, p)[0].output_ids
    in_batch = llm32.generate([PROMPT, "Another prompt", "1 2 3"], [p, {**p, "seed": 5}, {**p, "seed": 6}])
    assert in_batch[0].output_ids == alone
    other_seed = llm32.generate(PROMPT, {**p, "seed": 99})[0].output_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm32):
    greedy = llm32.generate(PROMPT, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})[0].output_ids
    k1 = llm32.generate(PROMPT, {"temperature": 0.8, "top_k": 1, "max_new_tokens": 12, "ignore_eos": True})[0]
    assert k1.output_ids == greedy


def test_sampler_truncations_only_ever_pick_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        res = sample(logits, [
            SampleRow(SamplingParams(temperature=1.0, top_k=2), gen),
            SampleRow(SamplingParams(temperature=1.0, top_p=0.5), gen),  # p(0)=0.64 > 0.5: only token 0
            SampleRow(SamplingParams(temperature=1.0, min_p=0.3), gen),  # p(1)/p(0)=0.37 ok, p(2)/p(0)=0.14 not
        ])
        assert res.token_ids[0] in (0, 1)
        assert res.token_ids[1] == 0
        assert res.token_ids[2] in (0, 1)
    banned = sample(logits[:1], [SampleRow(SamplingParams(temperature=0), banned_ids=(0,))])
    assert banned.token_ids == [1]
    rep = sample(logits[:1], [SampleRow(SamplingParams(temperature=0, frequency_penalty=2.0), output_ids=[0])])
    assert rep.token_ids == [1]


def test_stop_token_ids_and_max_new_tokens(llm32):
    base = llm32.generate(PROMPT, {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})[0]
    target = base.output_ids[5]
    first = base.output_ids.index(target)
    out = llm32.generate(PROMPT, {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [target], "ignore_eos": True})[0]
    assert out.output_ids == base.output_ids[: first + 1]
    assert out.finish_reason == {"type": "stop", "matched": target}
    assert base.finish_reason == {"type": "length", "length": 20}


def test_stop_string_trims_the_text(llm32):
    base = llm32.generate(PROMPT, {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})[0]
    words = base.text.split()
    stop = words[len(words) // 2]
    out = llm32.generate(PROMPT, {"temperature": 0, "max_new_tokens": 30, "stop": [stop], "ignore_eos": True})[0]
    assert out.finish_reason == {"type": "stop", "matched": stop}
    assert stop not in out.text and base.text.startswith(out.text)
    assert len(out.output_ids) < len(base.output_ids)


def test_eos_ends_generation_unless_ignored(llm32):
    chat = llm32.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm32.generate(chat, {"temperature": 0, "max_new_tokens": 40})[0]
    assert out.finish_reason == {"type": "stop", "matched": 2}
    assert "Paris" in out.text and not out.text.endswith("<|im_end|>")
    longer = llm32.generate(chat, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})[0]
    assert len(longer.output_ids) == 40
    at_least = llm32.generate(chat, {"temperature": 0, "max_new_tokens": 40, "min_new_tokens": len(out.output_ids) + 3})[0]
    assert len(at_least.output_ids) >= len(out.output_ids) + 3


def test_output_logprobs_are_consistent(llm32):
    out = llm32.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "logprobs": True, "top_logprobs_num": 3,
                                  "ignore_eos": True})[0]
    assert len(out.output_logprobs) == 6 and all(lp <= 0 for lp in out.output_logprobs)
    for tok, lp, top in zip(out.output_ids, out.output_logprobs, out.output_top_logprobs):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy picks the top token
        assert top[0][1] >= top[1][1] >= top[2][1]
