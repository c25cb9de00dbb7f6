"""Weights and the paged KV pool, allocated once by the launcher and handed to the workers by
handle: on the CPU the tensors live in shared memory (torch.multiprocessing passes their file
descriptors), on CUDA they are shared by IPC handle (the same reductions). Workers build their
model around these tensors with `assign=True`, so nothing is copied."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bullet.config import ServerArgs
from bullet.partition.cuda_access import CudaAccess, tensor_device
from bullet.shm.segments import SHM_DIR, shm_free_bytes
from engines.chat_templates import read_template
from engines.device import quantization_for, require_device, resolve_dtype, resolve_kv_dtype
from engines.host import release_free_heap
from engines.kv_pool import KVPool
from engines.model_config import ModelConfig
from engines.tensor_parallel import plan_shard, shard_config, shard_state
from engines.tokenizer import Tokenizer, load_tokenizer
from engines.weights import DEFAULT_MODEL, ModelLoadError, load_weights, resolve_model_path


@dataclass
class SharedModel:
    config: ModelConfig
    state: dict[str, torch.Tensor]  # shared weights, model naming
    kv: torch.Tensor  # [layers, 2, slots, kv heads, head dim], shared
    num_pages: int
    page_size: int
    device: torch.device  # the serving device, with its index (engines.device.resolve_device)
    dtype: str
    model_name: str
    tokenizer_dir: str | None  # an HF tokenizer directory equivalent to the model's tokenizer
    source: str | None = None  # the file or directory the weights came from
    eos_token_ids: tuple[int, ...] = ()  # from the config and the tokenizer
    quantization: str = "none"  # how the weights are served: none | w8a8_int8 | fp8 (what a profile must measure)
    # tensor parallelism (--tp-size): this is rank `tp_rank`'s shard of `tp_size` — `config` is the
    # shard's (its heads and MLP width), `whole_config` the model's (what the estimator prices)
    tp_rank: int = 0
    tp_size: int = 1
    whole_config: ModelConfig | None = None

    def __post_init__(self):
        require_device(self.device)

    @property
    def model_config(self) -> ModelConfig:
        """The whole model's config, whichever shard this is."""
        return self.whole_config or self.config

    def weight_bytes(self) -> int:
        return _storage_bytes(self.state.values())

    def kv_bytes(self) -> int:
        return self.kv.untyped_storage().nbytes()


