"""Hugging Face model directories: config.json plus one *.safetensors file, or the shards listed by
`model.safetensors.index.json` (then only those: a directory may hold other weight files, such as
a `consolidated.safetensors` in another naming, that are not this checkpoint).

Every tensor of the checkpoint must find its place in the model, and every tensor of the model its
source in the checkpoint: a tensor left over is an error that names it, never skipped (a Qwen2
checkpoint read as Llama's would otherwise lose its q/k/v biases and still run). What the model
holds comes from the model itself (`engines.model.build.float_shapes`), so a new family needs no
list of names here, only the Hugging Face spelling of any new module (`_HF_MODULE`).

Mixture-of-experts layers (Qwen3-MoE) stack their experts in two tensors; a checkpoint may hold them
as the hub's checkpoints do, one matrix per expert and projection (`mlp.experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`, which is also what `transformers` writes with `save_pretrained`), or as
`transformers` holds them in memory, stacked (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]; `save_pretrained(save_original_format=False)` writes these). The
router is `mlp.gate.weight`.

FP8 checkpoints (`quantization_config.quant_method: fp8`, e4m3 weights with a `weight_scale_inv`
per block or per tensor, `engines.quant.fp8`): every float8 tensor is dequantized to the load dtype,
using its scale tensor, except, with `keep_fp8` (a CUDA device), the attention and dense-MLP
projections, which stay FP8 with their scales (`Fp8Linear`); experts, router, embedding and head
are dequantized either way. A float8 tensor without its scale, a scale of the wrong shape, another
float8 format, static activation scales: errors naming the tensor or the setting."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engines.model.build import float_shapes
from engines.model.rope import inverse_frequencies
from engines.model_config import ModelConfig
from engines.quant import fp8
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


# a sparse layer's stacked experts: their per-expert sources under model.layers.N.mlp.experts.{e}
_HF_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def hf_sources(name: str) -> tuple[str, ...]:
    """The checkpoint tensors (without the `model.` prefix) that model tensor `name` is made of
    (a sparse layer's stacked experts: `expert_sources`)."""
    parts = name.split(".")
    if parts[0] == "layers" and parts[2] == "moe":  # layers.N.moe.router.weight
        if parts[3:] != ["router", "weight"]:
            raise ModelLoadError(f"{name}: stacked experts are read by expert_sources")
        return (f"layers.{parts[1]}.mlp.gate.weight",)
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


def expert_sources(name: str, num_experts: int) -> tuple[str, list[tuple[str, ...]]]:
    """A stacked expert tensor (layers.N.moe.experts.gate_up_proj | down_proj) -> its stacked
    spelling in the checkpoint, and the per-expert one (each expert's matrices, concatenated)."""
    _, n, _, _, which = name.split(".")
    base = f"layers.{n}.mlp.experts"
    return f"{base}.{which}", [tuple(f"{base}.{e}.{src}.weight" for src in _HF_EXPERTS[which])
                               for e in range(num_experts)]


def fp8_scheme(cfg: dict) -> tuple[bool, tuple[int, int] | None]:
    """(whether config.json's quantization_config is FP8, its weight_block_size or None: per-tensor
    scales). Anything else it could ask for is refused."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return False, None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(f"quantization_config with quant_method {method!r}: only fp8 checkpoints are read")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"fp8 format {qc['fmt']!r}: only e4m3 weights are read")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"fp8 activation_scheme {qc['activation_scheme']!r}: only dynamic activation "
                             "scales are implemented (no input_scale)")
    block = qc.get("weight_block_size")
    if block is None:
        return True, None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelLoadError(f"fp8 weight_block_size {block!r}: expected two positive integers")
    return True, (block[0], block[1])


def source_is_fp8(path: Path) -> bool:
    """config.json of the directory `path` declares an FP8 checkpoint."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(cfg.get("quantization_config"), dict) and cfg["quantization_config"].get("quant_method") == "fp8"


class _Checkpoint:
    """The checkpoint's tensors, each taken once: what is left at the end is unused."""

    def __init__(self, path: Path, config: ModelConfig, raw: dict[str, torch.Tensor], keys_of: dict[str, str],
                 dtype: torch.dtype, is_fp8: bool, block: tuple[int, int] | None):
        self.path, self.config, self.raw, self.keys_of = path, config, raw, keys_of
        self.dtype, self.is_fp8, self.block = dtype, is_fp8, block

    def has(self, name: str) -> bool:
        return name in self.raw

    def stored(self, name: str) -> torch.Tensor:
        if name not in self.raw:
            raise ModelLoadError(f"{self.path}: weight {name!r} missing (the {self.config.architecture} model needs it)")
        return self.raw.pop(name)

    def _fp8_parts(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A stored float8 tensor -> (it, its scales per row, bk), its scale tensor taken."""
        key = self.keys_of.get(name, name)
        if t.dtype != fp8.FP8:
            raise ModelLoadError(f"{self.path}: {key} is stored as {t.dtype}: of the float8 formats only e4m3 "
                                 "(torch.float8_e4m3fn) is read")
        if not self.is_fp8:
            raise ModelLoadError(f"{self.path}: {key} is stored in float8 but config.json declares no fp8 "
                                 "quantization_config")
        if t.dim() != 2:
            raise ModelLoadError(f"{self.path}: {key} is a float8 tensor of {t.dim()} dimensions: only matrices "
                                 "are read in FP8")
        scale_name = name + fp8.SCALE_SUFFIX
        if scale_name not in self.raw:
            raise ModelLoadError(f"{self.path}: {key} is stored in float8 without its scale {key + fp8.SCALE_SUFFIX!r}")
        try:
            rows = fp8.block_scales(self.raw.pop(scale_name), tuple(t.shape), self.block)
        except ValueError as exc:
            raise ModelLoadError(f"{self.path}: {key + fp8.SCALE_SUFFIX}: {exc}") from exc
        return t, rows, fp8.columns_per_scale(rows, t.shape[1], self.block)

    def take(self, name: str) -> torch.Tensor:
        """The tensor in the load dtype (dequantized where it is stored in float8)."""
        t = self.stored(name)
        if t.dtype.is_floating_point and t.element_size() == 1:
            w, rows, bk = self._fp8_parts(name, t)
            return fp8.dequantize_rows(w, rows, bk, self.dtype)
        return t.to(self.dtype)

    def take_fp8(self, sources: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The sources concatenated in FP8 (rows), with their row scales and bk; None (nothing taken)
        unless every source is stored in float8."""
        if not all(src in self.raw and self.raw[src].element_size() == 1 and self.raw[src].dtype.is_floating_point
                   for src in sources):
            return None
        parts = [self._fp8_parts(src, self.stored(src)) for src in sources]
        bk = min(b for _, _, b in parts)  # a per-tensor part (bk = K) spreads its scale over the blocks
        cols = max(r.shape[1] for _, r, _ in parts)
        rows = [r if r.shape[1] == cols else r.expand(-1, cols) for _, r, _ in parts]
        return torch.cat([w for w, _, _ in parts]), torch.cat(rows).contiguous(), bk

    def experts(self, name: str) -> torch.Tensor:
        stacked, per_expert = expert_sources(name, self.config.num_experts)
        if self.has(stacked) or not self.has(per_expert[0][0]):
            if not self.has(stacked):
                raise ModelLoadError(f"{self.path}: weight {per_expert[0][0]!r} missing (the experts of "
                                     f"{self.config.architecture}; or stacked, {stacked!r})")
            return self.take(stacked)
        return torch.stack([torch.cat([self.take(src) for src in srcs]) for srcs in per_expert])


def load_hf_dir(path: Path, dtype: torch.dtype, keep_fp8: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`keep_fp8`: the projections of an FP8 checkpoint stay FP8 (for a CUDA device; see the module)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
        config = ModelConfig.from_hf_dict(cfg, name=path.name)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: {exc}") from exc
    is_fp8, block = fp8_scheme(cfg)
    raw, keys_of = _read(path)
    ckpt = _Checkpoint(path, config, raw, keys_of, dtype, is_fp8, block)

    state = {}
    for name in float_shapes(config):
        parts = name.split(".")
        if parts[0] == "layers" and parts[2:4] == ["moe", "experts"]:
            state[name] = ckpt.experts(name)
            continue
        sources = hf_sources(name)
        if keep_fp8 and fp8.is_projection_weight(name):
            kept = ckpt.take_fp8(sources)
            if kept is not None:
                state[name], state[name + fp8.SCALE_SUFFIX], bk = kept
                state[name + fp8.BLOCK_SUFFIX] = torch.tensor(bk, dtype=torch.int64)
                continue
        tensors = [ckpt.take(src) for src in sources]
        state[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
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
