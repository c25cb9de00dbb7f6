"""Every served architecture against `transformers`, logit by logit, on a tiny random fp32 checkpoint
that transformers itself saved (`tiny_checkpoints`): the reference is its forward pass over the whole
sequence (prompt plus its own 32 greedy tokens), one row of logits per position.

* prefill: a batch of prompts of different lengths, every position's logits;
* paged decode: those prompts then decode together, 31 steps of one token each (fed transformers'
  greedy tokens, so each step has a reference row), their pages scattered through the pool;
* prefix-cache hit: a second prompt whose first two pages are the first prompt's cached K/V,
  extended from them (and the shared pages left untouched);
  each on the CPU's float path (the context gathered from the pages) and on the paged kernels (the
  in-place C kernel where built, the torch reference);
* the offline engine (`bullet.LLM`, continuous batching, prefix cache on): greedy continuations
  equal over 32 tokens, the chosen tokens' log-probabilities equal, a prompt served from the cache;
* Qwen3-MoE: the experts each token picks (and their weights) in every layer equal transformers'
  router's; and served by `bullet launch` (prefill and decode workers), tokens and log-probabilities
  equal (marked slow: a server start).

All within TOL = 1e-4 (max abs) — measured ~1e-5 at logits of magnitude ~7: fp32 summation order
only. A token (or an expert) picked by argmax is a fair check only where the reference's best and
next logits lie more than 2 TOL apart (then logits within TOL of them cannot pick another): that is
asserted of the reference too, so a mismatch is a real difference, not a tie broken by noise."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.model.paged_attention import TorchPagedKernels
from engines.runner import ModelRunner, SeqChunk
from engines.weights import load_weights
from tests.engines import tiny_checkpoints as tiny

transformers = pytest.importorskip("transformers")

LLAMA, MISTRAL, QWEN2, QWEN3, MOE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                     "Qwen3MoeForCausalLM")
ARCHS = [LLAMA, MISTRAL, QWEN2, QWEN3, MOE]
TOL = 1e-4
NEW_TOKENS = 32
PAGE = 16
# weights under which no greedy step of a reference is a near-tie (seed 0's MoE has one of 7e-5)
SEEDS = {MISTRAL: 3}
SEED = 2
# one token per byte: 5, 22, 40 and 71 tokens
PROMPTS = ["Hello", "def fibonacci(n):\n    ", "Once upon a time, in a small village at ",
           "The quick brown fox jumps over the lazy dog, and then it runs far away."]
# PROMPTS[2]'s first two pages (32 tokens), then another ending: a prefix-cache hit of two pages
SHARED_PREFIX = 2 * PAGE
CACHED = PROMPTS[2][:SHARED_PREFIX] + "the edge of the sea there lived a cat."


@dataclass
class Reference:
    path: Path
    model: object  # transformers' model
    ids: list[list[int]]  # PROMPTS' ids
    greedy: list[list[int]]  # transformers' generate(): 32 greedy tokens per prompt
    logits: list[torch.Tensor]  # per prompt: [prompt + 32 tokens, vocab], its forward over the whole sequence
    cached_ids: list[int]
    cached_greedy: list[int]
    cached_logits: torch.Tensor


def _forward(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _reference(arch: str, path: Path) -> Reference:
    model = tiny.save(arch, path, seed=SEEDS.get(arch, SEED))
    tok = tiny.byte_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert [len(i) for i in ids] == [len(p.encode()) for p in PROMPTS]
    cached_ids = tok.encode(CACHED)
    *greedy, cached_greedy = tiny.greedy_batch(model, ids + [cached_ids], NEW_TOKENS)
    ref = Reference(path, model, ids, greedy, [_forward(model, i + g) for i, g in zip(ids, greedy)],
                    cached_ids, cached_greedy, _forward(model, cached_ids + cached_greedy))
    # generate()'s tokens (its own KV cache) are the argmax of the whole-sequence forward, and no
    # step is a near-tie that float noise could flip: a greedy mismatch is then a real difference
    for i, g, logits in [*zip(ids, greedy, ref.logits), (cached_ids, cached_greedy, ref.cached_logits)]:
        steps = logits[len(i) - 1 : len(i) - 1 + NEW_TOKENS]
        assert steps.argmax(-1).tolist() == g
        top2 = steps.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 2 * TOL, f"{arch}: a near-tie in the reference's greedy path"
    return ref


class _References(dict):
    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, arch: str) -> Reference:
        self[arch] = _reference(arch, self.factory.mktemp(arch))
        return self[arch]


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, Reference]:
    """architecture -> its checkpoint and transformers' outputs, built on first use."""
    return _References(tmp_path_factory)


