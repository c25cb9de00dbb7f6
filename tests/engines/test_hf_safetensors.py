"""A tiny Llama-3.1-shaped model (rope scaling, untied LM head, grouped-query attention) saved by
`transformers` as safetensors: our loader and model must reproduce its logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama31_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms so a mix-up of norm weights would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny-llama31")
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model


def test_safetensors_model_matches_transformers_with_llama3_rope(tiny_llama31_dir):
    from engines.kv_pool import KVPool
    from engines.model.build import build_model
    from engines.runner import ModelRunner, SeqChunk
    from engines.weights import load_weights

    path, ref = tiny_llama31_dir
    w = load_weights(str(path), dtype=torch.float32)
    assert w.load_format == "safetensors" and w.config.rope_scaling is not None
    assert not w.config.tie_word_embeddings
    runner = ModelRunner(build_model(w.config, w.state), KVPool(w.config, 64, 8, torch.float32))
    # long enough that positions pass the original context (64), where llama3 scaling matters
    ids = torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = runner.forward([SeqChunk(ids, 0, list(range(25)), "all")]).all_logits[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, expected, atol=2e-4), (ours - expected).abs().max()
    # and a decode step after the cached prompt
    nxt = int(expected[-1].argmax())
    step = runner.forward([SeqChunk([nxt], 200, list(range(26)))]).last_logits[0]
    with torch.no_grad():
        exp_step = ref(torch.tensor([ids + [nxt]])).logits[0, -1]
    assert torch.allclose(step, exp_step, atol=2e-4)


def test_dummy_weights_for_shipped_configs_build_the_right_shapes():
    from engines.model_config import ModelConfig
    from engines.weights.dummy import dummy_weights
    from engines.weights.layout import check_shapes

    for name in ("smollm2-135m", "llama-3.1-8b", "llama-3.1-70b"):
        cfg = ModelConfig.builtin(name)
        assert cfg.num_parameters() > 1e8
    small = ModelConfig.builtin("smollm2-135m")
    check_shapes(small, dummy_weights(small, torch.bfloat16))
    big = ModelConfig.builtin("llama-3.1-8b")
    assert big.rope_scaling is not None and big.eos_token_ids == (128001, 128008, 128009)
    assert abs(big.num_parameters() - 8.03e9) < 0.01e9
