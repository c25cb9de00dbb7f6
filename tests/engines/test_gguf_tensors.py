"""A GGUF written here from a tiny `transformers` Llama-3.1 (llama.cpp's layout: Q/K rows permuted
for interleaved RoPE, the llama3 rope scaling as `rope_freqs.weight` divisors): every tensor of the
file is used — the divisors as the config's rope scaling, checked against the logits of the model
it was written from — and a tensor without a place is an error naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

HEADS, KV_HEADS, THETA = 4, 2, 500000.0
SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # Llama 3.2's


@pytest.fixture(scope="module")
def llama32():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=THETA,
                                   max_position_embeddings=1024, rms_norm_eps=1e-5, rope_scaling=dict(SCALING))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows as llama.cpp's converter stores them (what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path, extra: dict[str, np.ndarray] | None = None) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(cfg.hidden_size // HEADS)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for n in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{n}", f"blk.{n}"
        tensors.update({
            f"{b}.attn_q.weight": _permute(sd[f"{p}.self_attn.q_proj.weight"], HEADS),
            f"{b}.attn_k.weight": _permute(sd[f"{p}.self_attn.k_proj.weight"], KV_HEADS),
            f"{b}.attn_v.weight": sd[f"{p}.self_attn.v_proj.weight"],
            f"{b}.attn_output.weight": sd[f"{p}.self_attn.o_proj.weight"],
            f"{b}.ffn_gate.weight": sd[f"{p}.mlp.gate_proj.weight"], f"{b}.ffn_up.weight": sd[f"{p}.mlp.up_proj.weight"],
            f"{b}.ffn_down.weight": sd[f"{p}.mlp.down_proj.weight"],
            f"{b}.attn_norm.weight": sd[f"{p}.input_layernorm.weight"],
            f"{b}.ffn_norm.weight": sd[f"{p}.post_attention_layernorm.weight"],
        })
    # the divisors llama.cpp writes: plain over scaled inverse frequencies, the scaled as transformers computes them
    d = cfg.hidden_size // HEADS
    plain = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    tensors["rope_freqs.weight"] = (plain / ROPE_INIT_FUNCTIONS["llama3"](cfg)[0]).numpy()
    for name, arr in {**tensors, **(extra or {})}.items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_rope_freqs_become_the_rope_scaling_and_the_logits_are_transformers(llama32, tmp_path):
    from engines.kv_pool import KVPool
    from engines.model.build import build_model
    from engines.runner import ModelRunner, SeqChunk
    from engines.weights.gguf_loader import load_gguf

    write_gguf(llama32, tmp_path / "tiny.gguf")
    config, state = load_gguf(tmp_path / "tiny.gguf", torch.float32)
    assert config.rope_scaling is not None and config.rope_scaling.model_dump() == SCALING
    runner = ModelRunner(build_model(config, state), KVPool(config, 16, 16, torch.float32))
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = runner.forward([SeqChunk(ids, 0, list(range(13)), "all")]).all_logits[0]
    with torch.no_grad():
        expected = llama32(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_a_tensor_without_a_place_is_an_error_naming_it(llama32, tmp_path):
    from engines.weights import ModelLoadError
    from engines.weights.gguf_loader import load_gguf

    write_gguf(llama32, tmp_path / "extra.gguf", {"blk.0.attn_q.bias": np.zeros(64)})
    with pytest.raises(ModelLoadError, match=r"does not use: \['blk.0.attn_q.bias'\]"):
        load_gguf(tmp_path / "extra.gguf", torch.float32)


def test_a_float_gguf_served_in_fp8_is_quantized_at_load_and_cached(llama32, tmp_path, monkeypatch):
    """`--quantization fp8` on an F32 GGUF: its projections in e4m3 with one scale per row, the state
    cached (safetensors holds float8 and the int64 block entries) and read back bit for bit."""
    from engines.model.build import build_model
    from engines.quant import fp8
    from engines.weights import load_weights

    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BULLET_WEIGHTS_CACHE", "1")
    write_gguf(llama32, tmp_path / "tiny.gguf")
    floats = load_weights(str(tmp_path / "tiny.gguf"), dtype=torch.float32, quantization="none")
    derived = load_weights(str(tmp_path / "tiny.gguf"), dtype=torch.float32, quantization="fp8")
    assert derived.quantization == "fp8" and list((tmp_path / "cache" / "weights").glob("tiny-*.safetensors"))
    q, scale = fp8.quantize_weight(floats.state["layers.1.gate_up_proj.weight"])
    assert torch.equal(derived.state["layers.1.gate_up_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(derived.state["layers.1.gate_up_proj.weight_scale_inv"], scale)
    cached = load_weights(str(tmp_path / "tiny.gguf"), dtype=torch.float32, quantization="fp8")
    assert cached.quantization == "fp8" and cached.state.keys() == derived.state.keys()
    bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 (float8 has no == in torch)
    assert all(cached.state[k].dtype == v.dtype and torch.equal(bits(cached.state[k]), bits(v))
               for k, v in derived.state.items())
    assert sum(isinstance(m, fp8.Fp8Linear) for m in build_model(cached.config, cached.state).modules()) == 8
