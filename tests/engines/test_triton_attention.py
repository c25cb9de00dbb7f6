"""The Triton paged-attention kernels against the torch reference (`TorchPagedKernels`).

Without a GPU they run on CPU tensors under Triton's interpreter: `tests/conftest.py` sets
TRITON_INTERPRET=1 before any test module can import triton (Triton reads it when it decorates its
kernels, its own library's included). With a GPU the same cases run compiled on CUDA tensors, and
the `gpu` tests add the model's real sizes and a CUDA-graph replay. The interpreter is slow (tens of
ms per program), so the cases are small but cover what differs between kernels: ragged contexts,
page sizes 1/16/64, contexts of exactly a page and not a multiple of a block, cached prefixes,
1-token rows mixed with long extends, GQA groups 1..8, several decode splits, each dtype."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it, on Linux)")

from engines.kv_pool import KVPool  # noqa: E402
from engines.model import triton_attention as ta  # noqa: E402
from engines.model.paged_attention import PagedTables, TorchPagedKernels, build_tables  # noqa: E402


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
if not GPU and not ta.INTERPRETED:
    pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it before any test "
                "module imports triton): its kernels cannot run on CPU tensors", allow_module_level=True)
if not GPU and _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4):
    pytest.skip(f"triton {triton.__version__}'s interpreter fails under numpy {np.__version__} "
                "(triton-lang/triton#9171, fixed in 3.7): use triton >= 3.7 or numpy < 2.4", allow_module_level=True)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
ROOT = Path(__file__).resolve().parents[2]


def make_case(q_lens, ctx_lens, heads, kv_heads, dim, page_size, dtype, seed=0, spare_pages=3):
    """q for the new tokens, a two-layer pool laid out like KVPool's (each layer's K and V are
    strided views of one tensor) with shuffled pages, and the step's tables (one spare column)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in ctx_lens]
    num_pages = sum(need) + spare_pages
    pool = torch.randn(2, 2, kv_heads, num_pages * page_size, dim, generator=g).to(dtype).to(DEVICE)
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    pages = [[free.pop() for _ in range(n)] for n in need]
    tables = build_tables(pages, ctx_lens, q_lens, page_size, DEVICE, width=max(need, default=0) + 1)
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype).to(DEVICE)
    return q, pool[1, 0], pool[1, 1], tables


def check(kind, q_lens, ctx_lens, heads, kv_heads, dim, page_size, dtype, num_splits=None, seed=0):
    q, k, v, tables = make_case(q_lens, ctx_lens, heads, kv_heads, dim, page_size, dtype, seed)
    scale = dim ** -0.5
    want = TorchPagedKernels().extend(q, k, v, tables, scale)
    got = getattr(ta.TritonPagedKernels(num_splits), kind)(q, k, v, tables, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_ragged_contexts_gqa4(num_splits):
    # a 1-token context, exactly one page, not a multiple of the 64-key block, two blocks and a bit
    check("decode", [1] * 4, [1, 16, 70, 129], 8, 2, 64, 16, torch.float32, num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_smollm2_heads_page_size_1(dtype):
    check("decode", [1, 1], [5, 100], 9, 3, 64, 1, dtype)


def test_decode_llama_head_dim_and_group_page_size_64():
    check("decode", [1, 1], [64, 65], 8, 2, 128, 64, torch.bfloat16, num_splits=2)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 1)])
def test_decode_group_sizes_1_and_8(heads, kv_heads):
    check("decode", [1, 1, 1], [3, 40, 17], heads, kv_heads, 64, 16, torch.float32, num_splits=2)


def test_decode_empty_row_gives_zeros():
    """A row with no context (a padded batch slot) comes out zero, not NaN, in either write path."""
    for splits in (1, 2):
        q, k, v, tables = make_case([1, 1], [0, 20], 4, 2, 64, 16, torch.float32)
        out = ta.TritonPagedKernels(splits).decode(q, k, v, tables, 0.125)
        assert torch.all(out[0] == 0) and torch.isfinite(out).all()


def test_extend_mixes_decode_rows_prefills_and_cached_prefixes():
    # a fresh prompt, a 1-token row after 39 cached tokens, a 9-token chunk after 21
    check("extend", [5, 1, 9], [5, 40, 30], 8, 2, 64, 16, torch.float32)


