"""The fused forms of a layer's small stages (`engines.model.fused`) against their torch lines.

Without a GPU the Triton kernels run on CPU tensors under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1); torch's fused RMSNorm is the same op on either device. Every other device
keeps the torch lines, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.model import fused

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it, on Linux)")

GPU = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if GPU else "cpu"
INTERPRETED = not isinstance(fused._kernels().rope_kernel, triton.runtime.JITFunction)
if not GPU and not INTERPRETED:
    pytest.skip("triton was imported without TRITON_INTERPRET=1: its kernels cannot run on CPU tensors",
                allow_module_level=True)
if not GPU and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7) and \
        tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4):
    pytest.skip("this triton's interpreter fails under numpy >= 2.4 (triton-lang/triton#9171)", allow_module_level=True)
# one rounding against the lines' two or three (each rounding its input's error on): within two units
# in the last place of the storage dtype
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def rope_tables(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(positions.float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().unsqueeze(1).to(DEVICE), emb.sin().unsqueeze(1).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 1, 32)])
def test_rope_kernel_rotates_q_and_k_heads_of_a_fused_qkv_view(dtype, heads, kv_heads, dim):
    """The layer hands RoPE its Q and K heads as one strided view of the QKV projection's output."""
    g = torch.Generator().manual_seed(0)
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(DEVICE)
    x = qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim)  # rows lie (heads + 2 kv) * dim apart
    cos, sin = rope_tables(torch.tensor([0, 3, 7, 100, 4095]), dim)
    got = fused.rope_triton(x, cos, sin)
    want = fused.rope_reference(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [100, fused.SILU_BLOCK + 24])
def test_silu_mul_kernel_is_swiglus_product(dtype, width):
    g = torch.Generator().manual_seed(1)
    gate_up = (3 * torch.randn(3, 2 * width, generator=g)).to(dtype).to(DEVICE)
    got = fused.silu_mul_triton(gate_up)
    assert got.shape == (3, width) and got.dtype == dtype
    torch.testing.assert_close(got.float(), fused.silu_mul_reference(gate_up).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [96, 576])
def test_rms_norm_kernel_is_the_reference_within_one_rounding(dtype, width):
    """float32 statistics, one rounding at the end, against the reference's lines."""
    g = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(6, width, generator=g)).to(dtype).to(DEVICE)
    w = (1 + torch.randn(width, generator=g) / 4).to(dtype).to(DEVICE)
    got = fused.rms_norm_triton(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), fused.rms_norm_reference(x, w, 1e-5).float(), **TOL[dtype])


def test_other_devices_keep_the_torch_lines_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 32, generator=g).to(torch.bfloat16)
    cos, sin = (t.cpu() for t in rope_tables(torch.arange(4), 32))
    w = torch.randn(32, generator=g).to(torch.bfloat16)
    assert not fused.fused_on(x)
    assert torch.equal(fused.rope(x, cos, sin), fused.rope_reference(x, cos, sin))
    assert torch.equal(fused.silu_mul(x.reshape(4, -1)), fused.silu_mul_reference(x.reshape(4, -1)))
    assert torch.equal(fused.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5))


