"""Session-wide models for engine tests: loading the default model takes seconds, so it is loaded
once. The reference is `transformers` reading the same GGUF file."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the ocean and the moon.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colors:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who "
    "had spent his whole life building clocks that never told the right time. One winter morning a stranger "
    "knocked on his door and asked for a clock that could measure something other than hours. The clockmaker",
    "Q: What is 17 times 23?\nA:",
    "Translate to French: 'Good morning, how are you today?'",
    "Les mathématiques sont",
]


@pytest.fixture(scope="session")
def llm32():
    import bullet

    return bullet.LLM(dtype="float32", max_total_tokens=8192, page_size=16)


@pytest.fixture(scope="session")
def hf_reference():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from engines.weights.resolve import default_gguf_path

    path = default_gguf_path()
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@contextmanager
def _gguf_parsed_once():
    """transformers' GGUF load with two pure look-ups memoized, and nothing else changed: it parses the
    file twice (once for the config, once for the tensors; most of each parse is the tokenizer's 49k
    strings, read field by field) and builds gguf's tensor-name table once per module of the model
    (~400 times). On a 2-core machine the load took 12 s, and 7 s with both memoized; parsing with the
    reader our own loads use (`engines.weights.gguf_loader.plain_array_reader`, the same fields and bytes)
    took it from 8.6-9.7 s to 5.6-5.7 s. The reference still dequantizes and maps every tensor itself (its
    state dict is equal either way)."""
    gguf = pytest.importorskip("gguf")
    from engines.weights.gguf_loader import plain_array_reader

    readers: dict[str, object] = {}
    real_reader, real_name_map = plain_array_reader(), gguf.get_tensor_name_map  # the reader our own loads use

    def reader(path, mode="r"):
        key = f"{path}:{mode}"
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(real_name_map))
        yield
