"""Readers for public measured data used to calibrate and validate the estimator.

* Vidur's A100 operator profiles (`data/gpu-profiles/a100/<org>/<model>/mlp.csv`, MIT licence):
  per-operator latencies of one decoder layer's linear and element-wise kernels, in milliseconds,
  for token counts 1..32768 and tensor-parallel degrees 1..8. Each row has min/max/mean/median/std;
  we use the median. The file also carries the model's shape (n_embd, n_head, ...).
* FlashInfer attention latencies of Llama-3-8B on A100 from the same profiling suite, as summed in
  `shared/reference/numbers.md` (32 layers, milliseconds); the per-op CSV has no attention."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from engines.model_config import ModelConfig

# Vidur column -> our kernel (calibration class). Vidur times one launch of each kernel;
# our residual_add runs twice per layer, so its samples are per launch as well.
VIDUR_COLUMNS = {
    "emb": "embedding",
    "input_layernorm": "input_norm",
    "attn_pre_proj": "qkv_proj",
    "attn_rope": "rope",
    "attn_post_proj": "o_proj",
    "post_attention_layernorm": "post_attn_norm",
    "mlp_up_proj": "gate_up_proj",
    "mlp_act": "act",
    "mlp_down_proj": "down_proj",
    "add": "residual_add",
}
# What numbers.md calls the layer's "linear ops": every column but the embedding, once each.
VIDUR_LAYER_COLUMNS = tuple(c for c in VIDUR_COLUMNS if c != "emb")

VIDUR_A100_DIR = Path("gpu-profiles/a100/meta-llama")
VIDUR_MODELS = {"llama-3-8b": "Meta-Llama-3-8B", "llama-2-7b": "Llama-2-7b-hf"}


def vidur_csv_path(shared_data: Path, model: str) -> Path:
    return Path(shared_data) / VIDUR_A100_DIR / VIDUR_MODELS.get(model, model) / "mlp.csv"


def _rows(path: Path, tensor_parallel: int) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["num_tensor_parallel_workers"]) == tensor_parallel]


def load_vidur_ops(path: str | Path, tensor_parallel: int = 1) -> dict[str, dict[int, float]]:
    """kernel class -> {tokens: seconds per launch}. Token counts profiled twice are averaged."""
    acc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in _rows(Path(path), tensor_parallel):
        tokens = int(row["num_tokens"])
        for column, op_class in VIDUR_COLUMNS.items():
            acc[op_class][tokens].append(float(row[f"time_stats.{column}.median"]) * 1e-3)
    return {cls: {t: sum(v) / len(v) for t, v in sorted(by_t.items())} for cls, by_t in acc.items()}


def vidur_model_config(path: str | Path, name: str | None = None) -> ModelConfig:
    """The model shape recorded in a Vidur profile (Llama family: gated MLP, head_dim = h / heads)."""
    row = _rows(Path(path), 1)[0]
    if row["use_gated_mlp"] != "True":
        raise ValueError(f"{path}: not a gated-MLP (Llama-family) profile")
    hidden, heads = int(row["n_embd"]), int(row["n_head"])
    # The profile does not record the depth; both profiled Llama models have 32 layers.
    return ModelConfig.from_hf_dict({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": int(row["n_expanded_embd"]),
        "num_hidden_layers": 32, "num_attention_heads": heads,
        "num_key_value_heads": int(row["n_kv_head"]), "vocab_size": int(row["vocab_size"]),
    }, name=name or Path(path).parent.name)


LLAMA2_7B_HF = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
}


def llama2_7b() -> ModelConfig:
    return ModelConfig.from_hf_dict(LLAMA2_7B_HF, name="llama-2-7b")


# numbers.md: Llama-3-8B on A100-80GB, FlashInfer attention summed over 32 layers (ms).
A100_LLAMA3_8B_PREFILL_ATTENTION_MS = {512: 1.5, 1024: 3.5, 2048: 9.9, 4096: 30.7}  # batch 1
A100_LLAMA3_8B_DECODE_ATTENTION_MS = {  # (batch, context per request) -> ms per step
    (1, 1024): 0.77, (8, 1024): 1.25, (32, 1024): 3.17, (128, 1024): 11.1, (32, 4032): 10.7, (64, 4032): 21.6,
}
A100_LLAMA3_8B_LAYERS = 32
# numbers.md end to end (linear + attention, no LM head), ms.
A100_LLAMA3_8B_PREFILL_MS = {512: 36.2, 1024: 78.7, 2048: 155.6, 4096: 304.5}  # batch 1
A100_LLAMA3_8B_DECODE_MS = {(1, 1024): 10.5, (8, 1024): 11.2, (32, 1024): 14.1, (128, 1024): 24.3,
                            (32, 4032): 21.6, (64, 4032): 32.8}