def _share(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t.share_memory_()
    return t.to(device)  # CUDA tensors are shared by IPC handle when sent to a spawned process


def _require_shm_room(nbytes: int, what: str, lower: str = "") -> None:
    """A clear error now if `nbytes` more of shared memory cannot fit in /dev/shm. Without it the
    weights' copy would die of SIGBUS in the launcher, and the pool (made in place, its pages taken
    when first written) would kill a worker mid-request — Docker gives a container 64 MB by default.
    `lower`: what the user can lower instead, if anything."""
    free = shm_free_bytes()
    if free is not None and nbytes > free:
        raise ModelLoadError(
            f"{what} needs {nbytes / 2**30:.2f} GiB of shared memory, but {SHM_DIR} has {free / 2**30:.2f} GiB free: "
            f"{lower + ', or ' if lower else ''}give it more room (in Docker: --shm-size)")


def _storage_bytes(tensors, unshared_only: bool = False) -> int:
    """Bytes of the storages under `tensors`, each once (views share one); `unshared_only`: of those not
    in shared memory yet, i.e. what sharing `tensors` copies there."""
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        if not (unshared_only and storage.is_shared()):
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def _shared_kv_pool(config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The KV pool's tensor, shared. On a CPU it is made in shared memory directly: a new segment
    reads as zeros and its pages are only touched when written. Zeros in private memory copied into a
    segment wrote the whole pool twice: 0.8-0.9 s for the default 1.4 GB pool on 2 cores, against
    0.12 s made in place (seconds more for a big host's pool)."""
    if device.type != "cpu":
        return _share(KVPool(config, num_pages, page_size, dtype, device).tensor, device)
    shape = KVPool.shape_for(config, num_pages, page_size)
    nbytes = math.prod(shape) * dtype.itemsize
    _require_shm_room(nbytes, f"the KV pool ({num_pages} pages of {page_size} tokens)",
                      "lower --max-total-tokens (the KV pool)")
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)


def _load_tokenizer(args: ServerArgs, source: Path | None, load_format: str) -> Tokenizer:
    tokenizer = load_tokenizer(source, load_format, args.tokenizer_path)
    if args.chat_template:
        tokenizer.set_chat_template(read_template(args.chat_template))
    return tokenizer


def load_shared_model(args: ServerArgs, device: torch.device,
                      cuda: CudaAccess | None = None) -> tuple[SharedModel, Tokenizer | None]:
    """The model served on `device` (`bullet.launcher.device_choice.serving_device`); `cuda` replaces
    torch.cuda (tests: a fake GPU whose tensors stay in host memory)."""
    device = require_device(device)
    data = tensor_device(device, cuda)
    quantization = args.quantization
    if args.tp_size > 1 and quantization == "auto":  # the ranks split float weights (engines.tensor_parallel)
        quantization = "none"
    # The tokenizer loads beside the weights: transformers' import alone is ~2 s of one core, while
    # the weights' reads and copies into shared memory run in torch with the GIL released.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        path, load_format = resolve_model_path(args.model_path, args.load_format)
        pending = pool.submit(_load_tokenizer, args, path, load_format) \
            if load_format != "dummy" or args.tokenizer_path else None
        weights = load_weights(args.model_path, args.load_format, resolve_dtype(args.dtype, device), seed=args.seed,
                               device=data, quantization=quantization_for(quantization, args.dtype))
        dtype = weights.dtype  # the int8 model computes (and keeps its KV) in float32 whatever --dtype resolved to
        source = str(weights.source) if weights.source else None
        state = {}
        if data.type == "cpu":
            _require_shm_room(_storage_bytes(weights.state.values(), unshared_only=True),
                              f"the weights of {weights.config.name}")
        for name, tensor in weights.state.items():
            state[name] = _share(tensor, data)
        num_pages = args.num_pages
        kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype)
        kv = _shared_kv_pool(weights.config, num_pages, args.page_size, kv_dtype, data)
        tokenizer = pending.result() if pending is not None else None
    name = args.served_model_name or _model_name(args, weights.source, weights.config)
    eos = tuple(sorted(set(weights.config.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else set())))
    config, quantization = weights.config, weights.quantization
    del weights
    release_free_heap()
    return SharedModel(config, state, kv, num_pages, args.page_size, device, str(dtype).removeprefix("torch."),
                       name, str(tokenizer.source_dir) if tokenizer else None,
                       source, eos, quantization), tokenizer


def shard_shared_model(shared: SharedModel, tp_size: int) -> list[SharedModel]:
    """The `tp_size` ranks' shards of `shared` (`engines.tensor_parallel`), each with its own KV pool
    (its KV heads, the same pages), shared the same way; the prefill and decode ranks of one index
    share one shard. `shared`'s own split tensors and pool are no longer needed once this returns.
    A model that cannot be split (quantized weights, MoE layers, heads that do not divide) is a
    ValueError saying why."""
    if tp_size == 1:
        return [shared]
    data = shared.kv.device
    ranks = []
    for rank in range(tp_size):
        shard = plan_shard(shared.config, tp_size, rank)
        config = shard_config(shared.config, shard)
        state = {name: t if t.is_shared() or t.device.type != "cpu" else _share(t, data)
                 for name, t in shard_state(shared.state, shared.config, shard).items()}
        kv = _shared_kv_pool(config, shared.num_pages, shared.page_size, shared.kv.dtype, data)
        ranks.append(replace(shared, config=config, state=state, kv=kv, tp_rank=rank, tp_size=tp_size,
                             whole_config=shared.config))
    release_free_heap()
    return ranks


def _model_name(args: ServerArgs, source: Path | None, config: ModelConfig) -> str:
    if args.model_path is None:
        return DEFAULT_MODEL
    return Path(args.model_path).name.removesuffix(".gguf") if source else config.name
