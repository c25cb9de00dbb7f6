"""Session-wide models for engine tests: loading the default model takes seconds, so it is loaded
once. The reference is `transformers` reading the same GGUF file."""

from __future__ import annotations

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
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
