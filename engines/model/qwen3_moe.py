"""The Qwen3-MoE decoder: Qwen3's (q/k norms before RoPE), whose sparse layers
(`config.moe_layers`) replace the dense SwiGLU by a mixture of experts (`engines.model.moe`); the
other layers keep the dense one of `intermediate_size`.

State names of a sparse layer: `layers.{i}.moe.router.weight` [E, H], `layers.{i}.moe.experts.
gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `...moe.experts.down_proj`
[E, H, I], in place of `gate_up_proj.weight` and `down_proj.weight`. There is no int8 form
(`engines.quant` refuses the model)."""

from __future__ import annotations

import torch

from engines.model import moe
from engines.model.qwen3 import Qwen3DecoderLayer, Qwen3Model
from engines.model_config import ModelConfig


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, config: ModelConfig, int8_block: int | None) -> None:
        self.sparse = self.layer_id in config.moe_layers
        if not self.sparse:
            return super().build_mlp(config, int8_block)
        if int8_block is not None:
            raise ValueError("the mixture-of-experts layers have no int8 form")
        self.moe = moe.SparseMoE(config.hidden_size, config.num_experts, config.moe_intermediate_size,
                                 config.num_experts_per_tok, config.norm_topk_prob)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h) if self.sparse else super().mlp(h)


class Qwen3MoeModel(Qwen3Model):
    layer_class = Qwen3MoeDecoderLayer

    def graph_blocker(self, device: torch.device) -> str | None:
        """Why a decode step of this model on `device` cannot be a CUDA graph, or None."""
        if self.config.is_moe and moe.runs_on_host_counts(torch.device(device)):
            return ("the mixture-of-experts layers group their rows by expert on the host (the Triton MoE "
                    "kernels, which do not, need triton and BULLET_FUSED_KERNELS=1)")
        return None
