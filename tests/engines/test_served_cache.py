"""The served-weights cache: a cached start serves exactly the state a derivation builds, a damaged
entry is derived again, and any change to the file, the request or the code gets a new entry."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engines.model_config import ModelConfig
from engines.weights import served_cache
from engines.weights.resolve import load_weights


def test_a_cached_load_serves_the_derived_state_and_a_damaged_entry_is_rebuilt(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BULLET_WEIGHTS_CACHE", raising=False)
    derived_first = None
    with caplog.at_level(logging.WARNING, logger=served_cache.__name__):
        # a damaged entry where the first load will look: it must be derived again, not fail
        probe = load_weights(quantization="auto")  # derives and stores
        entries = list((tmp_path / "weights").glob("*.safetensors"))
        assert len(entries) == 1
        entries[0].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
        derived_first = load_weights(quantization="auto")
    assert "unreadable" in caplog.text
    cached = load_weights(quantization="auto")  # the rewritten entry
    assert cached.quantization == probe.quantization == "w8a8_int8"
    assert cached.dtype == probe.dtype and cached.config == probe.config
    assert cached.source == probe.source and cached.load_format == "gguf"
    assert cached.state.keys() == probe.state.keys() == derived_first.state.keys()
    for name, tensor in probe.state.items():
        assert cached.state[name].dtype == tensor.dtype, name
        assert torch.equal(cached.state[name], tensor), name
    # the file's precision is remembered, and another request that serves the same state shares its entry
    assert served_cache.source_quantized(probe.source) is True
    again = load_weights(quantization="w8a8_int8", dtype=torch.bfloat16)
    assert again.quantization == "w8a8_int8" and again.dtype == torch.float32
    assert len(list((tmp_path / "weights").glob("*.safetensors"))) == 1


def test_the_key_follows_the_file_the_request_and_the_code(tmp_path, monkeypatch):
    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x" * 64)
    request = {"dtype": "torch.float32", "quantization": "w8a8_int8", "device": "cpu"}
    first = served_cache.entry_path(source, request)
    assert first == served_cache.entry_path(source, dict(request))
    assert first != served_cache.entry_path(source, {**request, "quantization": "none"})
    os.utime(source, ns=(1, 1))
    assert first != served_cache.entry_path(source, request)
    touched = served_cache.entry_path(source, request)
    monkeypatch.setattr(served_cache, "_DERIVING_CODE", served_cache._DERIVING_CODE[:-1])
    assert touched != served_cache.entry_path(source, request)


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("false", False), ("1", True), ("", True)])
def test_the_cache_can_be_turned_off(monkeypatch, value, on):
    monkeypatch.setenv("BULLET_WEIGHTS_CACHE", value)
    assert served_cache.enabled() is on


def test_only_the_most_recent_entries_are_kept(tmp_path, monkeypatch):
    config = ModelConfig.builtin("smollm2-135m")
    for i in range(3):
        path = tmp_path / f"e{i}.safetensors"
        served_cache.store_entry(path, config, {"w": torch.full((2,), float(i))}, "none", torch.float32)
        os.utime(path, (i + 1, i + 1))
    newest_two = sum((tmp_path / f"e{i}.safetensors").stat().st_size for i in (1, 2))
    monkeypatch.setattr(served_cache, "MAX_TOTAL_BYTES", newest_two)
    served_cache._evict(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["e1.safetensors", "e2.safetensors"]
    config_back, state, quantization, dtype = served_cache.load_entry(tmp_path / "e2.safetensors")
    assert config_back == config and quantization == "none" and dtype == torch.float32
    assert torch.equal(state["w"], torch.full((2,), 2.0))
