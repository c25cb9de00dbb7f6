"""The launcher's KV pool on a CPU: made in shared memory in place (not zeros copied into a segment),
zero, shaped as the engine's pool, and one storage with the worker processes it is handed to."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from bullet.shared.model import _shared_kv_pool
from engines.kv_pool import KVPool
from engines.model_config import ModelConfig

CONFIG = ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "vocab_size": 128, "max_position_embeddings": 256}, name="tiny")


def _write_slot(pool: torch.Tensor, slot: int) -> None:
    pool[:, :, :, slot] = 1.5


def test_the_pool_is_shared_zero_and_written_through_by_a_spawned_worker():
    for dtype in (torch.float32, torch.bfloat16):
        pool = _shared_kv_pool(CONFIG, 4, 16, dtype, torch.device("cpu"))
        assert pool.is_shared() and pool.dtype == dtype and pool.is_contiguous()
        assert tuple(pool.shape) == tuple(KVPool(CONFIG, 4, 16, dtype).tensor.shape)
        assert not pool.any()
    child = mp.get_context("spawn").Process(target=_write_slot, args=(pool, 37))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert (pool[:, :, :, 37] == 1.5).all() and not pool[:, :, :, 36].any() and not pool[:, :, :, 38].any()
