"""The paged path (attention through page tables, the GPU's) against the gather path (the CPU's):
the torch reference of the paged kernels on random pools, then whole engines running the real model."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from bullet.llm import OfflineEngine
from bullet.types.finish import FinishChecker
from engines.kv_pool import KVPool
from engines.model.paged_attention import TorchPagedKernels, build_tables, kernels_for, split_mixed
from engines.runner import ModelRunner
from engines.sampling_params import SamplingParams
from tests.engines.conftest import PROMPTS


def random_pool(kvh=2, d=16, pages=40, page_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(kvh, pages * page_size, d, generator=g), torch.randn(kvh, pages * page_size, d, generator=g))


def dense_attention(q, k, v, n_ctx, scale):
    """q: [n_q, H, D] the last n_q positions of a context of n_ctx keys k/v [KVH, n_ctx, D]."""
    n_q = q.shape[0]
    rows = torch.arange(n_ctx - n_q, n_ctx)[:, None]
    mask = torch.arange(n_ctx)[None, :] <= rows
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 1, 9], [3]])
def test_reference_matches_dense_attention_over_shuffled_pages(q_lens):
    ps, heads, kvh, d = 4, 6, 2, 16
    k_cache, v_cache = random_pool(kvh, d, pages=40, page_size=ps)
    rng = random.Random(len(q_lens))
    free = list(range(40))
    rng.shuffle(free)
    ctx_lens = [q + rng.randrange(0, 17) for q in q_lens]  # a cached prefix of 0..16 tokens before the new ones
    tables = [[free.pop() for _ in range(-(-n // ps))] for n in ctx_lens]
    q = torch.randn(sum(q_lens), heads, d)
    t = build_tables(tables, ctx_lens, q_lens, ps, "cpu", width=8)
    out = TorchPagedKernels().extend(q, k_cache, v_cache, t, 0.25)
    start = 0
    for pages, n_ctx, n_q in zip(tables, ctx_lens, q_lens):
        slots = torch.tensor([p * ps + o for p in pages for o in range(ps)])[:n_ctx]
        want = dense_attention(q[start:start + n_q], k_cache[:, slots], v_cache[:, slots], n_ctx, 0.25)
        torch.testing.assert_close(out[start:start + n_q], want, atol=1e-5, rtol=1e-5)
        start += n_q


def test_tables_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="holds 1"):
        build_tables([[0, 1]], [8], [1], 4, "cpu", width=1)
    with pytest.raises(ValueError, match="fewer than"):
        build_tables([[0]], [8], [1], 4, "cpu")


def test_kernel_choice(monkeypatch):
    assert kernels_for("cpu").name == "torch"
    monkeypatch.setenv("BULLET_ATTENTION_KERNELS", "bogus")
    with pytest.raises(ValueError, match="BULLET_ATTENTION_KERNELS"):
        kernels_for("cpu")


def test_engine_on_page_tables_generates_what_the_gather_path_does(llm32):
    """Continuous batching with chunked prompts (a chunk attends to its cached prefix), mixed
    prefill/decode steps and plain decode steps: greedy outputs equal the gather path's."""
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    outputs = {}
    for paged in (False, True):
        runner = ModelRunner(llm32.runner.model, KVPool(llm32.config, 128, 16, llm32.dtype), paged=paged)
        finish = FinishChecker(llm32.tokenizer, llm32.tokenizer.eos_token_ids, llm32.config.max_position_embeddings)
        eng = OfflineEngine(runner, finish, 48, 64)  # a 48-token budget chunks the long prompts
        reqs = [eng.add_request(llm32.tokenizer.encode(p), params) for p in PROMPTS[:4]]
        while eng.has_work():
            eng.step()
        outputs[paged] = [r.output_ids for r in reqs]
    assert outputs[True] == outputs[False]


