"""FP8 checkpoints as Qwen3-FP8 ships them (`quantization_config` quant_method fp8, e4m3 weights,
a float32 `weight_scale_inv` per [128, 128] block), or with other blocks, or per-tensor scales,
written here from a tiny random Qwen3-MoE checkpoint (a dense layer among sparse ones): the loader
dequantizes them exactly as the definition says, Bullet's greedy tokens equal transformers' on the
dequantized weights, the projections kept in FP8 (a CUDA device's form, run here on the CPU) compute
the dequantized model's logits, and what such a checkpoint may not do is an error naming it."""

from __future__ import annotations

import json

import pytest
import torch

from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.quant.fp8 import Fp8Linear, dequantize_rows, quantize_rows_dynamic
from engines.runner import ModelRunner, SeqChunk
from engines.weights import ModelLoadError, load_weights
from tests.engines import tiny_checkpoints as tiny

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MOE = "Qwen3MoeForCausalLM"
E4M3 = torch.float8_e4m3fn
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
NEW_TOKENS = 32
BLOCKS = {"block128": [128, 128], "block32x16": [32, 16], "per-tensor": None}


def quantize(w: torch.Tensor, block: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale_inv) with w ~ q * scale_inv: per [bn, bk] block (the last
    ones cut short), or one scale for the matrix."""
    if block is None:
        scale = w.abs().max().clamp(min=1e-12) / 448.0
        return (w / scale).to(E4M3), scale.reshape(())
    (n, k), (bn, bk) = w.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k]
    return q.to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    if block is None:
        return q.float() * scale
    (n, k), (bn, bk) = q.shape, block
    return q.float() * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def quantized(name: str) -> bool:
    """What Qwen3-FP8 stores in FP8: the decoder's projections (not the router, norms, embedding, head)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-float")
    tiny.save(MOE, path, decoder_sparse_step=2)
    return path


