"""Tiny random checkpoints of each served architecture, saved by `transformers` itself (config.json,
model.safetensors and a byte-level tokenizer): what Bullet must reproduce token for token.

The weights are drawn wider than transformers' default (std 0.02 would leave logits within ~1e-3 of
each other, where float rounding picks the argmax), and the norms away from 1, so that a mix-up of
norms or a dropped bias shows in the tokens."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256  # one token per byte: a tokenizer with nothing to train
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def byte_tokenizer():
    """A byte-level BPE with no merges: every byte one token, any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def config(architecture: str, **overrides):
    import transformers

    if architecture == "Qwen2ForCausalLM":  # tied, as the small Qwen2.5 models are
        return transformers.Qwen2Config(**{**SHAPE, "tie_word_embeddings": True, **overrides})
    if architecture == "Qwen3ForCausalLM":  # head_dim 32: q is 128 wide over a hidden size of 64
        return transformers.Qwen3Config(**{**SHAPE, "head_dim": 32, **overrides})
    if architecture == "Qwen3MoeForCausalLM":  # Qwen3's attention; 8 experts of width 32, 2 per token
        return transformers.Qwen3MoeConfig(**{**SHAPE, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                              "moe_intermediate_size": 32, "norm_topk_prob": True, **overrides})
    if architecture == "LlamaForCausalLM":
        return transformers.LlamaConfig(**{**SHAPE, **overrides})
    if architecture == "MistralForCausalLM":  # Llama's layer; transformers' default window (4096) spans the
        # context; head_dim 32 as Mistral-Nemo's (q wider than the hidden size), so not Llama's tensors
        return transformers.MistralConfig(**{**SHAPE, "head_dim": 32, **overrides})
    raise ValueError(architecture)


def save(architecture: str, path: Path, seed: int = 0, save_kwargs: dict | None = None, **overrides):
    """The model (fp32, eval) after saving it and its tokenizer to `path` (`save_kwargs`: for
    `save_pretrained`)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config(architecture, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)  # large enough that a dropped bias changes the tokens
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(str(path), **(save_kwargs or {}))
    byte_tokenizer().save_pretrained(str(path))
    return model


def greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of n tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def greedy_batch(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuations of n tokens for several prompts in one generate() call
    (left-padded, the padding masked out): n steps instead of n per prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[:, width:].tolist()
