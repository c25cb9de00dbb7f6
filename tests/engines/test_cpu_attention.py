"""The `cpu` paged kernels (engines.model.cpu_attention, the engines._cpu_attention C kernel): every
implementation this build and CPU run agrees with the torch reference on ragged contexts, mixed steps
and every pool dtype; a row's output does not depend on the batch; bad tables are refused by the C
side; `kernels_for` picks them for float32 queries on a CPU; the runner pages the int8 model through
them and leaves the fp32 reference on its gather path, bit for bit.

Run on the narrower code too: `BULLET_CPU_ATTENTION_ISA=avx2 python setup.py build_ext --inplace`
builds without AVX-512 (then `_ext.compiled_isa() == 1` and only the AVX2 and portable paths run)."""

from __future__ import annotations

import pytest
import torch

from engines.kv_pool import KVPool
from engines.model import cpu_attention as ca
from engines.model.paged_attention import KERNELS_ENV, TorchPagedKernels, build_tables, kernels_for
from engines.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.skipif(ca._ext is None, reason="engines._cpu_attention is not built")

KVH, HEADS, D, PS, PAGES = 3, 9, 64, 16, 160
CONTEXTS = [1, 15, 16, 17, 95, 300, 523]
ISAS = range(ca.kernel_isa() + 1) if ca._ext is not None else []