def test_bad_shapes_are_refused():
    cos, sin = rope_tables(torch.arange(2), 8)
    with pytest.raises(ValueError, match="even D"):
        fused.rope_triton(torch.zeros(2, 3, 7, device=DEVICE), cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="float32"):
        fused.rope_triton(torch.zeros(2, 3, 8, device=DEVICE), cos.half(), sin.half())
    with pytest.raises(ValueError, match="2I"):
        fused.silu_mul_triton(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="RMSNorm"):
        fused.rms_norm_triton(torch.zeros(2, 8, device=DEVICE), torch.ones(7, device=DEVICE), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_step_takes_every_fused_kernel_where_it_runs_on_a_gpu(monkeypatch, dtype):
    """The layer's own tensors (QKV views, RoPE tables, norm weights) meet the kernels' layouts: with
    the fused path on for CPU tensors (the interpreter runs the kernels), a prefill step and a decode
    step of a tiny Llama take all three kernels on every layer and give the torch lines' logits."""
    from engines.kv_pool import KVPool
    from engines.model.build import build_model
    from engines.runner import ModelRunner, SeqChunk
    from engines.weights.dummy import dummy_weights
    from tests.partition.tiny_model import CONFIG

    model = build_model(CONFIG, dummy_weights(CONFIG, dtype, seed=0))
    steps = [[SeqChunk(list(range(3, 10)), 0, [0, 1])], [SeqChunk([11], 7, [0, 1])]]

    def run(fused_path: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(fused, "fused_on", lambda x: fused_path)
        runner = ModelRunner(model, KVPool(CONFIG, 8, 4, dtype), paged=False)
        return [runner.forward(chunks).last_logits.float() for chunks in steps]

    calls = []
    for name in ("rms_norm_triton", "rope_triton", "silu_mul_triton"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    got = run(True)
    layers = CONFIG.num_hidden_layers
    # per step: two norms a layer and the final one, RoPE and SwiGLU once a layer
    assert sorted(set(calls)) == ["rms_norm_triton", "rope_triton", "silu_mul_triton"]
    assert calls.count("rms_norm_triton") == 2 * (2 * layers + 1) and calls.count("rope_triton") == 2 * layers
    calls.clear()
    want = run(False)
    assert not calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **(TOL[dtype] if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)))


def test_a_kernel_that_fails_on_this_gpu_leaves_the_torch_lines_serving(monkeypatch, caplog):
    """A Triton failure (say, a toolchain it cannot drive) is logged once and every stage runs as
    torch lines from then on: the step still computes, a server keeps serving."""
    def broken(*args):
        raise RuntimeError("PTX assembly aborted")

    monkeypatch.setattr(fused, "ENABLED", True)
    monkeypatch.setattr(fused, "rope_triton", broken)
    monkeypatch.setattr(fused, "fused_on", lambda x: fused.ENABLED)  # as on a CUDA tensor
    x = torch.randn(3, 4, 16)
    cos, sin = (t.cpu() for t in rope_tables(torch.arange(3), 16))
    with caplog.at_level("WARNING", logger="engines.fused"):
        out = fused.rope(x, cos, sin)
    assert torch.equal(out, fused.rope_reference(x, cos, sin))
    assert not fused.ENABLED and "fused broken failed (RuntimeError: PTX assembly aborted)" in caplog.text
    assert torch.equal(fused.silu_mul(x.reshape(3, -1)), fused.silu_mul_reference(x.reshape(3, -1)))  # lines now


AOT_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from engines.model import triton_fused_kernels as K
    cases = [(K.rope_kernel, {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16"},
              dict(HEADS=40, HALF=64, BLOCK_H=64, BLOCK_HALF=64)),
             (K.silu_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(WIDTH=14336, BLOCK=1024)),
             (K.rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
              dict(WIDTH=4096, BLOCK=4096))]
    for kernel, pointers, constexprs in cases:
        # (num_warps as the launches choose: 8 for a 4096-wide RMSNorm row)
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i64") for n in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 8 if constexprs.get("BLOCK") == 4096 else 4})
        assert "cubin" in compiled.asm
        print(kernel.__name__, compiled.metadata.shared)
""")


@pytest.mark.skipif(GPU, reason="on a GPU the kernels are compiled and run for real by the test below")
def test_kernels_compile_for_hopper():
    """The interpreter checks numerics, not that Triton lowers the kernels: compile them at
    Llama-3.1-8B's sizes in bf16 to sm_90 machine code (an H100/H200) in a process without it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line.split()[0] for line in done.stdout.split("\n") if line) == ["rms_norm_kernel", "rope_kernel", "silu_mul_kernel"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_llama_sized_stages_compiled_and_replayed_in_a_cuda_graph(monkeypatch):
    """Llama-3.1-8B's sizes compiled for this GPU: each fused stage against its torch lines, then all
    three captured in a CUDA graph and replayed on new inputs (what a decode graph does)."""
    from engines.model.llama import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(4)
    t, heads, kv_heads, dim, width = 8, 32, 8, 128, 14336
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device="cuda", generator=g).to(torch.bfloat16)
    x = qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim)
    cos, sin = rope_tables(torch.arange(1000, 1000 + t), dim)
    gate_up = torch.randn(t, 2 * width, device="cuda", generator=g).to(torch.bfloat16)
    hidden = torch.randn(t, 4096, device="cuda", generator=g).to(torch.bfloat16)
    norm = RMSNorm(4096, 1e-5).to("cuda", torch.bfloat16)
    stages = lambda: (fused.rope(x, cos, sin), fused.silu_mul(gate_up), norm(hidden))  # noqa: E731
    got = stages()
    monkeypatch.setattr(fused, "ENABLED", False)
    for a, b in zip(got, stages()):
        torch.testing.assert_close(a.float(), b.float(), **TOL[torch.bfloat16])
    monkeypatch.setattr(fused, "ENABLED", True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stages()  # compiled before the capture, as DecodeGraphs warms up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = stages()
    for tensor in (qkv, gate_up, hidden):
        tensor.copy_(torch.randn(tensor.shape, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, stages()):
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=0)
