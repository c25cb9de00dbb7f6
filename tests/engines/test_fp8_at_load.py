"""`--quantization fp8` on a float checkpoint: the attention and dense-MLP projections quantized at
load to e4m3 with one scale per output row (`engines.quant.fp8.quantize_state`), served by
`Fp8Linear`'s row-wise `torch._scaled_mm` path (torch's CPU `_scaled_mm` runs it here).

What is asserted, and why these bounds:

* the quantizer: each scale is its row's amax / 448, and every element moves by at most half an e4m3
  step (2^-4 of itself, or 2^-10 of the scale below e4m3's normal range), which caps a row's error at
  amax / 28 (the top binade [256, 448] steps by 32: half a step is 16 / 448 of amax);
* the tiny random Llama and Qwen3 checkpoints (`tiny_checkpoints`): every projection an `Fp8Linear`
  holding exactly `quantize_weight` of the float matrix, with bk = K; logits (prefill, a chunk after
  a cached prefix, a decode step) within cosine 0.98 of the float model's, their error at most 16
  times the bf16 model's (e4m3's unit roundoff is 16 times bf16's: 2^-4 against 2^-8), and the
  prefill's top token unchanged. These random models amplify rounding (weights of std 0.2, logits
  nearly tied): measured cosine 0.983-0.996, 6-9 times bf16's error. Teacher-forced on a text of 209
  bytes, the FP8 model's top token is fp32's at >= 65 % of the positions (measured 75 % for Llama,
  84 % for Qwen3; bf16: 99 % for both), so on these models free-running greedy tokens part after a
  few steps, and no test asserts them equal to fp32's. On SmolLM2-135M's own weights (dequantized to
  fp32, then quantized to FP8) the logits stayed within cosine 0.9988 of fp32's (README "FP8 at load");
* one real server (prefill and decode workers sharing the FP8 state) serves exactly the offline
  engine's greedy tokens for the same FP8 model;
* the refusals: a quantized GGUF, tensor parallelism, a weight holding inf."""

from __future__ import annotations

import pytest
import torch

from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.quant import fp8, resolve_quantization
from engines.quant.fp8 import Fp8Linear, dequantize_rows, quantize_weight
from engines.runner import ModelRunner, SeqChunk
from engines.weights import ModelLoadError, load_weights
from tests.engines import tiny_checkpoints as tiny

transformers = pytest.importorskip("transformers")

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village at the edge"]
TEXT = ("The capital of France is Paris, and the capital of Italy is Rome. def fibonacci(n):\n    return n if n < 2 "
        "else fibonacci(n - 1) + fibonacci(n - 2)\nOnce upon a time, in a small village at the edge of the forest")
# e4m3: half a step of a normal value is 2^-4 of it; below 2^-6 the step is fixed at 2^-9 (half: 2^-10)
E4M3_UNIT_ROUNDOFF, E4M3_SUBNORMAL_HALF_STEP = 2.0**-4, 2.0**-10
ROW_ERROR = 16 / 448  # half the top binade's step (32) over e4m3's largest value: amax / 28


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """architecture -> (directory, transformers' model)."""
    return {arch: (path, tiny.save(arch, path)) for arch in (LLAMA, QWEN3) for path in [tmp_path_factory.mktemp(arch)]}


def _rows(seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (1e-6 to 1e3), one with a lone outlier, one of zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-6, 3, 64)[:, None]
    w[5, 17] = 1e4
    w[9] = 0
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_weight_scales_each_row_and_rounds_within_half_an_e4m3_step(dtype):
    w = _rows().to(dtype)
    q, scale = quantize_weight(w)
    assert q.dtype == fp8.FP8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (64, 1)
    amax = w.float().abs().amax(dim=1, keepdim=True)
    nonzero = amax[:, 0] > 0
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / 448, rtol=0, atol=0)
    assert float(q.float().abs().amax(dim=1)[nonzero].min()) == 448  # every row uses the whole range
    back = dequantize_rows(q, scale, w.shape[1], torch.float32)
    err = (back - w.float()).abs()
    allowed = E4M3_UNIT_ROUNDOFF * w.float().abs() + E4M3_SUBNORMAL_HALF_STEP * scale
    # slack: float32's rounding of scale = amax / 448 and of q * scale, a few 2^-24 of amax, which a
    # value halfway between two e4m3 steps (rounded to even, a full half step away) can show
    slack = 1 + 2**-16
    assert bool((err <= allowed * slack).all())
    row_err = err.amax(dim=1, keepdim=True)
    assert bool((row_err <= ROW_ERROR * amax * slack).all())
    assert float((row_err / amax.clamp(min=1e-30))[nonzero].max()) > 0.5 * ROW_ERROR  # the bound is near attained
    # the zero row: a finite scale, zeros back, and no NaN anywhere
    assert torch.isfinite(scale).all() and float(scale[9]) == 1.0 and not back[9].any()
    assert not torch.isnan(q.float()).any()
    # a format with one mantissa bit fewer (e5m2) breaks the per-element bound: it can fail
    coarse = (w.float() / scale).to(torch.float8_e5m2).float() * scale
    assert bool(((coarse - w.float()).abs() > allowed).any())