# -- the model runner over the paged pool ------------------------------------------------------------

MODES = ["gather", "paged-cpu", "paged-torch"]


def _runner(ref: Reference, mode: str) -> ModelRunner:
    """`gather`: the float models' CPU serving path (each step's context gathered from the pages);
    `paged-*`: attention reading the pages in place (the C kernel, the torch reference)."""
    w = load_weights(str(ref.path), dtype=torch.float32)
    model, pool = build_model(w.config, w.state), KVPool(w.config, 64, PAGE, torch.float32)
    if mode == "gather":
        return ModelRunner(model, pool, paged=False)
    if mode == "paged-cpu":
        from engines.model import cpu_attention

        if not cpu_attention.available(torch.float32, torch.float32):
            pytest.skip("engines._cpu_attention is not built (or this CPU has no vector form of it)")
        return ModelRunner(model, pool, paged=True, kernels=cpu_attention.CpuPagedKernels())
    return ModelRunner(model, pool, paged=True, kernels=TorchPagedKernels())


def _scattered_pages(seed: int = 0):
    """Pages handed out in a shuffled order (as a pool that has served a while hands them out), so a
    sequence's pages are neither in order nor side by side."""
    order = list(range(64))
    random.Random(seed).shuffle(order)
    return iter(order)


def _pages_for(free, n_tokens: int) -> list[int]:
    return [next(free) for _ in range(-(-n_tokens // PAGE))]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    err = float((got - want).abs().max())
    assert err <= TOL, f"{what}: max |logit difference| {err:.3g} > {TOL}"
    return err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_paged_decode_logits(arch, mode, refs):
    """One batched prefill of four prompts (5-71 tokens: one to five pages), every position's logits;
    then 31 batched decode steps, each sequence at its own length."""
    ref = refs[arch]
    runner, free = _runner(ref, mode), _scattered_pages()
    total = [len(i) + NEW_TOKENS for i in ref.ids]
    tables = [_pages_for(free, n) for n in total]
    out = runner.forward([SeqChunk(i, 0, t, logits="all") for i, t in zip(ref.ids, tables)])
    for k, i in enumerate(ref.ids):
        _close(out.all_logits[k], ref.logits[k][: len(i)], f"{arch} {mode} prefill of prompt {k}")
    for step in range(NEW_TOKENS - 1):
        chunks = [SeqChunk([g[step]], len(i) + step, t) for i, g, t in zip(ref.ids, ref.greedy, tables)]
        got = runner.forward(chunks).last_logits
        for k, i in enumerate(ref.ids):
            _close(got[k], ref.logits[k][len(i) + step], f"{arch} {mode} decode step {step} of prompt {k}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hit_logits(arch, mode, refs):
    """CACHED shares PROMPTS[2]'s first two pages: its sequence takes those pages (written by
    PROMPTS[2]'s prefill) and computes only its own tokens from position 32, reading the cached K/V."""
    ref = refs[arch]
    runner, free = _runner(ref, mode), _scattered_pages(1)
    first = ref.ids[2]
    assert ref.cached_ids[:SHARED_PREFIX] == first[:SHARED_PREFIX] and ref.cached_ids[SHARED_PREFIX] != first[SHARED_PREFIX]
    table = _pages_for(free, len(first) + NEW_TOKENS)
    runner.forward([SeqChunk(first, 0, table)])
    shared = table[: SHARED_PREFIX // PAGE]
    slots = torch.tensor([p * PAGE + o for p in shared for o in range(PAGE)])
    before = runner.kv.tensor[:, :, :, slots].clone()
    own = shared + _pages_for(free, len(ref.cached_ids) + NEW_TOKENS - SHARED_PREFIX)
    out = runner.forward([SeqChunk(ref.cached_ids[SHARED_PREFIX:], SHARED_PREFIX, own, logits="all")])
    _close(out.all_logits[0], ref.cached_logits[SHARED_PREFIX : len(ref.cached_ids)], f"{arch} {mode} extension")
    assert torch.equal(runner.kv.tensor[:, :, :, slots], before), "the extension wrote into the shared pages"
    # and it decodes on from there, beside the sequence whose pages it shares
    n = len(ref.cached_ids)
    for step in range(4):
        got = runner.forward([SeqChunk([ref.cached_greedy[step]], n + step, own),
                              SeqChunk([ref.greedy[2][step]], len(first) + step, table)]).last_logits
        _close(got[0], ref.cached_logits[n + step], f"{arch} {mode} decode after the hit, step {step}")
        _close(got[1], ref.logits[2][len(first) + step], f"{arch} {mode} decode of the cached prompt, step {step}")


# -- the offline engine --------------------------------------------------------------------------

def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_offline_greedy_32_tokens_and_a_cache_hit(arch, refs):
    """`bullet.LLM` (the scheduler, chunked prefill and continuous batching of the servers' unified
    loop): every prompt's 32 greedy tokens equal transformers', with their log-probabilities; then
    CACHED, after PROMPTS[2] finished, is served from the prefix cache, its first two pages reused."""
    import bullet

    ref = refs[arch]
    llm = bullet.LLM(str(ref.path), dtype="float32", max_total_tokens=1024, page_size=PAGE, prefix_cache=True)
    assert llm.config.architecture == arch
    assert (llm.config.qkv_bias, llm.config.qk_norm, llm.config.is_moe) == (arch == QWEN2, arch in (QWEN3, MOE), arch == MOE)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True}
    outs = llm.generate(PROMPTS, params)
    assert [o.prompt_ids for o in outs] == ref.ids
    assert [o.output_ids for o in outs] == ref.greedy
    (hit,) = llm.generate([CACHED], params)
    assert hit.cached_tokens == SHARED_PREFIX
    assert hit.output_ids == ref.cached_greedy
    for o, i, logits in [*zip(outs, ref.ids, ref.logits), (hit, ref.cached_ids, ref.cached_logits)]:
        want = _logprobs(logits[len(i) - 1 : len(i) - 1 + NEW_TOKENS]).gather(1, torch.tensor(o.output_ids)[:, None])[:, 0]
        err = float((torch.tensor(o.output_logprobs, dtype=torch.float64) - want).abs().max())
        print(f"{arch} offline ({o.cached_tokens} tokens cached): {len(o.output_ids)} greedy tokens equal, "
              f"log-probabilities within {err:.3g}")
        assert err <= TOL, f"{arch}: chosen tokens' log-probabilities differ by {err:.3g}"


# -- Qwen3-MoE: the router's picks, and both worker processes -------------------------------------

def test_moe_routing_equals_transformers(refs):
    """In every layer, every token (the prompts and their greedy tokens) goes to the same experts, in
    the same order, with the same weights, as in transformers' `Qwen3MoeTopKRouter`; and no pick is
    a near-tie (the k-th and the next expert's router logits lie further apart than float noise
    could move them)."""
    ref = refs[MOE]
    sequences = [i + g for i, g in zip(ref.ids, ref.greedy)]
    theirs: dict[int, list] = {}
    # (a forward hook that returns something replaces the module's output: these return None)
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, n=n: theirs.setdefault(n, []).append(out))
             for n, layer in enumerate(ref.model.model.layers)]
    try:
        for s in sequences:
            _forward(ref.model, s)
    finally:
        for h in hooks:
            h.remove()

    runner = _runner(ref, "gather")
    ours: dict[int, tuple] = {}
    for n, layer in enumerate(runner.model.layers):
        moe = layer.moe
        moe.router.register_forward_hook(lambda m, a, out, n=n: ours.setdefault(n, []).append(out))
        moe.experts.register_forward_pre_hook(lambda m, args, n=n: ours[n].extend(args[1:]))
    free = _scattered_pages(2)
    runner.forward([SeqChunk(s, 0, _pages_for(free, len(s))) for s in sequences])

    k, experts = runner.model.config.num_experts_per_tok, runner.model.config.num_experts
    assert sorted(ours) == sorted(theirs) == list(range(runner.model.config.num_hidden_layers))
    for n in sorted(ours):
        logits, weights, ids = (torch.cat(x) for x in zip(*theirs[n]))
        our_logits, our_weights, our_ids = ours[n]
        assert our_ids.shape == ids.shape == (sum(map(len, sequences)), k)
        ranked = logits.sort(-1, descending=True).values  # the softmax keeps the logits' order
        assert float((ranked[:, k - 1] - ranked[:, k]).min()) > 2 * TOL, f"layer {n}: a near-tie among the picks"
        assert torch.equal(our_ids, ids), f"layer {n}: {int((our_ids != ids).any(-1).sum())} tokens routed differently"
        d_weights, d_logits = float((our_weights - weights).abs().max()), float((our_logits - logits).abs().max())
        print(f"layer {n}: {len(ids)} tokens routed alike; router logits within {d_logits:.3g}, weights {d_weights:.3g}")
        assert d_weights <= TOL and d_logits <= TOL
        assert set(ids.flatten().tolist()) == set(range(experts))  # every expert in play: not a trivial check


@pytest.mark.slow  # a server start: ~10-20 s on two cores
def test_served_moe_tokens_and_log_probabilities(refs):
    """`bullet launch` on the Qwen3-MoE checkpoint (prefill and decode workers, each its own process
    with the experts): each prompt's 32 greedy tokens equal transformers', and the log-probabilities
    it returns — prompt (the prefill worker), first token (prefill) and the 31 after (decode), with
    the top 20 at each — within TOL of transformers' (log-probabilities are the logits less one
    logsumexp: equal logits give equal log-probabilities)."""
    from tests.server_utils import ServerProcess

    ref = refs[MOE]
    with ServerProcess("--model-path", str(ref.path), "--dtype", "float32", "--max-total-tokens", "1024",
                       "--policy", "static") as server:
        status, body = server.post("/generate", {
            "text": PROMPTS, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert status == 200, body
    assert [b["output_ids"] for b in body] == ref.greedy
    worst = 0.0
    for b, i, g, logits in zip(body, ref.ids, ref.greedy, ref.logits):
        meta, lp = b["meta_info"], _logprobs(logits)
        prompt = meta["input_token_logprobs"]
        assert [t for _, t, _ in prompt] == i and prompt[0][0] is None
        rows = [(lp[j - 1], v, t) for j, (v, t, _) in enumerate(prompt) if j]  # prompt token j given those before
        rows += [(lp[len(i) - 1 + j], v, t) for j, (v, t, _) in enumerate(meta["output_token_logprobs"])]
        assert [t for _, _, t in rows] == i[1:] + g
        for want, got, token in rows:
            worst = max(worst, abs(float(want[token]) - got))
        for j, top in enumerate(meta["output_top_logprobs"]):
            want = lp[len(i) - 1 + j]
            values = [v for v, _, _ in top]
            worst = max(worst, max(abs(float(want[t]) - v) for v, t, _ in top),
                        float((torch.tensor(values, dtype=torch.float64) - want.topk(20).values).abs().max()))
    print(f"served Qwen3-MoE log-probabilities vs transformers': max |difference| {worst:.3g}")
    assert worst <= TOL, f"served log-probabilities differ from transformers' by {worst:.3g}"
