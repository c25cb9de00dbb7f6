"""Tensor parallelism as the estimator prices it: what one of N ranks computes (its shard of the
model, Megatron-style) and what the ranks exchange (collectives over the server's link).

    shard = shard_model(ModelConfig.builtin("llama-3.1-70b"), 8)     # one rank's kernels
    tp = TensorParallel(8, Interconnect.builtin("nvlink3"), hidden_size=8192, vocab_size=128256)
    tp.layer_time(rows=64, units=108)                                 # its two all-reduces per layer

The shard: attention heads and the MLP's width split N ways (column-parallel QKV and gate/up,
row-parallel O and down), KV heads split too — each rank holds one where the model has fewer KV
heads than ranks (replicated, as SGLang and vLLM do) — and the vocabulary split for the embedding
and the LM head. Norms and residual adds run whole on every rank. So the shard's FLOPs and bytes
are 1/N of the model's where the model is split and whole where it is not, and its weights and
KV cache are what one device holds.

The exchange, per layer: an all-reduce of the rows' hidden states after the O projection and
another after the down projection (tokens x hidden x dtype bytes each); per step, one after the
vocab-parallel embedding and an all-gather of the output rows' logits. They run in series with the
kernels (SGLang's default: no overlap of communication with compute), on the units of the worker
that issues them — the SM split applies on every device alike, so one rank's share is the
device's. What the two workers' collectives cost each other on the shared link is not modelled
(Bullet §3.2.3 finds the inter-phase network contention low)."""

from __future__ import annotations

from dataclasses import dataclass

from engines.model_config import ModelConfig
from estimator.interconnect import Interconnect


def shard_model(model: ModelConfig, ranks: int) -> ModelConfig:
    """One rank's part of `model` split over `ranks` (the model itself for one rank). Refuses a split
    the engines refuse: heads, KV heads or MLP width that do not divide among the ranks."""
    if ranks < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {ranks}")
    if ranks == 1:
        return model
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if heads % ranks:
        raise ValueError(f"{model.name}'s {heads} attention heads do not split over {ranks} ranks")
    if kv % ranks and ranks % kv:
        raise ValueError(f"{model.name}'s {kv} KV heads neither split over {ranks} ranks nor replicate evenly")
    widths = {"intermediate_size": model.intermediate_size, "moe_intermediate_size": model.moe_intermediate_size}
    for field, width in widths.items():
        if width % ranks:
            raise ValueError(f"{model.name}'s {field} {width} does not split over {ranks} ranks")
    return model.model_copy(update={
        "name": f"{model.name}/tp{ranks}",
        "num_attention_heads": heads // ranks,
        "num_key_value_heads": max(1, kv // ranks),  # fewer KV heads than ranks: one each, replicated
        "intermediate_size": model.intermediate_size // ranks,
        "moe_intermediate_size": model.moe_intermediate_size // ranks,
        "vocab_size": -(-model.vocab_size // ranks),  # vocab-parallel: padded to a multiple of the ranks
    })


@dataclass(frozen=True)
class TensorParallel:
    """The collectives of one step on one of `ranks` ranks, over `link`. `hidden_size` and
    `vocab_size` are the whole model's; `dtype_bytes` the activations'."""

    ranks: int
    link: Interconnect
    hidden_size: int
    vocab_size: int
    dtype_bytes: int = 2

    def layer_time(self, rows: int, units: int) -> float:
        """One layer's two all-reduces of `rows` hidden states (after O, after down)."""
        return 2.0 * self.link.all_reduce_time(rows * self.hidden_size * self.dtype_bytes, self.ranks, units)

    def head_time(self, rows: int, output_rows: int, units: int) -> float:
        """Per step: the vocab-parallel embedding's all-reduce of `rows` hidden states, and the
        all-gather of the `output_rows` rows' logits."""
        embedding = self.link.all_reduce_time(rows * self.hidden_size * self.dtype_bytes, self.ranks, units)
        logits = self.link.all_gather_time(output_rows * self.vocab_size * self.dtype_bytes, self.ranks, units)
        return embedding + logits

    @classmethod
    def of(cls, model: ModelConfig, ranks: int, link: Interconnect, dtype_bytes: int = 2) -> "TensorParallel":
        """The collectives of `model` (the whole model, not a shard) over `ranks` ranks."""
        return cls(ranks, link, model.hidden_size, model.vocab_size, dtype_bytes)