def test_quantize_state_is_the_layout_fp8_linear_takes(checkpoints):
    """Only the layers' projections change; fusing q/k/v before quantizing gives what quantizing
    them one by one gives (one scale per row); the input is left as it was."""
    w = load_weights(str(checkpoints[QWEN3][0]))
    before = {k: v.clone() for k, v in w.state.items()}
    out = fp8.quantize_state(w.config, w.state)
    assert all(torch.equal(w.state[k], before[k]) for k in before)
    changed = {k for k in out if k not in w.state or out[k] is not w.state[k]}
    projections = {f"layers.{i}.{p}.weight" for i in range(2) for p in fp8.PROJECTIONS}
    assert changed == {p + s for p in projections for s in ("", fp8.SCALE_SUFFIX, fp8.BLOCK_SUFFIX)}
    name = "layers.1.qkv_proj.weight"
    k = w.state[name].shape[1]
    assert out[name].dtype == fp8.FP8 and out[name + fp8.SCALE_SUFFIX].shape == (w.state[name].shape[0], 1)
    assert out[name + fp8.BLOCK_SUFFIX].dtype == torch.int64 and int(out[name + fp8.BLOCK_SUFFIX]) == k
    parts = [quantize_weight(p) for p in w.state[name].split([128, 64, 64])]  # q, k, v of Qwen3's tiny shape
    assert torch.equal(torch.cat([q for q, _ in parts]).view(torch.uint8), out[name].view(torch.uint8))
    assert torch.equal(torch.cat([s for _, s in parts]), out[name + fp8.SCALE_SUFFIX])
    assert fp8.quantize_state(w.config, out).keys() == out.keys()  # already FP8: kept as it is


