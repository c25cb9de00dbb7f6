"""Tensor parallelism of the dense decoder (Megatron-style): one rank of N holds a contiguous group of
the KV heads with the query heads that read them, and a contiguous slice of the MLP's width. QKV and
gate/up are split by output rows (column-parallel), o_proj and down_proj by input columns
(row-parallel), and the partial sums of those two are added across the ranks by an all-reduce — two
per layer. Everything else (embedding, norms, RoPE, the head) is replicated, so each rank ends with
the whole hidden state and the same logits.

A rank is the same model class run on a smaller `ModelConfig` (its own head counts and MLP width), so
every attention kernel, the paged KV pool (its KV heads only) and the runner serve it unchanged.

Heads need not divide evenly: SmolLM2-135M has 3 KV heads, so 2 ranks hold 2 and 1 (with 6 and 3
query heads) — correct, if unbalanced. Where there are fewer KV heads than ranks, each KV head is
replicated on N / KVH ranks, which split its query heads. The sums are taken by whatever
`torch.distributed` process group is given (gloo across CPU processes, NCCL across GPUs); in one
process with tp_size 1 nothing is reduced.

Float weights only: the int8 (W8A8) and FP8 models, mixture-of-experts layers and the fused
tied head-norm of rotated int8 models are refused by name."""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engines.model_config import ModelConfig
from engines.quant.fp8 import is_fp8_state


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `tp_size` holds: query heads [q_start, q_end), KV heads [kv_start, kv_end)
    and MLP columns [mlp_start, mlp_end), in the full model's numbering."""

    rank: int
    tp_size: int
    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    mlp_start: int
    mlp_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start

    @property
    def mlp_width(self) -> int:
        return self.mlp_end - self.mlp_start


