"""Dummy weights are drawn on the device that serves them: on the CPU, exactly the values every
profile and test was made with; elsewhere by that device's own generator, in the served dtype."""

from __future__ import annotations

import json

import pytest
import torch

from engines.model_config import ModelConfig
from engines.weights import load_weights
from engines.weights.dummy import dummy_weights

TIED = ModelConfig(name="tied", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=50, tie_word_embeddings=True)
UNTIED = TIED.model_copy(update={"name": "untied", "tie_word_embeddings": False, "num_hidden_layers": 3})


def reference_cpu_draws(config: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The CPU algorithm as it was before the device argument existed (its values are load-bearing:
    cached CPU profiles and the tests' expected outputs were made with them)."""
    gen = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def normal(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    state = {"embed_tokens.weight": normal(config.vocab_size, h), "norm.weight": torch.ones(h, dtype=dtype)}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}"
        state[f"{p}.input_norm.weight"] = torch.ones(h, dtype=dtype)
        state[f"{p}.post_attn_norm.weight"] = torch.ones(h, dtype=dtype)
        state[f"{p}.qkv_proj.weight"] = normal(config.q_size + 2 * config.kv_size, h)
        state[f"{p}.o_proj.weight"] = normal(h, config.q_size)
        state[f"{p}.gate_up_proj.weight"] = normal(2 * i, h)
        state[f"{p}.down_proj.weight"] = normal(h, i)
    return state


@pytest.mark.parametrize("config", [TIED, UNTIED], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 7])
def test_cpu_draws_are_bit_identical_to_before(config, dtype, seed):
    want = reference_cpu_draws(config, dtype, seed)
    for device in ("cpu", torch.device("cpu")):
        got = dummy_weights(config, dtype, seed, device=device)
        assert list(got) == list(want)
        for name, tensor in want.items():
            assert got[name].dtype == dtype and got[name].device.type == "cpu"
            assert torch.equal(got[name], tensor), name


def write_config(config: ModelConfig, directory) -> str:
    path = directory / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **config.model_dump(exclude={"name", "eos_token_ids"})}))
    return str(path)


def test_the_loader_keeps_the_cpu_values(tmp_path):
    """What `bullet launch --load-format dummy --model-path <config>` serves on the CPU."""
    loaded = load_weights(write_config(UNTIED, tmp_path), "dummy", torch.bfloat16, seed=3, device="cpu").state
    want = reference_cpu_draws(UNTIED, torch.bfloat16, 3)
    assert list(loaded) == list(want) and all(torch.equal(loaded[k], want[k]) for k in want)


def test_another_device_draws_there_with_its_own_generator(monkeypatch, tmp_path):
    """A device this machine has no generator for (meta) stands in for a GPU: the generator is
    asked for on that device, and every tensor is created there, in the served dtype."""
    import engines.weights.dummy as dummy

    asked = []

    def generator(device=None):
        asked.append(torch.device(device) if device is not None else None)
        return torch.Generator()  # meta has no generator of its own; draws on meta ignore its state

    monkeypatch.setattr(dummy, "Generator", generator)
    meta = torch.device("meta")
    state = dummy_weights(UNTIED, torch.bfloat16, seed=5, device=meta)
    assert asked == [meta]
    assert all(t.device == meta and t.dtype == torch.bfloat16 for t in state.values())
    assert set(state) == set(reference_cpu_draws(UNTIED, torch.bfloat16, 5))
    asked.clear()
    loaded = load_weights(write_config(UNTIED, tmp_path), "dummy", torch.bfloat16, device=meta).state
    assert asked == [meta] and {t.device for t in loaded.values()} == {meta}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dummy_weights_are_drawn_on_the_gpu():
    gpu = torch.device("cuda", 0)
    first = load_weights("smollm2-135m", "dummy", torch.bfloat16, seed=1, device=gpu).state
    again = load_weights("smollm2-135m", "dummy", torch.bfloat16, seed=1, device=gpu).state
    assert {t.device for t in first.values()} == {gpu}
    assert all(torch.equal(first[k], again[k]) for k in first)  # seeded on the GPU too
    std = first["layers.0.qkv_proj.weight"].float().std().item()
    assert 0.015 < std < 0.025
