"""The launcher's KV pool on a CPU: made in shared memory in place (not zeros copied into a segment),
zero, shaped as the engine's pool, and one storage with the worker processes it is handed to."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from bullet.shared.model import _shared_kv_pool
from engines.kv_pool import KVPool
from engines.model_config import ModelConfig

CONFIG = ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "vocab_size": 128, "max_position_embeddings": 256}, name="tiny")
CONFIG_SMOLLM2 = ModelConfig.builtin("smollm2-135m")


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


def test_shared_memory_that_cannot_hold_the_pool_is_a_clear_error_before_anything_is_made(monkeypatch):
    import os
    from types import SimpleNamespace

    import bullet.shared.model as shared_model
    from engines.weights import ModelLoadError

    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=1, f_frsize=os.sysconf("SC_PAGE_SIZE")))
    with pytest.raises(ModelLoadError, match=r"the KV pool \(4 pages of 16 tokens\) needs .* --max-total-tokens .* --shm-size"):
        _shared_kv_pool(CONFIG, 4, 16, torch.float32, torch.device("cpu"))
    weights = [torch.zeros(1 << 20), torch.zeros(8).share_memory_()]
    assert shared_model._storage_bytes(weights + [weights[0][:10]], unshared_only=True) == 4 << 20  # shared ones and views not counted
    with pytest.raises(ModelLoadError, match="the weights of tiny needs"):
        shared_model._require_shm_room(shared_model._storage_bytes(weights, unshared_only=True), "the weights of tiny")


@pytest.mark.slow
def test_a_server_whose_pool_does_not_fit_in_shared_memory_exits_with_the_reason_and_leaves_nothing():
    """A pool of twice what /dev/shm has free: the launch fails at start with the reason in one line and
    exit code 1 (without the check, the pool's pages would be taken while serving, and a worker would
    die of SIGBUS mid-request)."""
    import os
    import subprocess
    import sys

    from artifact.server import ROOT, free_port
    from tests.server_utils import bullet_segments

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this system")
    st = os.statvfs("/dev/shm")
    per_token = CONFIG_SMOLLM2.num_hidden_layers * 2 * CONFIG_SMOLLM2.num_key_value_heads * CONFIG_SMOLLM2.head_dim * 4
    tokens = 2 * st.f_bavail * st.f_frsize // per_token + 1024
    before = bullet_segments()
    done = subprocess.run([sys.executable, "-m", "bullet.cli", "launch", "--dtype", "float32", "--policy", "static",
                           "--port", str(free_port()), "--max-total-tokens", str(tokens)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("bullet launch: ")]
    assert len(said) == 1 and "of shared memory, but /dev/shm has" in said[0] and "--max-total-tokens" in said[0], done.stderr
    assert "Traceback" not in done.stderr  # the reason in one line, not uvicorn's report of the lifespan
    assert bullet_segments() == before
