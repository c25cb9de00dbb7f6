"""Hugging Face model directories: config.json plus one *.safetensors file, or the shards listed by
`model.safetensors.index.json` (then only those: a directory may hold other weight files, such as
a `consolidated.safetensors` in another naming, that are not this checkpoint).

Every tensor of the checkpoint must find its place in the model, and every tensor of the model its
source in the checkpoint: a tensor left over is an error that names it, never skipped (a Qwen2
checkpoint read as Llama's would otherwise lose its q/k/v biases and still run). What the model
holds comes from the model itself (`engines.model.build.float_shapes`), so a new family needs no
list of names here, only the Hugging Face spelling of any new module (`_HF_MODULE`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engines.model.build import float_shapes
from engines.model.rope import inverse_frequencies
from engines.model_config import ModelConfig
from engines.weights.errors import ModelLoadError
from engines.weights.layout import check_shapes

INDEX = "model.safetensors.index.json"
# our module name -> its Hugging Face sources under model.layers.N, concatenated in this order
_HF_MODULE = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "q_norm": ("self_attn.q_norm",),
    "k_norm": ("self_attn.k_norm",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
    "input_norm": ("input_layernorm",),
    "post_attn_norm": ("post_attention_layernorm",),
}


def hf_sources(name: str) -> tuple[str, ...]:
    """The checkpoint tensors (without the `model.` prefix) that model tensor `name` is made of."""
    parts = name.split(".")
    if parts[0] == "layers":  # layers.N.module.leaf
        _, n, module, leaf = parts
        if module not in _HF_MODULE:
            raise ModelLoadError(f"no Hugging Face spelling known for the model's {module} (hf_loader._HF_MODULE)")
        return tuple(f"layers.{n}.{src}.{leaf}" for src in _HF_MODULE[module])
    return (name,)


def _shard_files(path: Path) -> dict[Path, set[str] | None]:
    """The files of the checkpoint, each with the tensor names the index puts in it (None: no index)."""
    index = path / INDEX
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path} has a config.json but no *.safetensors weights")
        return dict.fromkeys(files)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index}: not a readable safetensors index ({exc})") from exc
    shards: dict[Path, set[str]] = {}
    for tensor, file in weight_map.items():
        shards.setdefault(path / file, set()).add(tensor)
    for file in shards:
        if not file.exists():
            raise ModelLoadError(f"{index} lists {file.name}, which is missing")
    return shards


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the checkpoint as stored, keyed by its name without the `model.` prefix (which
    some checkpoints lack); and each such name's key in the file, for messages."""
    from safetensors import safe_open  # deferred: only this format needs it

    raw: dict[str, torch.Tensor] = {}
    keys_of: dict[str, str] = {}
    for file, listed in _shard_files(path).items():
        try:
            with safe_open(str(file), framework="pt") as st:
                keys = set(st.keys())
                if listed is not None and keys != listed:
                    odd = sorted(keys ^ listed)[:5]
                    raise ModelLoadError(f"{file.name} does not hold the tensors {INDEX} lists for it: {odd}")
                for key in sorted(keys):
                    name = key.removeprefix("model.")
                    if name in raw:
                        raise ModelLoadError(f"{path}: tensor {key!r} appears twice")
                    raw[name], keys_of[name] = st.get_tensor(key), key
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc
    return raw, keys_of


def _consume_derived(config: ModelConfig, raw: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                     path: Path) -> None:
    """Tensors the model does not load but computes itself: accepted where they agree with what it
    computes, an error where not (they would say the checkpoint is another model)."""
    ours = inverse_frequencies(config)
    for name in [n for n in raw if n.endswith("self_attn.rotary_emb.inv_freq")]:  # written by old transformers
        theirs = raw.pop(name).float()
        if theirs.shape != ours.shape or not torch.allclose(theirs, ours, rtol=1e-2, atol=0):
            raise ModelLoadError(f"{path}: {name} differs from the RoPE frequencies of config.json (another model?)")
    embed = state["embed_tokens.weight"]
    if config.tie_word_embeddings and "lm_head.weight" in raw:  # a tied head stored anyway
        if not torch.equal(raw.pop("lm_head.weight").to(embed.dtype), embed):
            raise ModelLoadError(f"{path}: config.json ties the LM head to the embedding, but lm_head.weight differs")


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    try:
        config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()), name=path.name)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: {exc}") from exc
    raw, keys_of = _read(path)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelLoadError(f"{path}: weight {name!r} missing (the {config.architecture} model needs it)")
        return raw.pop(name).to(dtype)

    state = {}
    for name in float_shapes(config):
        parts = [take(src) for src in hf_sources(name)]
        state[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    _consume_derived(config, raw, state, path)
    if raw:
        unused = sorted(keys_of[name] for name in raw)
        raise ModelLoadError(f"{path}: tensors the {config.architecture} model does not use: {unused[:5]}"
                             f"{f' and {len(unused) - 5} more' if len(unused) > 5 else ''}")
    try:
        check_shapes(config, state)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return config, state
