"""Which computation a Hugging Face `config.json` asks for, read from its `architectures` entry.

Each supported architecture maps to the switches it sets on the shared decoder (`ModelConfig`'s
`qkv_bias`, `qk_norm`); anything the decoder does not compute — a sliding window that would cut the
context, biases other than Qwen2's, another activation — is refused here with a message, so a model
is never served as a different one. Torch-free: the estimator reads the same config.

* LlamaForCausalLM: the base decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).
* MistralForCausalLM: the same computation, plus a sliding window; without one (or with one no
  shorter than the context) it is Llama's.
* Qwen2ForCausalLM: Llama with a bias on the q/k/v projections (always, whatever the config says).
* Qwen3ForCausalLM: Llama with a per-head RMSNorm of q and k before RoPE; its head_dim is its own
  (not hidden / heads)."""

from __future__ import annotations

from typing import Any, Callable

LLAMA, MISTRAL, QWEN2, QWEN3 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
# `model_type` of configs that name no architecture (hand-written ones, the estimator's reference shapes)
_BY_MODEL_TYPE = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3}


class UnsupportedModel(ValueError):
    """A config whose computation the decoder does not implement."""


def architecture_of(cfg: dict[str, Any]) -> str:
    """The one architecture `cfg` names (`architectures`, else `model_type`)."""
    names = cfg.get("architectures")
    if names:
        if len(names) != 1 or names[0] not in SWITCHES:
            raise UnsupportedModel(f"unsupported architecture {names!r}: Bullet serves {', '.join(SWITCHES)}")
        return names[0]
    model_type = cfg.get("model_type")
    if model_type is None:
        raise UnsupportedModel(f"the config names no architecture (no architectures, no model_type): Bullet "
                               f"serves {', '.join(SWITCHES)}")
    if model_type not in _BY_MODEL_TYPE:
        raise UnsupportedModel(f"unsupported model_type {model_type!r} (and no architectures entry): Bullet "
                               f"serves {', '.join(SWITCHES)}")
    return _BY_MODEL_TYPE[model_type]


def switches(architecture: str, cfg: dict[str, Any]) -> dict[str, bool]:
    """The decoder switches of `architecture` for this config, after the checks every family shares."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{architecture} with hidden_act {cfg['hidden_act']!r}: only SwiGLU (silu) "
                               "is implemented")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel(f"{architecture} with mlp_bias: MLP biases are not implemented")
    return SWITCHES[architecture](cfg)


def _no_attention_bias(architecture: str, cfg: dict[str, Any]) -> None:
    # Llama's, Mistral's and Qwen3's attention_bias adds a bias to o_proj as well: not implemented
    if cfg.get("attention_bias"):
        raise UnsupportedModel(f"{architecture} with attention_bias: q/k/v/o biases are not implemented "
                               "(only Qwen2's q/k/v bias is)")


def _window(cfg: dict[str, Any]) -> int | None:
    """The sliding window some layer attends with, or None."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:  # transformers >= 5 writes each layer's kind
        return window if "sliding_attention" in layer_types else None
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:  # Qwen's switch (Mistral has none)
        return None
    return window


def _refuse_short_window(architecture: str, cfg: dict[str, Any]) -> None:
    window, context = _window(cfg), cfg.get("max_position_embeddings", 8192)
    if window is not None and window < context:
        raise UnsupportedModel(
            f"{architecture} with a sliding window of {window} tokens (context {context}): sliding-window "
            "attention is not implemented, and full attention would compute another model past the window")


def _llama(cfg: dict[str, Any]) -> dict[str, bool]:
    _no_attention_bias(LLAMA, cfg)
    return {}


def _mistral(cfg: dict[str, Any]) -> dict[str, bool]:
    _no_attention_bias(MISTRAL, cfg)
    _refuse_short_window(MISTRAL, cfg)
    return {}


def _qwen2(cfg: dict[str, Any]) -> dict[str, bool]:
    _refuse_short_window(QWEN2, cfg)
    return {"qkv_bias": True}


def _qwen3(cfg: dict[str, Any]) -> dict[str, bool]:
    _no_attention_bias(QWEN3, cfg)
    _refuse_short_window(QWEN3, cfg)
    return {"qk_norm": True}


SWITCHES: dict[str, Callable[[dict[str, Any]], dict[str, bool]]] = {
    LLAMA: _llama, MISTRAL: _mistral, QWEN2: _qwen2, QWEN3: _qwen3}