def test_paged_step_of_fresh_prompts_takes_sdpa_and_any_cached_prefix_the_kernels():
    """On the paged path a step whose sequences are all fresh prompts attends with SDPA over its new
    K/V (no kernel call); a step where some sequence has cached tokens goes to `extend`. Both equal
    the reference."""
    from engines.forward_context import ForwardContext
    from engines.model.attention import paged_attention, write_kv

    class Recording(TorchPagedKernels):
        calls: list = []

        def extend(self, *args, **kwargs):
            self.calls.append("extend")
            return super().extend(*args, **kwargs)

    ps, heads, kvh, d = 4, 6, 2, 16
    for ctx_lens, want_calls in (([3, 5], []), ([3, 9], ["extend"])):
        q_lens = [3, 5]
        k_cache, v_cache = random_pool(kvh, d, pages=8, page_size=ps)
        tables = [[0, 1], [2, 3, 4]]
        slots = torch.tensor([pages[pos // ps] * ps + pos % ps for pages, n_q, n in zip(tables, q_lens, ctx_lens)
                              for pos in range(n - n_q, n)])  # the new tokens' slots
        q, k, v = torch.randn(8, heads, d), torch.randn(8, kvh, d), torch.randn(8, kvh, d)
        write_kv(k_cache, v_cache, k, v, slots)
        ctx = ForwardContext(positions=torch.zeros(8, dtype=torch.long), slot_mapping=slots, q_lens=q_lens,
                             ctx_lens=ctx_lens, paged=build_tables(tables, ctx_lens, q_lens, ps, "cpu"),
                             kernels=Recording())
        Recording.calls = []
        out = paged_attention(q, k, v, k_cache, v_cache, ctx, 0.25)
        assert Recording.calls == want_calls
        torch.testing.assert_close(out, TorchPagedKernels().extend(q, k_cache, v_cache, ctx.paged, 0.25),
                                   atol=1e-5, rtol=1e-5)


def mixed_step(q_lens, ctx_lens, heads=6, kvh=2, d=16, ps=4, seed=0):
    """A step's q, K/V pool (new tokens written) and page tables, each sequence on shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // ps) for n in ctx_lens]
    free = list(range(sum(need) + 2))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    k_cache, v_cache = random_pool(kvh, d, pages=sum(need) + 2, page_size=ps, seed=seed)
    slots = torch.tensor([pages[pos // ps] * ps + pos % ps for pages, n_q, n in zip(tables, q_lens, ctx_lens)
                          for pos in range(n - n_q, n)])
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kvh, kvh))
    return q, k, v, k_cache, v_cache, slots, tables


@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([5, 3, 1, 1], [9, 3, 7, 12]),  # chunks first, decode rows after: two slices
    ([1, 5, 1, 1, 4], [6, 13, 1, 9, 4]),  # interleaved: decode rows gathered, chunks gathered
    ([1, 1, 6], [8, 5, 6]),  # decode rows first
])
def test_a_mixed_step_runs_decode_rows_on_the_decode_kernel(q_lens, ctx_lens):
    """In a step that mixes decode rows with longer chunks, the decode kernel takes every one-token
    sequence and extend the rest (extend over all of them gave each decode row a whole query block);
    the output is the reference's over the whole step, whatever the rows' order."""
    from engines.forward_context import ForwardContext
    from engines.model.attention import paged_attention, write_kv

    class Recording(TorchPagedKernels):
        calls: list = []

        def decode(self, q, k, v, tables, scale, out=None):
            self.calls.append(("decode", tables.seq_lens.tolist()))
            return self.extend(q, k, v, tables, scale, out, record=False)

        def extend(self, q, k, v, tables, scale, out=None, record=True):
            if record:
                self.calls.append(("extend", tables.seq_lens.tolist()))
            return super().extend(q, k, v, tables, scale, out)

    ps = 4
    q, k, v, k_cache, v_cache, slots, tables = mixed_step(q_lens, ctx_lens, ps=ps)
    write_kv(k_cache, v_cache, k, v, slots)
    parts = split_mixed(tables, ctx_lens, q_lens, ps, "cpu")
    # as the runner builds it: the parts' own tables, no whole-step tables beside them
    ctx = ForwardContext(positions=torch.zeros(len(slots), dtype=torch.long), slot_mapping=slots, q_lens=q_lens,
                         ctx_lens=ctx_lens, paged_parts=parts, kernels=Recording())
    Recording.calls = []
    out = paged_attention(q, k, v, k_cache, v_cache, ctx, 0.25)
    assert Recording.calls == [("decode", [c for n, c in zip(q_lens, ctx_lens) if n == 1]),
                               ("extend", [c for n, c in zip(q_lens, ctx_lens) if n != 1])]
    whole = build_tables(tables, ctx_lens, q_lens, ps, "cpu")
    torch.testing.assert_close(out, TorchPagedKernels().extend(q, k_cache, v_cache, whole, 0.25),
                               atol=1e-5, rtol=1e-5)


def test_only_a_step_of_both_kinds_is_split():
    assert split_mixed([[0], [1]], [3, 4], [1, 1], 4, "cpu") is None  # all decode: the decode kernel already
    assert split_mixed([[0], [1]], [3, 4], [3, 2], 4, "cpu") is None  # no decode row
    decode, extend = split_mixed([[0, 1], [2]], [6, 4], [1, 4], 4, "cpu")
    assert decode.decode and decode.rows == slice(0, 1) and not extend.decode and extend.rows == slice(1, 5)
    assert extend.tables.q_starts.tolist() == [0, 4] and extend.tables.page_table.tolist() == [[2]]


def test_a_gpu_runner_keeps_prompt_attention_off_cudnn(llm32, monkeypatch):
    """cuDNN's SDPA builds a graph per new prompt length (50-70 ms each on an H200): a runner on a GPU
    allows every other backend, once per layer group; on a CPU torch chooses. Checked through the
    runner's own path on the CPU model: the flags SDPA sees while the layers run."""
    from torch.nn.attention import SDPBackend

    from engines.runner import PROMPT_ATTENTION_BACKENDS, SeqChunk, prompt_attention_backends
    assert prompt_attention_backends(torch.device("cuda", 0)) == PROMPT_ATTENTION_BACKENDS
    assert SDPBackend.CUDNN_ATTENTION not in PROMPT_ATTENTION_BACKENDS
    assert SDPBackend.FLASH_ATTENTION in PROMPT_ATTENTION_BACKENDS and SDPBackend.MATH in PROMPT_ATTENTION_BACKENDS
    assert prompt_attention_backends(torch.device("cpu")) is None

    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids = llm32.tokenizer.encode(PROMPTS[0])
    logits = {}
    for backends in (None, PROMPT_ATTENTION_BACKENDS):
        runner = ModelRunner(llm32.runner.model, KVPool(llm32.config, 64, 16, llm32.dtype), paged=False)
        assert runner.sdpa_backends is None  # a CPU runner's default
        runner.sdpa_backends = backends
        logits[backends is None] = runner.forward([SeqChunk(ids, 0, list(range(-(-len(ids) // 16))))]).last_logits
    assert seen and seen.count(True) == seen.count(False) == len(seen) // 2  # torch's choice, then cuDNN off
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each group
    torch.testing.assert_close(logits[True], logits[False])