def _pool(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(KVH, PAGES * PS, D, generator=g) * 2).to(dtype)
    v = torch.randn(KVH, PAGES * PS, D, generator=g).to(dtype)
    perm = torch.randperm(PAGES, generator=g).tolist()
    tables, used = [], 0
    for n in CONTEXTS:
        m = -(-n // PS)
        tables.append(perm[used : used + m])
        used += m
    return k, v, tables


def test_the_build_runs_only_what_the_cpu_has():
    assert ca._ext.best_isa() <= ca._ext.compiled_isa()
    flags = open("/proc/cpuinfo").read().split("\n\n")[0]
    if ca._ext.best_isa() == ca.ISA_AVX512:
        assert " avx512f" in flags and " avx512bw" in flags and " avx512vl" in flags
    if ca._ext.best_isa() >= ca.ISA_AVX2:
        assert " avx2" in flags and " fma" in flags and " f16c" in flags
    with pytest.raises(ValueError, match="lacks"):  # asked for more than the CPU or build has: refused
        k, v, tables = _pool(torch.float32)
        ca.CpuPagedKernels(isa=ca._ext.best_isa() + 1).decode(
            torch.zeros(1, HEADS, D), k, v, build_tables(tables[:1], CONTEXTS[:1], [1], PS, "cpu"), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_implementation_matches_the_reference_on_a_mixed_step(dtype):
    """Decode rows (one new token) and chunks after a cached prefix in one step: `extend`."""
    k, v, tables = _pool(dtype)
    q_lens = [1, 1, 5, 1, 16, 1, 1]  # chunks of 5 and 16 new tokens among decode rows
    tabs = build_tables(tables, CONTEXTS, q_lens, PS, "cpu")
    # q is a view with rows further apart than H x D, as the layer's fused QKV output gives it
    qkv = torch.randn(sum(q_lens), HEADS + 2 * KVH, D, generator=torch.Generator().manual_seed(1))
    q = qkv[:, :HEADS]
    ref = TorchPagedKernels().extend(q.contiguous(), k, v, tabs, 0.125)
    for isa in ISAS:
        out = ca.CpuPagedKernels(isa).extend(q, k, v, tabs, 0.125)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=f"implementation {isa}")
        dec = ca.CpuPagedKernels(isa).decode(q, k, v, tabs, 0.125, torch.full(q.shape, 7.0))
        rows = tabs.q_starts[:-1][torch.tensor(q_lens) == 1].long()
        torch.testing.assert_close(dec[rows], ref[rows], atol=2e-5, rtol=1e-4)
        others = torch.ones(q.shape[0], dtype=torch.bool)
        others[rows] = False
        assert (dec[others] == 7).all()  # decode leaves the chunks' rows alone


def test_a_row_is_bit_identical_alone_and_batched():
    k, v, tables = _pool(torch.float32)
    b = len(CONTEXTS)
    q = torch.randn(b, HEADS, D, generator=torch.Generator().manual_seed(2))
    kern = ca.CpuPagedKernels()
    batched = kern.decode(q, k, v, build_tables(tables, CONTEXTS, [1] * b, PS, "cpu"), 0.1)
    for i in range(b):
        alone = kern.decode(q[i : i + 1], k, v, build_tables([tables[i]], [CONTEXTS[i]], [1], PS, "cpu"), 0.1)
        assert torch.equal(alone[0], batched[i])


# (heads, KV heads, head dim, page size): the model's shape; eight query heads per KV head and wide heads
# over small pages (several pages per block of 16 keys); one KV head per query head over large pages;
# twelve per KV head (past the specialised group sizes: 4 rows per block) over pages of one token
SHAPES = [(9, 3, 64, 16), (16, 2, 128, 4), (4, 4, 32, 64), (12, 1, 16, 1)]


@pytest.mark.parametrize("heads,kvh,d,ps", SHAPES)
def test_a_prompt_row_is_a_decode_row_whatever_its_chunk(heads, kvh, d, ps):
    """`extend` attends every row of a chunk as a decode row at its place: each row equals the
    reference, and equals to the bit the row computed alone as a decode row over its prefix, and the
    same chunk cut in two — whatever the ISA, the pool's dtype or the shape."""
    g = torch.Generator().manual_seed(4)
    n = 75  # a fresh prompt of n tokens, then the same context as a chunk of 41 after 34 cached
    pages = -(-n // ps)
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(kvh, (pages + 1) * ps, d, generator=g).to(dtype)
        v = torch.randn(kvh, (pages + 1) * ps, d, generator=g).to(dtype)
        table = torch.randperm(pages + 1, generator=g)[:pages].tolist()
        q = torch.randn(n, heads, d, generator=g)
        fresh = build_tables([table], [n], [n], ps, "cpu")
        ref = TorchPagedKernels().extend(q, k, v, fresh, 0.125)
        for isa in ISAS:
            kern = ca.CpuPagedKernels(isa)
            whole = kern.extend(q, k, v, fresh, 0.125)
            torch.testing.assert_close(whole, ref, atol=2e-5, rtol=1e-4, msg=f"implementation {isa}")
            rows = [34, 35, 50, 74] if isa else range(n)
            alone = torch.cat([kern.decode(q[j : j + 1], k, v, build_tables([table], [j + 1], [1], ps, "cpu"), 0.125)
                               for j in rows])
            assert torch.equal(whole[list(rows)], alone), f"implementation {isa}, {dtype}"
            # the prompt's first 34 rows, then its other 41 after them (a prefix cache hit), in one step
            # beside a decode row of another sequence
            cut = build_tables([table, table], [34, n], [34, n - 34], ps, "cpu")
            parts = kern.extend(q, k, v, cut, 0.125)
            assert torch.equal(parts, whole), f"implementation {isa}, {dtype}"
            mixed = build_tables([table, table], [50, n], [1, n - 34], ps, "cpu")
            got = kern.extend(torch.cat([q[49:50], q[34:]]), k, v, mixed, 0.125)
            assert torch.equal(got[0], whole[49]) and torch.equal(got[1:], whole[34:])


def test_bad_tables_are_refused_before_the_kernel_runs():
    k, v, _ = _pool(torch.float32)
    kern, q = ca.CpuPagedKernels(), torch.zeros(1, HEADS, D)
    with pytest.raises(ValueError, match="page past the pool"):
        kern.decode(q, k, v, build_tables([[PAGES, 1]], [20], [1], PS, "cpu"), 0.1)
    with pytest.raises(ValueError, match="past the batch"):
        kern.decode(q, k, v, build_tables([[1], [2]], [3, 3], [1, 1], PS, "cpu"), 0.1)
    short = build_tables([[1, 2]], [20], [1], PS, "cpu")
    short.seq_lens[0] = 40  # a context longer than its table row
    with pytest.raises(ValueError, match="more pages"):
        kern.decode(q, k, v, short, 0.1)
    with pytest.raises(ValueError, match="float32"):
        kern.decode(q.bfloat16(), k, v, build_tables([[1, 2]], [20], [1], PS, "cpu"), 0.1)


def test_kernels_for_a_cpu(monkeypatch):
    assert kernels_for("cpu", torch.float32, torch.float16).name == ("cpu" if ca.kernel_isa() else "torch")
    assert kernels_for("cpu", torch.bfloat16, torch.bfloat16).name == "torch"
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert kernels_for("cpu", torch.float32, torch.float32).name == "torch"
    monkeypatch.setenv(KERNELS_ENV, "cpu")
    with pytest.raises(RuntimeError, match="does not serve"):
        kernels_for("cpu", torch.bfloat16, torch.bfloat16)


def _small_model(quantized: bool):
    from engines.model.build import build_model
    from engines.model_config import ModelConfig
    from engines.quant import quantize_state
    from engines.weights.dummy import dummy_weights

    config = ModelConfig(name="small", hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, vocab_size=300,
                         max_position_embeddings=1024)
    state = dummy_weights(config, torch.float32, seed=3)
    return config, build_model(config, quantize_state(config, state) if quantized else state)


PROMPTS = [[(7 * i) % 299 + 1 for i in range(50)], [(5 * i) % 299 + 1 for i in range(17)], [11]]
TABLES = [list(range(0, 4)), list(range(4, 6)), [6]]


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill, a decode step, then a mixed step (two decode rows and a chunk after its prefix)."""
    runner.forward([SeqChunk(p, 0, t, "none") for p, t in zip(PROMPTS, TABLES)])
    out = [runner.forward([SeqChunk([42], len(p), t) for p, t in zip(PROMPTS, TABLES)]).last_logits]
    mixed = [SeqChunk([43], len(PROMPTS[0]) + 1, TABLES[0]), SeqChunk([44, 45, 46], len(PROMPTS[1]) + 1, TABLES[1]),
             SeqChunk([47], len(PROMPTS[2]) + 1, TABLES[2])]
    out.append(runner.forward(mixed).last_logits)
    return out


@pytest.mark.skipif(ca._ext is not None and ca.kernel_isa() == ca.ISA_GENERIC, reason="no vector kernel on this CPU")
def test_the_int8_model_pages_through_the_kernel_and_float_models_keep_the_gather(monkeypatch):
    """A small random Llama (head dim 64, GQA 3:1). In float32, paged through the kernel (prompts,
    decode rows, a mixed step as two parts or as one), its logits equal the gather path's to 1e-5: the
    kernel's tables and rows are wired right. Quantized as the server quantizes the GGUF, it pages
    through the kernel by default and stays near the gather path — within 2e-2 at logits of ~0.9, not
    1e-5: its activations are rounded to 8 bits per token, and an attention output that differs in its
    last bits (the kernel's sums run in another order than SDPA's) can round an activation one step the
    other way; over a float16 pool (--kv-cache-dtype) too."""
    config, fp32 = _small_model(quantized=False)
    reference = _steps(ModelRunner(fp32, KVPool(config, 64, PS, torch.float32), paged=False))
    for split in (True, False):
        paged = ModelRunner(fp32, KVPool(config, 64, PS, torch.float32), paged=True, kernels=ca.CpuPagedKernels())
        paged.split_mixed = split
        for got, want in zip(_steps(paged), reference):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    config, model = _small_model(quantized=True)
    kernel = ModelRunner(model, KVPool(config, 64, PS, torch.float32))
    gather = ModelRunner(model, KVPool(config, 64, PS, torch.float32), paged=False)
    assert kernel.paged and kernel.kernels.name == "cpu" and not gather.paged
    reference = _steps(gather)
    for got, want in zip(_steps(kernel), reference):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    # the mixed step ran as two parts (decode rows, the chunk), each with its own tables and no
    # whole-step tables beside them; one extend over every row gives the same logits, to the bit
    _, ctx = kernel._context([SeqChunk([43], 51, TABLES[0]), SeqChunk([44, 45], 18, TABLES[1])])
    assert ctx.paged is None and [p.decode for p in ctx.paged_parts] == [True, False]
    whole = ModelRunner(model, KVPool(config, 64, PS, torch.float32))
    whole.split_mixed = False
    for got, want in zip(_steps(whole), _steps(kernel)):
        assert torch.equal(got, want)
    assert whole._context([SeqChunk([43], 51, TABLES[0]), SeqChunk([44, 45], 18, TABLES[1])])[1].paged_parts is None
    half = ModelRunner(model, KVPool(config, 64, PS, torch.float16))
    assert half.kernels.name == "cpu"
    for got, want in zip(_steps(half), reference):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
    monkeypatch.setenv(KERNELS_ENV, "torch")  # the reference kernels are slower than the gather: not paged
    assert not ModelRunner(model, KVPool(config, 64, PS, torch.float32)).paged


def test_the_fp32_model_keeps_its_gather_path_bit_for_bit():
    """The exact fp32 mode: not paged by default, and the same logits to the bit as a runner told not to page."""
    config, model = _small_model(quantized=False)
    default = ModelRunner(model, KVPool(config, 64, PS, torch.float32))
    assert not default.paged and default.kernels is None
    explicit = ModelRunner(model, KVPool(config, 64, PS, torch.float32), paged=False)
    for got, want in zip(_steps(default), _steps(explicit)):
        assert torch.equal(got, want)
    # a float16 pool under a float model: gathered and widened to the model's dtype, finite
    half = ModelRunner(model, KVPool(config, 64, PS, torch.float16))
    assert not half.paged and all(torch.isfinite(x).all() for x in _steps(half))


def test_kv_cache_dtype_names():
    from engines.device import resolve_kv_dtype

    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="fp8"):
        resolve_kv_dtype("fp8_e5m2", torch.float32)