def _write(src, dst, tensors: dict, quantization_config: dict | None):
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    safetensors_torch.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def fp8_checkpoint(source, dst, block, **config):
    """(the FP8 checkpoint, the same weights dequantized, as a float checkpoint)."""
    float_tensors = safetensors_torch.load_file(str(source / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in float_tensors.items():
        if quantized(name):
            q, s = quantize(w, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize(q, s, block)
        else:
            fp8[name] = deq[name] = w
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", **config}
    if block is not None:
        qc["weight_block_size"] = block
    return _write(source, dst / "fp8", fp8, qc), _write(source, dst / "dequantized", deq, None)


def _logits(config, state, ids: list[int]) -> list[torch.Tensor]:
    """Last logits of a prompt's first half, a chunk after it, one decode step."""
    runner = ModelRunner(build_model(config, state), KVPool(config, 8, 16, torch.float32))
    pages, half = [0, 1, 2, 3], len(ids) // 2
    steps = [SeqChunk(ids[:half], 0, pages), SeqChunk(ids[half:-1], half, pages), SeqChunk(ids[-1:], len(ids) - 1, pages)]
    return [runner.forward([chunk]).last_logits[0] for chunk in steps]


def test_greedy_equals_transformers_on_the_dequantized_weights(source, tmp_path):
    """The form Qwen3-FP8 ships (blocks of 128 x 128), served on a CPU: dequantized at load."""
    import bullet

    fp8_dir, deq_dir = fp8_checkpoint(source, tmp_path, BLOCKS["block128"])
    llm = bullet.LLM(str(fp8_dir), dtype="float32", max_total_tokens=1024)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(deq_dir), dtype=torch.float32).eval()
    tok = tiny.byte_tokenizer()
    outs = llm.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    assert [o.output_ids for o in outs] == tiny.greedy_batch(ref, [tok.encode(p) for p in PROMPTS], NEW_TOKENS)


@pytest.mark.parametrize("scheme", list(BLOCKS))
def test_dequantized_at_load_and_kept_in_fp8(scheme, source, tmp_path):
    """Dequantized at load (a CPU's default), the state is the dequantized checkpoint's, bit for bit.
    Kept in FP8 (`--quantization fp8`, a CUDA device's default for these checkpoints) the attention
    and dense-MLP projections are `Fp8Linear`s holding e4m3 weights, and the logits stay those of
    the dequantized model: equal where the weight is dequantized for the product (block scales);
    within e4m3's rounding of the activations where `torch._scaled_mm` multiplies in FP8 (row scales)."""
    fp8_dir, deq_dir = fp8_checkpoint(source, tmp_path, BLOCKS[scheme])
    loaded, reference = load_weights(str(fp8_dir)), load_weights(str(deq_dir))
    assert loaded.quantization == "none" and loaded.state.keys() == reference.state.keys()
    assert all(torch.equal(loaded.state[k], reference.state[k]) for k in loaded.state)

    kept = load_weights(str(fp8_dir), quantization="fp8")
    assert kept.quantization == "fp8" and kept.state["layers.0.qkv_proj.weight"].dtype == E4M3
    assert kept.state["layers.1.moe.experts.gate_up_proj"].dtype == torch.float32  # experts: dequantized
    model = build_model(kept.config, kept.state)
    fp8_modules = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert sorted(fp8_modules) == sorted([f"layers.{i}.{p}" for i in (0, 1) for p in ("qkv_proj", "o_proj")]
                                         + ["layers.0.gate_up_proj", "layers.0.down_proj"])
    # one scale per row: per-tensor, and [128, 128] blocks over these 64-wide inputs (one block per row)
    scaled_mm = scheme != "block32x16"
    assert all(model.get_submodule(n).rowwise == scaled_mm for n in fp8_modules)
    ids = tiny.byte_tokenizer().encode(PROMPTS[1] + "return n")
    for got, want in zip(_logits(kept.config, kept.state, ids), _logits(reference.config, reference.state, ids)):
        if not scaled_mm:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            similarity = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
            print(f"{scheme}: fp8 activations x row-scaled fp8 weights vs dequantized: cosine {similarity:.5f}")
            assert similarity > 0.99 and int(got.argmax()) == int(want.argmax())


def test_what_an_fp8_checkpoint_may_not_do(source, tmp_path):
    fp8_dir, _ = fp8_checkpoint(source, tmp_path, BLOCKS["block128"])
    tensors = safetensors_torch.load_file(str(fp8_dir / "model.safetensors"))
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    name = "model.layers.1.self_attn.o_proj.weight"

    def refused(tensors_, match, qc_=qc):
        bad = _write(source, tmp_path / "bad", tensors_, qc_)
        with pytest.raises(ModelLoadError, match=match):
            load_weights(str(bad))

    refused({k: v for k, v in tensors.items() if k != name + "_scale_inv"}, f"{name} is stored in float8 without its scale")
    refused({**tensors, name + "_scale_inv": torch.ones(2, 2)}, rf"{name}_scale_inv: scale of shape \(2, 2\).*expected \(1, 1\)")
    refused({**tensors, name: tensors[name].to(torch.float8_e5m2)}, f"{name} is stored as torch.float8_e5m2")
    refused({**tensors, "model.norm.weight_scale_inv": torch.ones(1, 1)}, r"does not use: \['model.norm.weight_scale_inv'\]")
    refused(tensors, "declares no fp8 quantization_config", None)
    for setting, match in (({"quant_method": "gptq"}, "quant_method 'gptq'"),
                           ({"activation_scheme": "static"}, "only dynamic activation scales"),
                           ({"fmt": "e5m2"}, "only e4m3"), ({"weight_block_size": [128]}, "weight_block_size")):
        refused(tensors, match, {**qc, **setting})


def test_fp8_is_kept_on_cuda_and_dequantized_on_a_cpu():
    from engines.quant import resolve_quantization

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", cuda, False, source_fp8=True) == "fp8"
    assert resolve_quantization("auto", cpu, False, source_fp8=True) == "none"
    assert resolve_quantization("fp8", cpu, False, source_fp8=True) == "fp8"
    assert resolve_quantization("auto", cuda, False, source_fp8=False) == "none"  # a float source stays float
    # (`--quantization fp8` on a float source quantizes it at load: test_fp8_at_load.py)


# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most half a step, 2^-4 of
# it; below 2^-6 (subnormal) the step is fixed, 2^-9, so the move is at most 2^-10 (of the row's scale)
E4M3_UNIT_ROUNDOFF, E4M3_SUBNORMAL_HALF_STEP = 2.0**-4, 2.0**-10


def e4m3_product_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The most x @ w.T can move when each row of x is scaled to e4m3's range (amax -> 448), rounded
    to e4m3 and scaled back (what `Fp8Linear` does before `torch._scaled_mm`), the weight w already
    what the FP8 checkpoint holds: |dx| <= 2^-4 |x| + 2^-10 s per element (s = amax / 448), so
    |dy| <= (2^-4 |x| + 2^-10 s) @ |w|.T; plus float32 summation over K terms (K 2^-24 of the same sum)."""
    x, w = x.double(), w.double()
    scale = x.abs().amax(dim=1, keepdim=True) / 448.0
    moved = E4M3_UNIT_ROUNDOFF * x.abs() + E4M3_SUBNORMAL_HALF_STEP * scale
    return moved @ w.abs().T + x.shape[1] * 2.0**-24 * (x.abs() @ w.abs().T)


def test_fp8_products_stay_within_e4m3_rounding_of_their_activations(source, tmp_path):
    """Per-tensor scales: every `Fp8Linear` multiplies in FP8 (`torch._scaled_mm`, the activations
    quantized per row on the fly). Its only departure from the dequantized model is that rounding of
    the activations, so on the activations each projection sees in a real forward, its output lies
    within `e4m3_product_bound` of the dequantized product. The per-element bound under it is checked
    on the runtime's own rounding: attained within a factor of two, and failed by e5m2 (2 mantissa
    bits). (The product bound adds worst cases over K terms, which random signs rarely line up:
    measured errors are a fraction of it.)"""
    fp8_dir, deq_dir = fp8_checkpoint(source, tmp_path, BLOCKS["per-tensor"])
    kept, reference = load_weights(str(fp8_dir), quantization="fp8"), load_weights(str(deq_dir))
    model = build_model(kept.config, kept.state)
    seen: dict[str, torch.Tensor] = {}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(linears) == 6 and all(m.rowwise for m in linears.values())
    for name, module in linears.items():
        module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, args[0].detach().clone()))
    ids = tiny.byte_tokenizer().encode(PROMPTS[0] + " Paris, and the capital of Italy is")
    ModelRunner(model, KVPool(kept.config, 8, 16, torch.float32)).forward([SeqChunk(ids, 0, [0, 1, 2, 3])])
    assert seen.keys() == linears.keys()
    worst = 0.0
    for name, module in linears.items():
        x = seen[name].reshape(-1, module.in_features)
        w = reference.state[name + ".weight"]  # the dequantized checkpoint's weight, fused alike
        assert torch.equal(dequantize_rows(module.weight, module.weight_scale_inv, module.bk, torch.float32), w)
        want = x.double() @ w.double().T
        err = (module(x).double() - want).abs()
        bound = e4m3_product_bound(x, w)
        assert bool((err <= bound).all()), f"{name}: FP8 product off by {float((err - bound).max()):.3g} beyond e4m3's bound"
        assert float(err.max()) > 0  # the activations were rounded: the check is not of an exact product
        worst = max(worst, float((err / bound).max()))
        # the per-element rounding under the bound, the runtime's own: tight (attained within a
        # factor of two) and failed by a format of two mantissa bits (e5m2)
        q, scale = quantize_rows_dynamic(x)
        moved, allowed = (q.double() * scale - x).abs(), E4M3_UNIT_ROUNDOFF * x.abs() + E4M3_SUBNORMAL_HALF_STEP * scale
        assert bool((moved <= allowed).all()) and float((moved / allowed).max()) > 0.5
        coarse = (x.double() / scale).to(torch.float8_e5m2).double() * scale
        assert bool(((coarse - x).abs() > allowed).any()), f"{name}: e4m3's bound would pass e5m2 activations"
    print(f"FP8 x FP8 products vs the dequantized ones: at most {worst:.2f} of e4m3's bound")