@pytest.mark.parametrize("q_lens, ctx_lens", [([9, 1, 1, 1], [30, 40, 17, 64]), ([1, 70, 1], [33, 100, 65])])
def test_a_mixed_step_splits_decode_rows_from_chunks(q_lens, ctx_lens):
    """The runner's split of a mixed step (`split_mixed`): the decode kernel on the one-token rows
    (views of q and out, or gathered where they lie apart), extend on the chunks; the whole step
    equals the reference's extend over every row."""
    from engines.model.attention import _paged_parts
    from engines.model.paged_attention import split_mixed

    dtype, page_size = torch.bfloat16, 16
    q, k, v, tables = make_case(q_lens, ctx_lens, 8, 2, 64, page_size, dtype)
    pages = [tables.page_table[b, : -(-n // page_size)].tolist() for b, n in enumerate(ctx_lens)]
    parts = split_mixed(pages, ctx_lens, q_lens, page_size, DEVICE)
    assert [p.decode for p in parts] == [True, False]

    class Ctx:  # what _paged_parts reads of a ForwardContext
        paged_parts, kernels = parts, ta.TritonPagedKernels()

    got = _paged_parts(q, k, v, Ctx, 0.125)
    want = TorchPagedKernels().extend(q, k, v, tables, 0.125)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_extend_query_blocks_and_prefix_fp32():
    """fp32 takes 32-row query blocks: 70 new tokens span three, after a 30-token prefix."""
    check("extend", [70, 1], [100, 9], 2, 1, 64, 4, torch.float32)


def test_extend_long_rows_bf16_block_128():
    """More than 64 new tokens in some row: the 128-row query blocks, GQA group 4."""
    check("extend", [1, 70], [33, 100], 4, 1, 64, 16, torch.bfloat16)


def test_extend_fp16_llama_dims_page_size_64():
    check("extend", [1, 33], [65, 64], 8, 2, 128, 64, torch.float16)


def test_extend_fresh_prompt_page_size_1():
    check("extend", [20], [20], 3, 3, 64, 1, torch.float32)


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_head_dim_not_a_power_of_two(kind):
    """D = 96 runs in a 128-wide tile with the extra lanes masked."""
    check(kind, [1, 1] if kind == "decode" else [1, 7], [9, 40], 4, 2, 96, 16, torch.float32, num_splits=2)


def test_out_buffer_is_filled_in_place():
    q, k, v, tables = make_case([1, 1], [10, 30], 4, 2, 64, 16, torch.float32)
    buf = torch.zeros(q.shape[0], q.shape[1] + 2, q.shape[2], device=DEVICE)
    out = buf[:, 1:-1]  # a strided view, as a caller's slice of a bigger buffer would be
    kernels = ta.TritonPagedKernels()
    assert kernels.decode(q, k, v, tables, 0.125, out=out) is out
    torch.testing.assert_close(out, TorchPagedKernels().decode(q, k, v, tables, 0.125), **TOL[torch.float32])
    assert torch.all(buf[:, 0] == 0) and torch.all(buf[:, -1] == 0)


def test_bad_shapes_are_refused():
    q, k, v, tables = make_case([1], [10], 4, 2, 64, 16, torch.float32)
    kernels = ta.TritonPagedKernels()
    with pytest.raises(ValueError, match="do not fit"):
        kernels.decode(q[:, :3], k, v, tables, 0.125)
    with pytest.raises(ValueError, match="out must be"):
        kernels.decode(q, k, v, tables, 0.125, out=torch.empty_like(q, dtype=torch.float16))
    with pytest.raises(ValueError, match="one query row per sequence"):
        kernels.decode(torch.cat([q, q]), k, v, tables, 0.125)
    with pytest.raises(ValueError, match="num_splits"):
        ta.TritonPagedKernels(num_splits=0)


def test_split_heuristic_matches_the_documented_cases():
    """The examples in triton_attention's docstring (Llama-3.1-8B: 8 KV heads; 132 SMs)."""
    assert ta.decode_splits(1, 8, 1024, 132) == 8
    assert ta.decode_splits(32, 8, 1024, 132) == 2
    assert ta.decode_splits(128, 8, 512, 132) == 1
    assert ta.decode_splits(1, 8, 128 * 1024, 132) == ta.MAX_SPLITS


def test_decode_launch_reads_no_device_value(monkeypatch):
    """What CUDA-graph capture needs: planning a decode launch (grid, scratch, arguments) never
    reads a tensor's contents on the host, and two steps of the same shapes plan the same launch."""
    q, k, v, tables = make_case([1] * 2, [90, 300], 8, 2, 64, 16, torch.float32)
    other = PagedTables(tables.page_table.flip(0), torch.tensor([1, 2], dtype=torch.int32, device=DEVICE),
                        tables.q_starts, tables.page_size, tables.max_q_len)
    out = torch.empty_like(q)

    def refuse(*args, **kwargs):
        raise AssertionError("a device value was read on the host")

    plans = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu"):
            m.setattr(torch.Tensor, name, refuse)
        for t in (tables, other):
            plans.append([(launch.grid, launch.constexprs, {n: tuple(a.shape) if isinstance(a, torch.Tensor) else a
                                                           for n, a in launch.args.items()})
                          for launch in ta.decode_launches(q, k, v, t, 0.125, out)])
    assert plans[0] == plans[1] and len(plans[0]) == 2  # this shape splits: a split kernel and a reduce


def _truncated_model(llm, layers):
    """The real SmolLM2 weights, first `layers` layers only: the interpreter is too slow for 30."""
    from engines.model.llama import LlamaModel

    model = LlamaModel(llm.config.model_copy(update={"num_hidden_layers": layers}))
    model.load_state_dict(llm.runner.model.state_dict(), strict=False)
    return model.to(llm.dtype).eval()


@pytest.mark.skipif(GPU, reason="the CUDA engine runs are the gpu-marked engine tests")
def test_engine_generates_what_the_gather_path_does(llm32):
    """Chunked prompts (the second chunk attends to its cached prefix through the extend kernel),
    mixed prefill/decode steps and decode steps: greedy tokens equal the gather path's."""
    from bullet.types.finish import FinishChecker
    from bullet.llm import OfflineEngine
    from engines.runner import ModelRunner
    from engines.sampling_params import SamplingParams
    from tests.engines.conftest import PROMPTS

    model = _truncated_model(llm32, 2)
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    prompts = [llm32.tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[4])]
    outputs = {}
    for kernels in (None, ta.TritonPagedKernels()):
        runner = ModelRunner(model, KVPool(model.config, 16, 16, llm32.dtype), paged=kernels is not None,
                             kernels=kernels)
        finish = FinishChecker(llm32.tokenizer, llm32.tokenizer.eos_token_ids, model.config.max_position_embeddings)
        eng = OfflineEngine(runner, finish, 40, 8)  # a 40-token budget chunks the long prompt
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_work():
            eng.step()
        outputs[kernels is not None] = [r.output_ids for r in reqs]
    assert outputs[True] == outputs[False]
    assert all(len(o) == 3 for o in outputs[True])


AOT_SCRIPT = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engines.model.paged_attention import PagedTables
    from engines.model.triton_attention import decode_launches, extend_launch
    TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32"}
    def signature(launch):
        return {n: "constexpr" if n in launch.constexprs else "*" + TYPES[a.dtype] if isinstance(a, torch.Tensor)
                else "fp32" if isinstance(a, float) else "i64"
                for n in launch.kernel.arg_names for a in [launch.args.get(n)]}
    for dtype, heads, kv_heads, dim, max_q in ((torch.bfloat16, 32, 8, 128, 512), (torch.float32, 9, 3, 64, 9)):
        meta = dict(device="meta")
        q = torch.empty(4, heads, dim, dtype=dtype, **meta)
        kv = torch.empty(kv_heads, 4096, dim, dtype=dtype, **meta)
        tables = PagedTables(torch.empty(4, 64, dtype=torch.int32, **meta), torch.empty(4, dtype=torch.int32, **meta),
                             torch.empty(5, dtype=torch.int32, **meta), 16, max_q)
        launches = [extend_launch(q, kv, kv, tables, 0.1, torch.empty_like(q))]
        if dtype == torch.bfloat16:
            launches += decode_launches(q, kv, kv, tables, 0.1, torch.empty_like(q), num_splits=4)
        for launch in launches:
            src = ASTSource(launch.kernel, signature(launch), launch.constexprs)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch.options)
            assert "cubin" in kernel.asm
            print(launch.kernel.__name__, dtype, kernel.metadata.shared)
""")


@pytest.mark.skipif(GPU, reason="on a GPU the kernels are compiled and run for real by the tests above")
def test_kernels_compile_for_hopper():
    """The interpreter checks numerics but not that Triton can lower the kernels: compile the
    production configurations (bf16 at Llama-3.1-8B's head shapes; the exact-fp32 path) to sm_90
    machine code, as on an H100/H200, in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset
    done = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert sum(line.startswith(("extend_kernel", "decode_split_kernel", "decode_reduce_kernel")) for line in lines) == 4
    for line in filter(None, lines):
        assert int(line.split()[-1]) <= 227 * 1024, line  # fits an H100's shared memory per block


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,context", [(1, 1024), (32, 1024), (128, 512), (3, 4097)])
def test_llama_shapes_on_cuda(batch, context):
    g = random.Random(batch)
    check("decode", [1] * batch, [g.randint(1, context) for _ in range(batch - 1)] + [context], 32, 8, 128, 16,
          torch.bfloat16)
    check("extend", [1] * (batch - 1) + [200], [g.randint(1, context) for _ in range(batch - 1)] + [context], 32, 8,
          128, 16, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed after the tables change in place (new lengths, pages): the replay
    equals an eager call on the new tables."""
    q, k, v, tables = make_case([1] * 4, [100, 300, 1, 700], 32, 8, 128, 16, torch.bfloat16)
    kernels = ta.TritonPagedKernels()
    out = torch.empty_like(q)
    kernels.decode(q, k, v, tables, 0.088, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.decode(q, k, v, tables, 0.088, out=out)
    tables.seq_lens.copy_(torch.tensor([650, 2, 299, 64], dtype=torch.int32))
    tables.page_table.copy_(tables.page_table.flip(0))
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, kernels.decode(q, k, v, tables, 0.088), atol=0, rtol=0)
