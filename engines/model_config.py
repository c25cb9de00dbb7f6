"""Shape and hyper-parameters of a decoder model, independent of where the weights come from.

Built from a Hugging Face `config.json` (a directory, or one of the shipped configs under
`engines/configs/` for dummy weights) or from GGUF metadata; `engines.architectures` says which
architectures are served and which switches each sets. The estimator reads the same object to
build its op inventory, so it must stay free of torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engines import architectures

CONFIG_DIR = Path(__file__).parent / "configs"


class RopeScaling(BaseModel):
    """Llama-3.1 style frequency scaling ("rope_type": "llama3")."""

    model_config = ConfigDict(extra="ignore")
    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = "llama"
    architecture: str = architectures.LLAMA  # the Hugging Face class this computes (engines.architectures)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = Field(default_factory=tuple)
    # the decoder's switches, set from the architecture (engines.architectures)
    qkv_bias: bool = False  # the q/k/v projections add a bias (Qwen2)
    qk_norm: bool = False  # q and k heads are RMS-normalized before RoPE (Qwen3)
    # mixture of experts (Qwen3-MoE): the layers in `moe_layers` replace the dense SwiGLU by
    # `num_experts` SwiGLU experts of width `moe_intermediate_size`, `num_experts_per_tok` per token
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the picked experts' probabilities are renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def kernel_shape(self) -> tuple:
        """What sizes the model's kernels: two configs alike here run the same kernels (Llama-3-8B and
        Llama-3.1-8B), so a latency calibration measured on one describes the other."""
        return (self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.num_attention_heads,
                self.num_key_value_heads, self.head_dim, self.vocab_size, self.qkv_bias, self.qk_norm,
                self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size, self.moe_layers)

    def num_parameters(self, active: bool = False) -> int:
        """Every parameter of the model, or (`active`) those one token computes with: of a mixture of
        experts, its router and `num_experts_per_tok` experts."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        attention += (self.q_size + 2 * self.kv_size) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = h * self.num_experts + experts * 3 * h * self.moe_intermediate_size
        sparse = len(self.moe_layers)
        layers = self.num_hidden_layers * attention + (self.num_hidden_layers - sparse) * 3 * h * i + sparse * moe
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + layers + h + head

    def projection_parameters(self) -> int:
        """The parameters of the layers' projection matrices (attention, dense MLPs, experts): what an
        FP8 checkpoint stores in FP8 (embedding, head, norms, biases and routers stay in float)."""
        h, w, sparse = self.hidden_size, self.moe_intermediate_size, len(self.moe_layers)
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        return (self.num_hidden_layers * attention + (self.num_hidden_layers - sparse) * 3 * h * self.intermediate_size
                + sparse * self.num_experts * 3 * h * w)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "llama") -> "ModelConfig":
        arch = architectures.architecture_of(cfg)
        switches = architectures.switches(arch, cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope = cfg.get("rope_scaling") or None
        params = cfg.get("rope_parameters") or {}
        if rope is None:  # transformers>=5 spelling; any scaling there (llama3, yarn, …) is to be honoured or refused
            rope = params
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        if rope is not None and rope.get("rope_type", rope.get("type")) != "llama3":
            raise ValueError(f"unsupported rope_scaling {rope!r}: only 'llama3' scaling is implemented")
        return cls(
            name=name,
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", params.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling(**rope) if rope else None,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **switches,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        return cls.from_hf_dict(json.loads(path.read_text()), name=path.parent.name if path.name == "config.json" else path.stem)

    @classmethod
    def builtin(cls, name: str) -> "ModelConfig":
        """One of the shipped configs (engines/configs): smollm2-135m, llama-3.1-8b, llama-3.1-70b, qwen3-32b,
        qwen3-30b-a3b, qwen3-235b-a22b."""
        path = CONFIG_DIR / f"{name}.json"
        if not path.exists():
            known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
            raise ValueError(f"unknown built-in model config {name!r}; known: {known}")
        return cls.from_json(path)
