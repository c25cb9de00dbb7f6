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
  (not hidden / heads).
* Qwen3MoeForCausalLM: Qwen3's attention; the MLP of its sparse layers is a mixture of experts (a
  router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token, weighted by their
  softmax probabilities, renormalised over the picked ones where `norm_topk_prob`). Which layers are
  sparse: every `decoder_sparse_step`-th, except `mlp_only_layers` (those keep a dense SwiGLU of
  `intermediate_size`). Shared experts (Qwen2-MoE's) are refused."""

from __future__ import annotations

from typing import Any, Callable

LLAMA, MISTRAL, QWEN2, QWEN3 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
# `model_type` of configs that name no architecture (hand-written ones, the estimator's reference shapes)
_BY_MODEL_TYPE = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}


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


def switches(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
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


def _qwen3(cfg: dict[str, Any], architecture: str = QWEN3) -> dict[str, bool]:
    _no_attention_bias(architecture, cfg)
    _refuse_short_window(architecture, cfg)
    return {"qk_norm": True}


def _int(cfg: dict[str, Any], key: str, architecture: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedModel(f"{architecture}: {key} must be an integer, got {value!r}")
    return value


def moe_layers(num_layers: int, num_experts: int, sparse_step: int, mlp_only_layers) -> tuple[int, ...]:
    """The layers whose MLP is the mixture of experts: every `sparse_step`-th (1: all), except the
    `mlp_only_layers`, and none without experts."""
    if num_experts <= 0:
        return ()
    return tuple(i for i in range(num_layers) if (i + 1) % sparse_step == 0 and i not in mlp_only_layers)


def _qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    a = QWEN3_MOE
    out: dict[str, Any] = _qwen3(cfg, a)
    # transformers >= 5 writes num_local_experts (num_experts is its alias); the hub's configs num_experts
    given = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if not given:
        raise UnsupportedModel(f"{a}: the config gives no num_experts")
    if len(set(given.values())) > 1:
        raise UnsupportedModel(f"{a}: num_experts and num_local_experts disagree ({given})")
    experts = _int(given, next(iter(given)), a)
    shared = cfg.get("shared_expert_intermediate_size")
    if shared:
        raise UnsupportedModel(f"{a} with shared experts (shared_expert_intermediate_size {shared}): not implemented")
    layers = _int(cfg, "num_hidden_layers", a)
    step = _int({"decoder_sparse_step": cfg.get("decoder_sparse_step", 1)}, "decoder_sparse_step", a)
    if step < 1:
        raise UnsupportedModel(f"{a}: decoder_sparse_step must be >= 1, got {step}")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                                   for i in dense):
        raise UnsupportedModel(f"{a}: mlp_only_layers must list layer indices in [0, {layers}), got {dense!r}")
    sparse = moe_layers(layers, experts, step, set(dense))
    if not sparse:  # no expert anywhere: Qwen3's dense decoder under another name
        return {**out, "moe_layers": ()}
    top_k = _int(cfg, "num_experts_per_tok", a)
    if not 1 <= top_k <= experts:
        raise UnsupportedModel(f"{a}: num_experts_per_tok must lie in [1, num_experts={experts}], got {top_k}")
    width = _int(cfg, "moe_intermediate_size", a)
    if width < 1:
        raise UnsupportedModel(f"{a}: moe_intermediate_size must be >= 1, got {width}")
    return {**out, "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "moe_layers": sparse}


SWITCHES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    LLAMA: _llama, MISTRAL: _mistral, QWEN2: _qwen2, QWEN3: _qwen3, QWEN3_MOE: _qwen3_moe}