def _even(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are cut into `parts` contiguous runs whose sizes
    differ by at most one (the larger first)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def plan_shard(config: ModelConfig, tp_size: int, rank: int) -> RankShard:
    """Rank `rank`'s share of `config`'s heads and MLP, or a ValueError saying why the model cannot be
    split `tp_size` ways."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of tp_size {tp_size}: expected 0 <= rank < tp_size, tp_size >= 1")
    if config.num_experts:
        raise ValueError(f"{config.name}: tensor parallelism of mixture-of-experts layers is not implemented")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv_heads  # query heads per KV head
    if kv_heads >= tp_size:
        kv_start, kv_end = _even(kv_heads, tp_size, rank)
        q_start, q_end = kv_start * group, kv_end * group
    elif tp_size % kv_heads == 0 and group % (tp_size // kv_heads) == 0:
        copies = tp_size // kv_heads  # ranks sharing one KV head, each with a slice of its query heads
        kv_start = rank // copies
        kv_end = kv_start + 1
        per = group // copies
        q_start = kv_start * group + (rank % copies) * per
        q_end = q_start + per
    else:
        raise ValueError(f"{config.name}: {kv_heads} KV heads ({heads} query heads) cannot be split over {tp_size} "
                         f"ranks: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and "
                         f"each KV head's {group} query heads a multiple of the ranks that share it")
    if config.intermediate_size < tp_size:
        raise ValueError(f"{config.name}: an MLP of width {config.intermediate_size} cannot be split {tp_size} ways")
    mlp_start, mlp_end = _even(config.intermediate_size, tp_size, rank)
    return RankShard(rank, tp_size, q_start, q_end, kv_start, kv_end, mlp_start, mlp_end)


def shard_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The config of the model one rank runs: its head counts and MLP width (head_dim unchanged)."""
    return config.model_copy(update={"num_attention_heads": shard.num_heads, "num_key_value_heads": shard.num_kv_heads,
                                     "intermediate_size": shard.mlp_width})


def _qkv_rows(config: ModelConfig, shard: RankShard) -> torch.Tensor:
    d = config.head_dim
    q = torch.arange(shard.q_start * d, shard.q_end * d)
    k = config.q_size + torch.arange(shard.kv_start * d, shard.kv_end * d)
    v = config.q_size + config.kv_size + torch.arange(shard.kv_start * d, shard.kv_end * d)
    return torch.cat([q, k, v])


def shard_state(state: dict[str, torch.Tensor], config: ModelConfig, shard: RankShard) -> dict[str, torch.Tensor]:
    """The float state dict of one rank (copies of its slices, contiguous; replicated tensors are the
    same tensors). Refuses a quantized state by name."""
    if any(name.endswith(".qweight") for name in state) or is_fp8_state(state):
        raise ValueError("tensor parallelism takes float weights; this state is quantized (int8 or FP8): "
                         "serve it with --quantization none")
    rows = _qkv_rows(config, shard)
    d, i = config.head_dim, config.intermediate_size
    q_cols = slice(shard.q_start * d, shard.q_end * d)
    mlp = torch.cat([torch.arange(shard.mlp_start, shard.mlp_end), i + torch.arange(shard.mlp_start, shard.mlp_end)])
    out = {}
    for name, tensor in state.items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            tensor = tensor.index_select(0, rows)
        elif name.endswith("o_proj.weight"):
            tensor = tensor[:, q_cols]
        elif name.endswith("gate_up_proj.weight"):
            tensor = tensor.index_select(0, mlp)
        elif name.endswith("down_proj.weight"):
            tensor = tensor[:, shard.mlp_start:shard.mlp_end]
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            # a row-parallel bias is added once, after the sum: rank 0 keeps it, the others hold zeros
            tensor = tensor if shard.rank == 0 else torch.zeros_like(tensor)
        out[name] = tensor.contiguous()
    return out


class SumAcrossRanks(nn.Module):
    """A row-parallel projection: each rank's partial product, summed over the group in place."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.group is not None:
            dist.all_reduce(y, group=self.group)
        return y


def parallelize(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Wrap every layer's o_proj and down_proj of a rank's model so that their outputs are summed
    over `group` (None: a single rank, nothing to sum). Returns the model."""
    for layer in model.layers:
        if not isinstance(layer.o_proj, nn.Linear) or not isinstance(getattr(layer, "down_proj", None), nn.Linear):
            raise ValueError("tensor parallelism takes the float decoder (nn.Linear projections, a dense MLP)")
        layer.o_proj = SumAcrossRanks(layer.o_proj, group)
        layer.down_proj = SumAcrossRanks(layer.down_proj, group)
    return model


def build_rank_model(config: ModelConfig, state: dict[str, torch.Tensor], tp_size: int, rank: int,
                     group: dist.ProcessGroup | None, device: torch.device | str = "cpu"):
    """(the rank's config, its model): `state` is the whole model's float state dict."""
    from engines.model.build import build_model  # deferred: the model package imports kernels

    shard = plan_shard(config, tp_size, rank)
    local = shard_config(config, shard)
    model = build_model(local, shard_state(state, config, shard), device)
    return local, parallelize(model, group if tp_size > 1 else None)


# -- one scheduler, N ranks: rank 0 drives, the others follow ---------------------------------------
#
# A worker split over N ranks runs its scheduler once, on rank 0. Every call rank 0 makes on its runner
# is first sent to the other ranks, which make the same call on theirs: their layers then meet rank
# 0's in the same all-reduces. What is sent is JSON (the operation, the chunks' token ids, starts,
# page tables and logits kinds, a batch's id, the worker's current share of units), broadcast as bytes
# over the group — never a pickle. Only rank 0 samples: a follower runs the layers and skips the head.

_OPS = ("start", "run_layers", "finish", "forward", "stop")


def _chunk_json(chunk) -> list:
    return [list(map(int, chunk.token_ids)), int(chunk.start), list(map(int, chunk.page_table)), chunk.logits]


def _send(group, message: dict) -> None:
    data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=dist.get_global_rank(group, 0), group=group)
    dist.broadcast(data, src=dist.get_global_rank(group, 0), group=group)


def _receive(group) -> dict:
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=dist.get_global_rank(group, 0), group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=dist.get_global_rank(group, 0), group=group)
    message = json.loads(bytes(data.numpy()).decode())
    if not isinstance(message, dict) or message.get("op") not in _OPS:
        raise ValueError(f"not a runner call: {str(message)[:200]}")
    return message