def _logits(config, state, ids: list[int], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Last logits of a prompt's first half, a chunk after it, one decode step."""
    runner = ModelRunner(build_model(config, state), KVPool(config, 8, 16, dtype))
    pages, half = [0, 1, 2, 3], len(ids) // 2
    steps = [SeqChunk(ids[:half], 0, pages), SeqChunk(ids[half:-1], half, pages), SeqChunk(ids[-1:], len(ids) - 1, pages)]
    return [runner.forward([chunk]).last_logits[0].float() for chunk in steps]


@pytest.mark.parametrize("arch", [LLAMA, QWEN3])
def test_a_float_checkpoint_served_in_fp8_stays_near_the_float_model(arch, checkpoints):
    path, _ = checkpoints[arch]
    floats, kept = load_weights(str(path)), load_weights(str(path), quantization="fp8")
    assert kept.quantization == "fp8" and kept.dtype == torch.float32
    model = build_model(kept.config, kept.state)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(linears) == sorted(f"layers.{i}.{p}" for i in range(2) for p in fp8.PROJECTIONS)
    for name, m in linears.items():
        assert m.rowwise and m.bk == m.in_features
        q, scale = quantize_weight(floats.state[name + ".weight"])
        assert torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(m.weight_scale_inv, scale)
    assert model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32

    tok = tiny.byte_tokenizer()
    ids = tok.encode(PROMPTS[1] + "return n")
    bf16 = load_weights(str(path), dtype=torch.bfloat16)
    steps = zip(_logits(kept.config, kept.state, ids), _logits(floats.config, floats.state, ids),
                _logits(bf16.config, bf16.state, ids, torch.bfloat16))
    for step, (got, want, half) in enumerate(steps):
        cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
        err, err_bf16 = float((got - want).norm() / want.norm()), float((half - want).norm() / want.norm())
        print(f"{arch} step {step}: fp8 cosine {cosine:.5f}, relative error {err:.4f} ({err / err_bf16:.1f} x bf16's)")
        assert cosine >= 0.98 and err <= 16 * err_bf16
        if step == 0:
            assert int(got.argmax()) == int(want.argmax())

    # teacher-forced on a text: the FP8 model's top token at each of its positions against fp32's
    ids = tok.encode(TEXT)
    pages = list(range(-(-len(ids) // 16)))
    top = [ModelRunner(build_model(w.config, w.state), KVPool(w.config, len(pages), 16, torch.float32))
           .forward([SeqChunk(ids, 0, pages, "all")]).all_logits[0].argmax(-1) for w in (kept, floats)]
    agree = float((top[0] == top[1]).float().mean())
    print(f"{arch}: fp8 top-1 agreement with fp32, teacher-forced over {len(ids)} positions: {agree:.3f}")
    assert agree >= 0.65


def _greedy(config, state, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens after each prompt, the prompts run as one batch: a prefill, then decode steps."""
    runner = ModelRunner(build_model(config, state), KVPool(config, 16, 16, torch.float32))
    per_seq = -(-(max(map(len, prompts)) + n) // 16)
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    logits = runner.forward([SeqChunk(ids, 0, p) for ids, p in zip(prompts, pages)]).last_logits
    out = [[] for _ in prompts]
    for _ in range(n):
        for seq, row in zip(out, logits):
            seq.append(int(row.argmax()))
        logits = runner.forward([SeqChunk(seq[-1:], len(ids) + len(seq) - 1, p)
                                 for ids, seq, p in zip(prompts, out, pages)]).last_logits
    return out


def test_served_in_fp8_through_a_real_server(checkpoints):
    """`bullet launch --quantization fp8` on a CPU: the FP8 state crosses to both workers through
    shared memory and they serve the greedy tokens of the same FP8 model run here."""
    from tests.server_utils import ServerProcess

    path = str(checkpoints[LLAMA][0])
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    prompts = [tiny.byte_tokenizer().encode(p) for p in PROMPTS]
    w, f = load_weights(path, quantization="fp8"), load_weights(path)
    want = _greedy(w.config, w.state, prompts, params["max_new_tokens"])
    # (the fp32 model's tokens part from these: equal tokens below say the server ran the FP8 model)
    assert want != _greedy(f.config, f.state, prompts, params["max_new_tokens"])
    with ServerProcess("--model-path", path, "--quantization", "fp8", "--dtype", "float32",
                       "--max-total-tokens", "1024", "--policy", "static") as server:
        status, body = server.post("/generate", {"text": PROMPTS, "sampling_params": params})
    assert status == 200, body
    assert [b["output_ids"] for b in body] == want


def test_dummy_weights_quantize_too(checkpoints):
    w = load_weights(str(checkpoints[LLAMA][0]), load_format="dummy", quantization="fp8")
    assert w.quantization == "fp8" and w.state["layers.0.gate_up_proj.weight"].dtype == fp8.FP8
    assert w.state["embed_tokens.weight"].dtype == torch.float32


def test_what_fp8_at_load_refuses(checkpoints, tmp_path):
    from bullet.config import ServerArgs

    cpu = torch.device("cpu")
    assert resolve_quantization("fp8", cpu, source_quantized=False) == "fp8"
    assert resolve_quantization("fp8", torch.device("cuda"), source_quantized=False) == "fp8"
    assert resolve_quantization("auto", cpu, source_quantized=False) == "none"  # a float source stays float
    with pytest.raises(ValueError, match="this GGUF's projections are already quantized"):
        resolve_quantization("fp8", cpu, source_quantized=True)
    for quantization in ("fp8", "w8a8_int8"):
        with pytest.raises(ValueError, match=f"--tp-size 2 serves float weights: --quantization {quantization}"):
            ServerArgs(tp_size=2, quantization=quantization)
    w = load_weights(str(checkpoints[LLAMA][0]))
    w.state["layers.1.o_proj.weight"][3, 5] = float("inf")
    with pytest.raises(ValueError, match=r"layers.1.o_proj.weight: the weight holds inf or NaN"):
        fp8.quantize_state(w.config, w.state)
