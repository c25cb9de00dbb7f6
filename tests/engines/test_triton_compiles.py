"""No Triton compile while serving: the decode split counts are bucketed, the page table's width is
not specialised, the start-up warm-up launches every variant a configuration can reach, and a
counter of compiles is chained into Triton's JIT hook.

The key tests drive a real (tiny) model through `ModelRunner` with kernels that plan each Triton
launch exactly as `TritonPagedKernels` does and file it under the key Triton's JIT cache would
(`engines.triton_compiles.launch_key`, Triton's own specialisation routine) instead of running it:
every step a configuration can take — each page-table width up to its longest context, batches,
chunks after a prefix, mixed steps — must fall within the keys of the warm-up's steps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it, on Linux)")

from engines import kernel_fallbacks  # noqa: E402
from engines.kernel_warmup import warm_kernels  # noqa: E402
from engines.kv_pool import KVPool  # noqa: E402
from engines.model import fused  # noqa: E402
from engines.model import triton_attention as ta  # noqa: E402
from engines.model.llama import LlamaModel  # noqa: E402
from engines.model.paged_attention import TorchPagedKernels, build_tables  # noqa: E402
from engines.model_config import ModelConfig  # noqa: E402
from engines.runner import ModelRunner, SeqChunk  # noqa: E402
from engines.triton_compiles import CompileCounter, launch_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPU = torch.cuda.is_available()
PAGE = 16
SMS = 132  # an H100/H200: split counts up to MAX_SPLITS


class KeyRecorder(ta.TritonPagedKernels):
    """Plans every launch as the Triton kernels do and records its key; computes nothing (zeros):
    the keys, not the values, are under test, and the model's other stages run as usual."""

    def __init__(self):
        super().__init__()
        self.keys: set[tuple] = set()

    def _out(self, q, out):
        return torch.zeros_like(q) if out is None else out.zero_()

    def decode(self, q, k_cache, v_cache, tables, scale, out=None):
        out = self._out(q, out)
        if q.shape[0]:
            self.keys.update(launch.key() for launch in ta.decode_launches(q, k_cache, v_cache, tables, scale, out,
                                                                          self.num_splits))
        return out

    def extend(self, q, k_cache, v_cache, tables, scale, out=None):
        out = self._out(q, out)
        if q.shape[0]:
            self.keys.add(ta.extend_launch(q, k_cache, v_cache, tables, scale, out).key())
        return out


def tiny_runner(dtype, context=4096, kv_heads=2):
    config = ModelConfig(name="tiny", hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=kv_heads, head_dim=16, vocab_size=64, max_position_embeddings=context)
    model = LlamaModel(config).to(dtype).eval()
    pages = context // PAGE + 1  # the last one: the warm-up's scratch page
    kernels = KeyRecorder()
    return ModelRunner(model, KVPool(config, pages, PAGE, dtype), "cpu", paged=True, kernels=kernels), kernels


