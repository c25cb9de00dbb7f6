"""Bad input gives a clear exception, never a crash or a hang."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError

from bullet.types.validation import RequestError
from engines.sampling_params import SamplingParams, validation_message
from engines.weights import ModelLoadError, load_weights
from engines.weights.resolve import default_gguf_path


def test_unknown_model_path_names_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_weights(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="neither config.json"):
        load_weights(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="unknown load format"):
        load_weights(None, load_format="pickle")
    with pytest.raises(ModelLoadError, match="built-in name"):
        load_weights("no-such-config", load_format="dummy")


def test_corrupt_gguf_is_rejected(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a gguf file" * 100)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_weights(str(junk))
    # a real header followed by a truncated body
    truncated = tmp_path / "truncated.gguf"
    with open(default_gguf_path(), "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(3_000_000))
    with pytest.raises(ModelLoadError):
        load_weights(str(truncated))


@pytest.mark.parametrize("bad, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": "lots"}, "max_new_tokens"), ({"stop": [""]}, "stop"), ({"seed": -3}, "seed"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"unknown_knob": 1}, "unknown_knob"),
    ({"min_new_tokens": 9, "max_new_tokens": 3}, "min_new_tokens"),
])
def test_invalid_sampling_values_name_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**bad)
    assert field in validation_message(info.value)


def test_prompt_longer_than_context_is_rejected(llm32):
    too_long = [100] * llm32.config.max_position_embeddings
    with pytest.raises(RequestError, match="context length"):
        llm32.generate(too_long, {"max_new_tokens": 1})
    with pytest.raises(RequestError, match="empty"):
        llm32.generate([[]], {"max_new_tokens": 1})
    with pytest.raises(RequestError, match="vocabulary"):
        llm32.generate("hi", {"stop_token_ids": [10**9]})
    with pytest.raises(RequestError, match=r"\[0, 49152\)"):
        llm32.generate([[5, 49152]], {"max_new_tokens": 1})
    # the engine is still usable and nothing leaked
    assert llm32.generate("Hello", {"max_new_tokens": 2, "temperature": 0})[0].output_ids
    assert llm32.allocator.num_free() == llm32.allocator.total_pages


def test_prompt_larger_than_the_kv_pool_is_rejected():
    import bullet

    small = bullet.LLM(dtype="float32", max_total_tokens=64, page_size=16)
    with pytest.raises(RequestError, match="KV pool holds 64"):
        small.generate([[7] * 100], {"max_new_tokens": 1})