class LeadingRunner:
    """Rank 0's runner: the `ModelRunner` interface the loops use (start, run_layers, finish, forward),
    each call sent to the following ranks before its layers run here. A batch started here carries an
    id the followers key their own in-flight state by (a preempted batch and its preemptor are both in
    flight); a batch dropped before it finished (its requests aborted) is named in the next message,
    so the followers drop theirs too. `units()`: the worker's current share, sent with every call so
    the followers run on their part of it (None: they keep what they have).

    A call that fails after it was sent (a layer raised here, or a peer is gone) leaves the ranks out
    of step — the followers may wait in a collective this rank will never join: `broken` is then
    set, and every later call refuses to run."""

    def __init__(self, runner, group: dist.ProcessGroup, units=None):
        self.runner, self.group, self.units = runner, group, units
        self._next_id = 0
        self._ids: dict[int, int] = {}  # id(LayerwiseState) -> batch id
        self._dropped: list[int] = []  # batches garbage-collected here before they finished
        self.broken = False

    def __getattr__(self, name):  # page_size, model, kv, device, ...: the local runner's
        return getattr(self.runner, name)

    def _send(self, message: dict) -> None:
        if self.broken:
            raise RuntimeError("the tensor-parallel ranks are out of step after a failed call: the worker must restart")
        if self.units is not None:
            message["units"] = int(self.units())
        if self._dropped:
            message["drop"], self._dropped = self._dropped, []
        _send(self.group, message)

    def _forget(self, key: int, batch: int) -> None:
        """A state collected before finish(): the followers drop their copy with the next message (a
        finalizer must not send: it may run in the middle of another message)."""
        if self._ids.get(key) == batch:
            del self._ids[key]
            self._dropped.append(batch)

    def start(self, chunks):
        state = self.runner.start(chunks)  # first here: a batch this rank refuses is never sent
        batch = self._next_id
        self._next_id += 1
        with self._sent({"op": "start", "batch": batch, "chunks": [_chunk_json(c) for c in chunks]}):
            pass
        self._ids[id(state)] = batch
        weakref.finalize(state, self._forget, id(state), batch)
        return state

    def _sent(self, message: dict):
        """Send `message`; the context it returns marks the ranks out of step if what follows raises."""
        try:
            self._send(message)
        except Exception:
            self.broken = True
            raise
        return _Mirrored(self)

    def run_layers(self, state, num_layers: int | None = None) -> bool:
        with self._sent({"op": "run_layers", "batch": self._ids[id(state)], "layers": num_layers}):
            return self.runner.run_layers(state, num_layers)

    def finish(self, state):
        with self._sent({"op": "finish", "batch": self._ids.pop(id(state))}):
            pass
        return self.runner.finish(state)  # the head, here alone: nothing the followers wait on

    def forward(self, chunks, between_layers=None):
        """As `ModelRunner.forward`: one message for a whole step (the followers run every layer; the
        hook, which only changes how this rank runs on, is this rank's)."""
        state = self.runner.start(chunks)
        with self._sent({"op": "forward", "chunks": [_chunk_json(c) for c in chunks]}):
            if between_layers is None:
                self.runner.run_layers(state)
            else:
                while not self.runner.run_layers(state, 1):
                    between_layers(state.next_layer)
        return self.runner.finish(state)

    def stop(self) -> None:
        """Ends the followers' loops."""
        with self._sent({"op": "stop"}):
            pass


class _Mirrored:
    """The part of a call the followers mirror: an exception in it breaks the leader."""

    def __init__(self, leader: LeadingRunner):
        self.leader = leader

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if kind is not None:
            self.leader.broken = True
        return False


def follow(runner, group: dist.ProcessGroup, apply_units=None) -> int:
    """A following rank's loop: make each call rank 0 sends on `runner` until it sends stop. Returns
    the number of calls made. The head is rank 0's alone: a follower runs the layers (their all-reduces
    need it) and never computes logits. `apply_units(n)`: run on this rank's part of an n-unit share."""
    from engines.runner import SeqChunk  # deferred: the runner module imports the model and its kernels

    def chunks(message):
        return [SeqChunk(ids, start, table, logits) for ids, start, table, logits in message["chunks"]]

    inflight: dict[int, object] = {}
    calls, units = 0, None
    while True:
        message = _receive(group)
        for batch in message.get("drop", ()):
            inflight.pop(batch, None)
        if apply_units is not None and message.get("units") not in (None, units):
            units = message["units"]
            apply_units(units)
        op = message["op"]
        if op == "stop":
            return calls
        calls += 1
        if op == "start":
            inflight[message["batch"]] = runner.start(chunks(message))
        elif op == "run_layers":
            runner.run_layers(inflight[message["batch"]], message["layers"])
        elif op == "finish":
            inflight.pop(message["batch"])
        else:
            runner.run_layers(runner.start(chunks(message)))
