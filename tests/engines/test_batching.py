"""Continuous batching: requests join and leave between steps, prefills are chunked, memory
pressure preempts and recomputes — and greedy outputs never change."""

from __future__ import annotations

import pytest
import torch

from bullet.llm import OfflineEngine
from bullet.types.finish import Abort, FinishChecker
from engines.kv_pool import KVPool
from engines.runner import ModelRunner, SeqChunk
from engines.sampling_params import SamplingParams
from tests.engines.conftest import PROMPTS

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def solo_outputs(llm32):
    return [llm32.generate(p, GREEDY)[0].output_ids for p in PROMPTS]


def _engine(llm32, pages: int, budget: int, max_running: int = 64) -> OfflineEngine:
    runner = ModelRunner(llm32.runner.model, KVPool(llm32.config, pages, 16, llm32.dtype))
    finish = FinishChecker(llm32.tokenizer, llm32.tokenizer.eos_token_ids, llm32.config.max_position_embeddings)
    return OfflineEngine(runner, finish, budget, max_running)


def test_requests_join_and_leave_between_steps(llm32, solo_outputs):
    eng = _engine(llm32, pages=256, budget=64)  # small budget: long prompts are chunked
    reqs, sizes = {}, []
    pending = list(enumerate(PROMPTS))
    step = 0
    while pending or eng.has_work():
        if pending and step % 3 == 0:  # a new arrival every third step
            i, p = pending.pop(0)
            reqs[i] = eng.add_request(llm32.tokenizer.encode(p), GREEDY)
        eng.step()
        sizes.append(len(eng.scheduler.running))
        step += 1
    assert max(sizes) > 1 and min(sizes) < max(sizes)
    for i, req in reqs.items():
        assert req.output_ids == solo_outputs[i]
    assert eng.scheduler.allocator.num_free() == 256


def test_preemption_under_memory_pressure_recomputes_identically(llm32, solo_outputs):
    # 14 pages of 16 tokens cannot hold all eight sequences at once
    eng = _engine(llm32, pages=14, budget=512)
    reqs = [eng.add_request(llm32.tokenizer.encode(p), GREEDY) for p in PROMPTS]
    while eng.has_work():
        eng.step()
    assert eng.scheduler.preemptions > 0
    assert [r.output_ids for r in reqs] == solo_outputs
    assert eng.scheduler.allocator.num_free() == 14


def test_abort_frees_pages(llm32):
    eng = _engine(llm32, pages=64, budget=256)
    a = eng.add_request(llm32.tokenizer.encode(PROMPTS[0]), GREEDY)
    b = eng.add_request(llm32.tokenizer.encode(PROMPTS[1]), GREEDY)
    eng.step()
    eng.step()
    eng.abort(a, "client went away")
    assert a.finish_reason == Abort(message="client went away")
    while eng.has_work():
        eng.step()
    assert len(b.output_ids) == 12 and eng.scheduler.allocator.num_free() == 64


def test_a_step_run_layer_by_layer_calls_back_between_layers_and_computes_the_same(llm32):
    # how a decode worker gives cores to an arriving prompt mid-step: the same step, with a callback
    # between its layers, must compute exactly what it computes in one go
    runner = ModelRunner(llm32.runner.model, KVPool(llm32.config, 8, 16, llm32.dtype))
    prompt = llm32.tokenizer.encode(PROMPTS[4])[:40]
    pages = list(range(-(-(len(prompt) + 1) // 16)))
    whole = runner.forward([SeqChunk(prompt, 0, pages)]).last_logits
    next_id = int(whole[0].argmax())
    one_go = runner.forward([SeqChunk([next_id], len(prompt), pages)]).last_logits
    calls = []
    layered = runner.forward([SeqChunk([next_id], len(prompt), pages)], between_layers=calls.append).last_logits
    assert calls == list(range(1, runner.model.num_layers))
    assert torch.equal(one_go, layered)
