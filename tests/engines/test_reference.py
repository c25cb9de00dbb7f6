"""Our model against the `transformers` reference on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from engines.runner import SeqChunk
from tests.engines.conftest import PROMPTS

NEW_TOKENS = 24  # greedy agreement this far already covers every prompt's path through the model


@pytest.fixture(scope="module")
def reference_outputs(llm32, hf_reference):
    outs = []
    for prompt in PROMPTS:
        ids = llm32.tokenizer.encode(prompt)
        with torch.no_grad():
            gen = hf_reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def test_greedy_matches_reference_as_one_mixed_batch(llm32, reference_outputs):
    outs = llm32.generate(PROMPTS, GREEDY)
    lengths = {len(o.prompt_ids) for o in outs}
    assert len(lengths) > 4, "the batch should mix prompt lengths"
    for prompt, ours, ref in zip(PROMPTS, outs, reference_outputs):
        assert ours.output_ids == ref, f"mismatch for {prompt[:40]!r}"


def test_greedy_matches_reference_one_prompt_at_a_time(llm32, reference_outputs):
    # batches of one: the shortest prompt, the longest and the non-ASCII one (the mixed batch has them all)
    for i in (0, 4, 7):
        assert llm32.generate(PROMPTS[i], GREEDY)[0].output_ids == reference_outputs[i], PROMPTS[i][:40]


def test_prompt_logprobs_match_reference(llm32, hf_reference):
    for prompt in PROMPTS[:4]:
        out = llm32.generate(prompt, {"max_new_tokens": 0, "prompt_logprobs": True})[0]
        ids = out.prompt_ids
        with torch.no_grad():
            logits = hf_reference(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), ref, atol=1e-3)
        assert out.output_ids == [] and out.finish_reason == {"type": "length", "length": 0}


def _greedy_decode(runner, ids: list[int], page_table: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    out = runner.forward([SeqChunk(ids, 0, page_table)])
    tokens, all_logits = [], [out.last_logits[0]]
    seq = list(ids)
    for _ in range(steps):
        tok = int(all_logits[-1].argmax())
        tokens.append(tok)
        seq.append(tok)
        all_logits.append(runner.forward([SeqChunk([tok], len(seq) - 1, page_table)]).last_logits[0])
    return tokens, torch.stack(all_logits)


def test_paged_decode_equals_contiguous_cache_decode(llm32):
    """Scattered, shuffled pages give the same logits as one contiguous block of slots."""
    runner, ps = llm32.runner, llm32.runner.page_size
    ids = llm32.tokenizer.encode(PROMPTS[4])
    need = -(-(len(ids) + 12) // ps)
    gen = torch.Generator().manual_seed(7)
    scattered = torch.randperm(runner.kv.num_pages, generator=gen)[:need].tolist()
    contiguous = list(range(need))
    tok_a, logits_a = _greedy_decode(runner, ids, scattered, 12)
    tok_b, logits_b = _greedy_decode(runner, ids, contiguous, 12)
    assert tok_a == tok_b
    assert torch.allclose(logits_a, logits_b, atol=1e-4)
    assert scattered != contiguous


def test_layerwise_prefill_equals_full_forward(llm32):
    runner = llm32.runner
    ids = llm32.tokenizer.encode(PROMPTS[1])
    pages = list(range(-(-len(ids) // runner.page_size)))
    full = runner.forward([SeqChunk(ids, 0, pages)]).last_logits
    state = runner.start([SeqChunk(ids, 0, pages)])
    steps = 0
    while not runner.run_layers(state, 7):
        steps += 1
    assert steps == 4  # 30 layers in steps of 7: 7, 14, 21, 28, 30
    assert torch.equal(runner.finish(state).last_logits, full)