def chunk(new, start, page=0):
    return SeqChunk([1] * new, start, [page] * -(-(start + new) // PAGE))


@pytest.fixture
def many_sms(monkeypatch):
    monkeypatch.setattr(ta, "_sm_count", lambda device: SMS)


# -- the split counts ------------------------------------------------------------------------------------

def test_split_counts_are_powers_of_two_and_within_the_buckets():
    for sms in (4, 66, 132):
        for kv_heads in (1, 2, 8):
            for max_context in (16, 1000, 8192, 131072):
                buckets = ta.split_buckets(kv_heads, max_context, sms)
                assert buckets == [1 << i for i in range(len(buckets))] and buckets[-1] <= ta.MAX_SPLITS
                seen = {ta.decode_splits(batch, kv_heads, context, sms)
                        for batch in (1, 2, 3, 7, 32, 100, 256) for context in range(16, max_context + 1, 16)}
                assert seen == set(buckets), (sms, kv_heads, max_context)  # each reachable, none outside
    assert ta.split_buckets(8, 1024, 132) == [1, 2, 4, 8]  # Llama-3.1-8B, 1 x 1024: 8 splits at most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_splits_equal_the_reference_across_widths(many_sms, dtype):
    """Each width's own split count (1, 2, 4 and 8 here), launched for real under the interpreter
    (or compiled on a GPU), gives what the torch reference does."""
    if not GPU and not ta.INTERPRETED:
        pytest.skip("triton was imported without TRITON_INTERPRET=1: its kernels cannot run on CPU tensors")
    device = "cuda" if GPU else "cpu"
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 1, 130 * PAGE, 16, generator=g).to(dtype).to(device)
    k, v = pool[0], pool[1]
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    used = set()
    for width in (1, 9, 33, 65):
        ctx = [width * PAGE - 5, max(1, width * PAGE // 3)]
        pages = [list(range(width)), list(range(width, 2 * width))]
        tables = build_tables(pages, ctx, [1, 1], PAGE, device)
        assert tables.page_table.shape[1] == width  # an eager step's table: as wide as its longest context
        q = torch.randn(2, 2, 16, generator=g).to(dtype).to(device)
        used.add(ta.decode_splits(2, 1, width * PAGE, SMS))
        got = ta.TritonPagedKernels().decode(q, k, v, tables, 0.25)
        torch.testing.assert_close(got.float(), TorchPagedKernels().decode(q, k, v, tables, 0.25).float(), **tol)
    assert used == {1, 2, 4, 8}


# -- the launch keys --------------------------------------------------------------------------------------

def test_launch_key_ignores_the_table_width_and_keeps_what_triton_specialises():
    q = torch.zeros(3, 4, 16)
    kv = torch.zeros(2, 64 * PAGE, 16)
    keys = {}
    for width in (1, 15, 16, 17, 32):
        tables = build_tables([[0]] * 3, [5, 5, 5], [1, 1, 1], PAGE, "cpu", width=width)
        keys[width] = ta.decode_launches(q, kv, kv, tables, 0.25, torch.zeros_like(q), num_splits=2)[0].key()
    assert len(set(keys.values())) == 1  # stride_pt: not specialised
    key = dict((n, rest) for n, *rest in keys[1][1])
    assert key["stride_pt"] == ["i32", None] and key["NUM_SPLITS"] == ["constexpr", "2"]
    assert key["stride_qt"] == ["i32", "D"]  # 64: divisible by 16, which Triton does specialise
    # and an argument Triton does specialise changes the key: q misaligned by one element
    odd = torch.zeros(3 * 64 + 1)[1:].view(3, 4, 16)
    tables = build_tables([[0]] * 3, [5, 5, 5], [1, 1, 1], PAGE, "cpu")
    assert ta.decode_launches(odd, kv, kv, tables, 0.25, torch.zeros_like(q), num_splits=2)[0].key() != keys[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_served_step_launches_a_warmed_kernel(many_sms, dtype):
    """Widths 1..max (4096 tokens: split counts up to 32), batches up to 64, chunks of 1 to 130 new
    tokens after a prefix, mixed steps in every order: no key outside the warm-up's. (Every width
    in float32; fewer in bfloat16, whose CPU matmuls are ten times slower: only the dtypes in the
    keys differ.)"""
    runner, kernels = tiny_runner(dtype)
    scratch = runner.kv.num_slots // PAGE - 1
    report = warm_kernels(runner, scratch)
    warmed = set(kernels.keys)
    assert report.splits == [1, 2, 4, 8, 16, 32]
    kernels.keys.clear()
    full = dtype == torch.float32
    for width in range(1, 4096 // PAGE + 1, 1 if full else 17):  # a decode step per width: its split count follows it
        runner.forward([chunk(1, width * PAGE - 1)])
    for batch in (2, 5, 16, 64) if full else (3, 64):
        for width in (1, 7, 64, 256) if full else (1, 256):
            runner.forward([chunk(1, width * PAGE - 1 - i % PAGE) for i in range(batch)])
    for new in (1, 2, 64, 65, 130) if full else (2, 65, 130):
        for prefix in (1, 1000):
            runner.forward([chunk(new, prefix)])  # a chunk after a cached prefix (extend)
            runner.forward([chunk(1, 2000), chunk(new, prefix), chunk(1, 30)])  # mixed, decode rows apart
            runner.forward([chunk(new, prefix), chunk(1, 3000)])  # mixed, the chunk first
    served = set(kernels.keys)
    names = {key[0] for key in served}
    assert names == {"decode_split_kernel", "decode_reduce_kernel", "extend_kernel"}
    assert served <= warmed, sorted(served - warmed)[:3]
    splits = {dict((n, rest) for n, *rest in key[1])["NUM_SPLITS"][1] for key in served
              if key[0] == "decode_split_kernel"}
    assert splits == {"1", "2", "4", "8", "16", "32"}  # the sweep reached every bucket


def test_an_moe_models_warm_up_reaches_the_experts_large_blocks():
    """A prompt long enough that its (token, pick) rows take the MoE kernels' 64-row blocks."""
    from types import SimpleNamespace

    from engines.kernel_warmup import warm_steps
    from engines.model.triton_moe import SMALL_BLOCK_MAX_ROWS, block_rows

    runner, _ = tiny_runner(torch.float32, context=1024)
    moe = SimpleNamespace(model=SimpleNamespace(config=runner.model.config.model_copy(
        update={"num_experts": 8, "num_experts_per_tok": 2})), **{k: getattr(runner, k) for k in (
            "page_size", "max_context", "kv", "kernels", "device")})
    prompt = warm_steps(moe, 0)[0].chunks[0]
    assert block_rows(len(prompt.token_ids) * 2) == 64 and len(prompt.token_ids) * 2 > SMALL_BLOCK_MAX_ROWS
    assert len(warm_steps(runner, 0)[0].chunks[0].token_ids) == 65  # a dense model: the long extend chunk's size


# -- the counter ------------------------------------------------------------------------------------------

def test_the_counter_counts_compiles_after_the_warm_up_apart_and_chains_the_hook():
    calls = []
    counter = CompileCounter()
    counter._previous = lambda **kw: calls.append(kw["fn"].name) or False

    class Info:  # what triton's JitFunctionInfo carries that the counter reads
        name = "decode_split_kernel"

    assert counter._on_miss(key="k", repr="decode_split_kernel[...]", fn=Info()) is False
    counter.mark_serving()
    for name in ("extend_kernel", "extend_kernel", "rope_kernel"):
        Info.name = name
        counter._on_miss(key="k", repr=f"{name}[...]", fn=Info())
    snap = counter.snapshot()
    assert (snap["total"], snap["before_serving"], snap["while_serving"]) == (4, 1, 3)
    assert snap["serving_kernels"] == ["extend_kernel", "rope_kernel"]
    assert calls == ["decode_split_kernel", "extend_kernel", "extend_kernel", "rope_kernel"]


HOOK_SCRIPT = textwrap.dedent("""
    import types
    from triton import knobs
    from engines.model import triton_attention_kernels as K
    from engines.triton_compiles import COUNTER
    assert not knobs.runtime.interpret
    assert COUNTER.install() and knobs.runtime.jit_cache_hook == COUNTER._on_miss
    # what JITFunction._do_compile does on a cache miss, before compiling: Triton's own call of the hook
    options = types.SimpleNamespace(num_warps=4, num_ctas=1, num_stages=1, enable_fp_fusion=True,
                                    launch_cooperative_grid=False, extern_libs=None)
    target = types.SimpleNamespace(backend="cuda", arch=90, warp_size=32)
    key = ("spec", ["*fp32"] * len(K.decode_reduce_kernel.params))
    for serving in (False, True):
        if serving:
            COUNTER.mark_serving()
        skip = K.decode_reduce_kernel._call_hook(knobs.runtime.jit_cache_hook, key, {}, target, 0, {}, options,
                                                 [{}], False)
        assert not skip
    print(COUNTER.snapshot())
""")


def test_the_counter_is_triton_s_cache_miss_hook():
    """In a process without the interpreter (as on a GPU host): installed as Triton's
    jit_cache_hook, and called by Triton's own hook code the way a cache miss calls it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", HOOK_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'total': 2" in done.stdout and "'while_serving': 1" in done.stdout
    assert "'serving_kernels': ['decode_reduce_kernel']" in done.stdout


# -- fallbacks -------------------------------------------------------------------------------------------

def test_a_fused_kernel_failure_is_recorded_with_its_reason(monkeypatch):
    monkeypatch.setattr(fused, "ENABLED", True)
    kernel_fallbacks.clear()

    def silu_mul_triton(gate_up):
        raise RuntimeError("PTX toolchain too old")

    x = torch.randn(3, 8)
    out = fused._guarded(silu_mul_triton, fused.silu_mul_reference, x)
    torch.testing.assert_close(out, fused.silu_mul_reference(x))  # the torch lines served the step
    assert fused.ENABLED is False
    record, = kernel_fallbacks.fallbacks()
    assert record["kernel"] == "fused silu_mul_triton" and "torch lines" in record["instead"]
    assert record["error"] == "RuntimeError: PTX toolchain too old"
    kernel_fallbacks.clear()


# -- on a GPU: the real thing ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_no_compile_after_the_warm_up_on_cuda():
    """A small bf16 model on the GPU, its kernels warmed: eager steps of every width, batch and
    kind compile nothing more (the counter chained into Triton's hook)."""
    from engines.triton_compiles import COUNTER

    if not COUNTER.install():
        pytest.skip("triton runs interpreted here")
    config = ModelConfig(name="tiny", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=256,
                         max_position_embeddings=4096)
    model = LlamaModel(config).to(torch.bfloat16).cuda().eval()
    runner = ModelRunner(model, KVPool(config, 4096 // PAGE + 1, PAGE, torch.bfloat16, "cuda"), "cuda")
    warm_kernels(runner, 4096 // PAGE)
    before = COUNTER.snapshot()["total"]
    for width in range(1, 4096 // PAGE + 1, 5):
        runner.forward([chunk(1, width * PAGE - 1)])
    for batch in (3, 17, 64):
        runner.forward([chunk(1, 1000 + i) for i in range(batch)])
    for new in (2, 64, 65, 300):
        runner.forward([chunk(new, 100)])
        runner.forward([chunk(1, 2000), chunk(new, 100), chunk(1, 30)])
        runner.forward([chunk(new, 0)])
    torch.cuda.synchronize()
    assert COUNTER.snapshot()["total"] == before, COUNTER.snapshot()
